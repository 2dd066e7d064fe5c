"""The fused decode step's LoRA kernels alone (``lora_kernels.h``, issue 34),
through :meth:`QuantKernels.lora_apply`, on shapes the default model's
projections do not have: blocks and column ranges off the 16-column panel
grid, ranks not a multiple of 8 or 16, a block with no ranks, ``k`` not a
multiple of 4, a block of more ranks than the wide B path takes. Every
instruction-set level the machine has (AVX-512, AVX2, portable C) computes
the same bits, equal to ``(x @ A^T) @ B^T`` of the stored values, and
leaves the columns outside the range alone; row counts from 1 to 53 take
every way the kernels split rows into passes (AVX-512: up to 7 rows an A
pass, 4 a narrow B pass, from 8 rows the wide B path in passes of up to 24),
and each row comes out as it does alone.

The decode steps with adapters against the op-by-op path are
``tests/engine/test_lora_fused.py``'s.
"""

from __future__ import annotations

import pytest
import torch

from tartlet.engine.kernels import quant_kernels
from tartlet.engine.kernels.fused_decode import LORA_STORAGE, lora_storage, lora_stored_values
from tartlet.engine.kernels.lora_layout import LORA_W, lora_mats, lora_pack

#: (k, n, blocks, r): unaligned blocks (one with no ranks), the default model's QKV, dense ones (the last
#: with more ranks than the wide B path takes, LORA_WIDE_RB)
CASES = [
    (45, 77, ((0, 30, 0, 7), (30, 53, 7, 20), (53, 77, 20, 20)), 20),
    (576, 960, ((0, 576, 0, 16), (576, 768, 16, 32), (768, 960, 32, 48)), 48),
    (64, 100, (), 5),
    (33, 300, (), 37),
    (18, 40, (), 130),
]

#: Rows of one adapter: the kernels take them 1-7 an A pass, 1-4 a narrow B pass, and from 8 rows (AVX-512)
#: in ceil(T / 24) near-equal wide B passes
ROWS = (1, 3, 6, 8, 13, 25, 53)


@pytest.fixture(scope="module")
def kern():
    k = quant_kernels.load()
    if k is None:
        pytest.skip("the quantized kernels cannot be built here")
    yield k
    k.set_isa(-1)


def matrices(k: int, n: int, blocks, r: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``at`` ``[k, r]`` and ``bt`` ``[r, n]``, zero off its blocks (as ``build_adapter`` fuses them)."""
    g = torch.Generator().manual_seed(seed)
    at, bt = torch.randn(k, r, generator=g), torch.randn(r, n, generator=g)
    if blocks:
        mask = torch.zeros(r, n, dtype=torch.bool)
        for n0, n1, c0, c1 in blocks:
            mask[c0:c1, n0:n1] = True
        bt[~mask] = 0
    return at, bt


def test_pack_layout():
    """Rank groups of ``at``; each block of ``bt`` as column panels on the
    16-column grid, zeros outside the block."""
    at = torch.arange(3 * 20, dtype=torch.float32).view(3, 20)
    bt = torch.arange(20 * 40, dtype=torch.float32).view(20, 40)
    ap, bp = lora_pack(at, bt, ((0, 20, 0, 4), (20, 40, 4, 20)))
    assert ap.shape == (2, 3, LORA_W) and torch.equal(ap[1, :, :4], at[:, 16:]) and not ap[1, :, 4:].any()
    assert torch.equal(ap[0], at[:, :16])
    first = bp[: 2 * 4 * LORA_W].view(2, 4, LORA_W)  # block 0: panels of columns 0-15, 16-31 (20-31 zero), ranks 0-3
    assert torch.equal(first[0], bt[:4, :16]) and torch.equal(first[1, :, :4], bt[:4, 16:20]) and not first[1, :, 4:].any()
    second = bp[2 * 4 * LORA_W :].view(2, 16, LORA_W)  # block 1: panels 16-31 (16-19 zero), 32-47 (40-47 zero), ranks 4-19
    assert torch.equal(second[0, :, 4:], bt[4:, 20:32]) and not second[0, :, :4].any()
    assert torch.equal(second[1, :, :8], bt[4:, 32:40]) and not second[1, :, 8:].any()
    dense_a, dense_b = lora_pack(at, bt, ())
    assert dense_b.numel() == 3 * 20 * LORA_W and torch.equal(dense_b.view(3, 20, LORA_W)[2, :, :8], bt[:, 32:])


@pytest.mark.parametrize("lora_dtype", list(LORA_STORAGE))
@pytest.mark.parametrize("case", range(len(CASES)))
def test_every_level_computes_the_same_update(kern, lora_dtype, case):
    k, n, blocks, r = CASES[case]
    dtype = LORA_STORAGE[lora_dtype]
    at, bt = matrices(k, n, blocks, r, case)
    sat, sbt, scale = lora_storage(at, bt, dtype)
    arr, keep = lora_mats([{"qkv": (sat, sbt, blocks, scale)}], [{"qkv": (k, n)}])
    va, vb = lora_stored_values(at, bt, dtype)
    g = torch.Generator().manual_seed(100 + case)
    for T in ROWS:
        x, y0 = torch.randn(T, k, generator=g), torch.randn(T, n, generator=g)
        want = ((x.double() @ va.double()) @ vb.double()).float()
        for lo, hi in ((0, n), (5, n - 3), (17, 18), (n // 2, n // 2)):
            outs = []
            for level in range(kern.best_isa + 1):
                assert kern.set_isa(level) == level
                y = y0.clone()
                kern.lora_apply(arr[0], x, y, lo, hi)
                outs.append(y)
            kern.set_isa(-1)
            for level, y in enumerate(outs):
                assert torch.equal(y, outs[0]), f"level {level} differs from portable C (T {T}, columns {lo}-{hi})"
            y = outs[0]
            assert torch.equal(y[:, :lo], y0[:, :lo]) and torch.equal(y[:, hi:], y0[:, hi:]), "columns outside the range"
            if T > 1 and lo == 5:  # the rows beside a row change none of its bits (the best level)
                for t in range(T):
                    alone = y0[t : t + 1].clone()
                    kern.lora_apply(arr[0], x[t : t + 1], alone, lo, hi)
                    assert torch.equal(alone[0], y[t]), f"row {t} of {T} differs from the row alone"
            tol = 1e-4 * (1 + float(want.abs().max()))
            assert hi == lo or float((y[:, lo:hi] - y0[:, lo:hi] - want[:, lo:hi]).abs().max()) < tol


def test_bad_arguments_are_refused(kern):
    at, bt = matrices(32, 48, (), 8, 0)
    arr, keep = lora_mats([{"qkv": (at, bt, (), None)}], [{"qkv": (32, 48)}])
    with pytest.raises(ValueError, match="columns"):
        kern.lora_apply(arr[0], torch.zeros(2, 32), torch.zeros(2, 48), 10, 49)
    with pytest.raises(ValueError, match="y must be"):
        kern.lora_apply(arr[0], torch.zeros(2, 32), torch.zeros(3, 48))
