"""RoPE angles (:class:`tartlet.engine.models.rope.Rotary`): the CPU tables that
serve ``cos_sin`` give the values of the direct computation bit for bit,
for every scaling kind, across table growth."""

from __future__ import annotations

import pytest
import torch

from tartlet.engine.models.rope import Rotary

SCALINGS = [
    None,
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "longrope", "short_factor": [1.0 + i / 64 for i in range(32)],
     "long_factor": [2.0 + i / 32 for i in range(32)], "original_max_position_embeddings": 4096},
    {"rope_type": "dynamic", "factor": 2.0},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "default" if s is None else s["rope_type"])
def test_cos_sin_tables_equal_the_direct_computation(scaling):
    rot = Rotary(64, 10000.0, scaling, 16384)
    g = torch.Generator().manual_seed(0)
    # small positions first (a first table), then past it (grown), then a decode step's one row
    for pos in (torch.arange(9), torch.randint(0, 30000, (300,), generator=g), torch.tensor([5000])):
        cos, sin = rot.cos_sin(pos)
        want_cos, want_sin = rot._cos_sin(pos)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert cos.shape == (pos.numel(), 32) and cos.is_contiguous() and sin.is_contiguous()
    if scaling is not None and scaling["rope_type"] == "dynamic":
        assert rot._tables is None  # a batch with a position past the threshold takes another formula: no table
    else:
        assert rot._tables is not None and rot._tables[0].shape[0] >= 30000
