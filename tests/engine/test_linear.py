"""Linear: every weight layout gives F.linear's result, for every row count."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tartlet.engine.models.linear import Linear, onednn_packing_available

CPU = torch.device("cpu")
ROWS = [1, 2, 7, 16, 33]


def make(out: int = 96, inp: int = 64, bias: bool = False, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    b = torch.randn(out, generator=g) if bias else None
    return w, b


@pytest.mark.parametrize("pack,gemv", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_layouts_match_f_linear(pack, gemv, bias):
    w, b = make(bias=bias)
    lin = Linear(w, b, pack=pack, gemv_copy=gemv)
    if pack:
        assert onednn_packing_available(CPU, torch.float32)
        assert lin.packed is not None and lin.weight is None, "float32 CPU weights should be prepacked"
        assert (lin.weight_t is not None) == gemv
    for t in ROWS:
        x = torch.randn(t, 64)
        res = torch.randn(t, 96)
        torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(lin(x, residual=res), F.linear(x, w, b) + res, rtol=1e-5, atol=1e-4)


def test_non_contiguous_input():
    w, _ = make()
    lin = Linear(w, pack=True)
    x = torch.randn(5, 128)[:, :64]
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_packing_only_for_cpu_float32():
    assert not onednn_packing_available(CPU, torch.bfloat16)
    assert not onednn_packing_available(torch.device("meta"), torch.float32)


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="2-D"):
        Linear(torch.zeros(3))
    with pytest.raises(ValueError, match="bias shape"):
        Linear(torch.zeros(4, 2), torch.zeros(3))
