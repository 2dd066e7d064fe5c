"""Qwen2-architecture GGUF files as Qwen2.5-0.5B's Q4_K_M is made (issue 11 item 5).

That file (hidden 896, vocabulary 151936) holds QKV biases, an untied Q8_0
output head, a Q5_0 embedding and Q5_0 matrices wherever the width (896) is
not a multiple of 256, with Q4_K/Q6_K only in ``ffn_down``. Here a small random
``qwen2`` GGUF of the same type mix must give the float path's logits, and
the row-sliced repacking that keeps loading its 151936-row matrices from
holding a gigabyte of temporaries must give the same bytes as repacking whole.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tartlet.engine.loading.loader import load_model
from tartlet.engine.loading.quant_formats import from_gguf
from test_quant_kernels import random_gguf
from tiny_gguf import write_tiny_llama

#: Qwen2.5-Coder-0.5B-Instruct Q4_K_M's mix (first matching suffix wins).
QWEN25_MIX = {"token_embd": "Q5_0", "output": "Q8_0", "attn_v": "Q8_0", "blk.1.ffn_down": "Q4_K", "ffn_down": "Q6_K"}


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_row_sliced_repack_equals_whole(type_name):
    n, k = 37, 512  # 37 rows in slices of 3 (the last one shorter)
    raw = random_gguf(type_name, n, k, seed=3)
    whole = from_gguf(raw, type_name, n, k)
    sliced = from_gguf(raw, type_name, n, k, chunk_elements=3 * k)
    assert sliced.kind == whole.kind and sliced.shape == whole.shape == (n, k)
    for a, b in ((whole.q, sliced.q), (whole.d, sliced.d), (whole.m, sliced.m)):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_qwen2_quantized_mix_matches_float_path(tmp_path):
    """QKV biases, untied Q8_0 head, Q5_0 embedding and Q4_K/Q6_K ``ffn_down``
    through the quantized kernels against the dequantized float32 path (same
    bound as the Llama mixes in ``test_quantized_model``)."""
    from test_loader import engine_logits

    path = write_tiny_llama(tmp_path / "qwen2.gguf", QWEN25_MIX, default="Q5_0", arch="qwen2", qkv_bias=True)
    loaded = load_model(path, quantized=True)
    c = loaded.config
    assert c.architecture == "qwen2" and c.attention_bias and not c.tie_word_embeddings
    kinds = {name: getattr(w, "source", "F32") for name, w in loaded.weights.items()}
    assert kinds["model.embed_tokens.weight"] == "Q5_0" and kinds["lm_head.weight"] == "Q8_0"
    assert {kinds["model.layers.0.mlp.down_proj.weight"], kinds["model.layers.1.mlp.down_proj.weight"]} == {"Q6_K", "Q4_K"}
    assert float(loaded.weights["model.layers.0.self_attn.q_proj.bias"].abs().max()) > 0.1
    ids = list(range(3, 40))
    want = engine_logits(path, "float32", ids, split=20)
    got = engine_logits(path, "auto", ids, split=20)
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    assert np.isfinite(got.numpy()).all() and diff <= 5e-3 * scale, (diff, scale)
