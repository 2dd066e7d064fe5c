"""Quantized CPU kernels against the ``gguf`` package's dequantizers.

Weights are random GGUF blocks of every supported type (random quant bits,
sane float16 scales); the oracle is ``gguf.quants.dequantize``. Each kernel
runs on every instruction set this machine has (portable C included).

Tolerances:
* repacking is exact for the 32-block formats; K-quant sub-block scales are
  stored as one float16 product (relative rounding <= 2^-11 of the scale);
* against the exact product of the *quantized* activations with the
  dequantized weight, the kernels agree to float32 summation order (1e-5 of
  the largest output; 1e-3 for K-quants, from the scale rounding);
* against ``x @ dequantize(W).T`` in float: 8-bit activation blocks are
  within 2.5% of the largest output (1/254 per element, summed), 16-bit
  blocks within 1e-3.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from tartlet.engine.kernels import quant_kernels
from tartlet.engine.loading.quant_formats import BF16, F16, GGUF_TYPES, Q4, Q4I, Q6, Q6I, QuantWeight, from_gguf, quantize
from tartlet.engine.models import quant_linear
from tartlet.engine.models.quant_linear import QuantLinear

BLOCK_TYPES = [t for t in GGUF_TYPES if t not in ("F16", "BF16")]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")


def isa_levels():
    k = quant_kernels.load()
    return list(range(k.best_isa + 1)) if k is not None else [0]


def random_gguf(type_name: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF bytes of a random ``[n, k]`` matrix of ``type_name`` (weights
    of magnitude up to ~``scale``)."""
    import gguf.quants as gq

    rng = np.random.default_rng(seed)
    if type_name in ("F16", "BF16"):
        w = (rng.standard_normal((n, k)) * 0.05 * scale).astype(np.float32)
        return w.astype(np.float16).view(np.uint8) if type_name == "F16" else (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    block, size = gq.GGML_QUANT_SIZES[gq.GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (n * k // block, size), dtype=np.uint8)

    def f16(offset: int, size: float, sign: float = 1.0) -> None:
        vals = sign * scale * (rng.random(raw.shape[0]) * size + size * 0.1)
        raw[:, offset : offset + 2] = vals.astype(np.float16).view(np.uint8).reshape(-1, 2)

    if type_name == "Q6_K":
        f16(208, 0.002)
    elif type_name in K_QUANTS:
        f16(0, 0.002)
        f16(2, 0.002)
    elif type_name in ("Q4_1", "Q5_1"):
        f16(0, 0.01)
        f16(2, 0.1, -1.0)
    else:
        f16(0, 0.01)
    return raw


def dequant_reference(raw: np.ndarray, type_name: str, n: int, k: int) -> torch.Tensor:
    import gguf.quants as gq

    if type_name == "BF16":
        return torch.from_numpy((raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(n, k).copy())
    return torch.from_numpy(np.asarray(gq.dequantize(raw, gq.GGMLQuantizationType[type_name]), dtype=np.float32).reshape(n, k))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_repack_matches_gguf_dequantize(kern, type_name):
    n, k = 37, 512
    raw = random_gguf(type_name, n, k)
    w = from_gguf(raw, type_name, n, k)
    ref = dequant_reference(raw, type_name, n, k)
    tol = 2.0**-11 if type_name in K_QUANTS else 0.0
    for isa in isa_levels():  # the portable loop and the SIMD one
        kern.set_isa(isa)
        got = kern.dequantize(w)
        assert (got - ref).abs().max() <= tol * ref.abs().max(), (type_name, isa)
    kern.set_isa(-1)
    rows = torch.tensor([36, 0, 5, 5])
    assert torch.equal(kern.dequantize(w, rows), got[rows])


@pytest.mark.parametrize("isa", isa_levels())
@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_matmul_matches_dequantized_product(kern, isa, type_name):
    """Every row count 1..33 and odd shapes (an odd number of outputs, an odd
    number of blocks where the format allows), both activation precisions,
    on instruction set ``isa``."""
    assert kern.set_isa(isa) == isa
    shapes = ((37, 256), (64, 768)) if type_name in K_QUANTS else ((37, 96), (64, 288))
    for n, k in shapes:
        raw = random_gguf(type_name, n, k, seed=n)
        w = from_gguf(raw, type_name, n, k)
        ref_w = dequant_reference(raw, type_name, n, k)
        g = torch.Generator().manual_seed(k)
        for rows in range(1, 34):
            x = torch.randn(rows, k, generator=g)
            want = x @ ref_w.T
            out = torch.empty(rows, n)
            if w.kind in (F16, BF16):
                kern.matmul_half(w, x, out)
                assert rel_err(out, want) < 1e-5, (type_name, rows)
                continue
            for bits, tol in ((8, 2.5e-2), (16, 1e-3)):
                qa, fa = kern.quantize(x, bits)
                kern.matmul(w, qa, fa, out)
                assert rel_err(out, want) < tol, (type_name, isa, bits, rows)
                # exact: the quantized activations times the dequantized weight
                xq = (qa.view(rows, -1, 32).float() * fa[:, 0, :, None]).view(rows, k)
                exact_tol = 1e-3 if type_name in K_QUANTS else 1e-5
                assert rel_err(out, xq @ kern.dequantize(w).T) < exact_tol, (type_name, isa, bits, rows)
    kern.set_isa(-1)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"])
def test_one_row_every_block_tail(kern, type_name):
    """One activation row of 16-bit values (decode at batch 1; on AVX-512
    its own kernel, which takes blocks four at a time): every block count
    1..9 (so every tail of 1-3 blocks; K-quants: 8, 16, 24), activations
    with large values (both bytes of each 16-bit value matter), against the
    quantized activations times the dequantized weight, on every
    instruction set."""
    for isa in isa_levels():
        kern.set_isa(isa)
        for nb in (8, 16, 24) if type_name in K_QUANTS else range(1, 10):
            k = 32 * nb
            raw = random_gguf(type_name, 19, k, seed=nb)
            w = from_gguf(raw, type_name, 19, k)
            x = torch.randn(1, k, generator=torch.Generator().manual_seed(nb)) * 50
            x[0, ::7] *= -3
            qa, fa = kern.quantize(x, 16)
            out = torch.empty(1, 19)
            kern.matmul(w, qa, fa, out)
            xq = (qa.view(1, -1, 32).float() * fa[:, 0, :, None]).view(1, k)
            assert rel_err(out, xq @ kern.dequantize(w).T) < 1e-5, (type_name, isa, nb)
    kern.set_isa(-1)


@pytest.mark.parametrize("isa", isa_levels())
@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1", "Q5_0", "Q4_K", "Q6_K"])
def test_a_rows_result_does_not_depend_on_the_batch(kern, isa, type_name):
    """Each output row is computed with the same arithmetic whatever else
    shares the call (how many rows, which rows share an unpacked block or a
    tile of the panel GEMM, which weight rows share a panel): bitwise
    equal, so batching decode steps of several sequences does not change
    any one of them. Through the engine's entry point (``QuantLinear``): on
    AVX-512, 16-bit activations take the byte-split kernel below
    ``QuantKernels.panel_rows`` rows (8) and the float panel GEMM from there
    (equal within each range), 8-bit ones the integer kernels at any
    count; below AVX-512 the integer kernels up to ``DEQUANT_ROWS`` (40)."""
    kern.set_isa(isa)
    n, k = (37, 256) if type_name in K_QUANTS else (37, 96)
    w = from_gguf(random_gguf(type_name, n, k, seed=3), type_name, n, k)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(4))
    p = kern.panel_rows
    ranges = [(p - 1, ((0, 1), (p - 2, p - 1), (0, 2), (1, p - 1))),
              (15, ((0, 1), (7, 8), (0, 2), (3, 8), (2, 15))), (39, ((16, 39), (1, 34), (5, 22), (0, 16)))]
    if isa == 3:
        ranges.append((64, ((0, 16), (3, 40), (13, 64), (50, 64))))
    for bits in (8, 16):
        lin = QuantLinear([w], None, kern, act_bits=bits)
        for m, slices in ranges:
            full = lin(x[:m])
            for lo, hi in slices:
                if bits == 16 and isa == 3 and hi - lo < p <= m:
                    continue  # the two 16-bit ranges differ by rounding
                assert torch.equal(lin(x[lo:hi]), full[lo:hi]), (type_name, isa, bits, lo, hi)
    kern.set_isa(-1)


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_panel_gemm_matches_dequantized_product(kern, monkeypatch, type_name):
    """The float panel GEMM (AVX-512, from ``panel_rows`` rows, 16-bit activations or
    float16/bfloat16 weights): every format, output counts that leave a
    partial panel of 32 and a partial half, row counts 8..33 and 77 (tiles
    of 12 rows and every tail), a bias and a residual, against float32
    ``x @ W.T`` with the repacked weights the kernels hold (no activation
    rounding on this route), and against ``gguf``'s dequantization
    (K-quants: their repacked scales are float16, hence the looser bound)."""
    if kern.best_isa < 3:
        pytest.skip("the panel GEMM is the AVX-512 route; this CPU has no AVX-512 VNNI")
    kern.set_isa(3)
    monkeypatch.setattr(quant_linear, "INTERLEAVE", False)  # Q4 parts in the row layout, as the panel serves them
    k = 256 if type_name in K_QUANTS else (40 if type_name in ("F16", "BF16") else 96)
    for n in (75, 64, 9):
        raw = random_gguf(type_name, n, k, seed=n)
        w = from_gguf(raw, type_name, n, k)
        lin = QuantLinear([w], torch.randn(n), kern, act_bits=16)
        ref, held = dequant_reference(raw, type_name, n, k), kern.dequantize(w)
        g = torch.Generator().manual_seed(n)
        for rows in (*range(kern.panel_rows, 34), 77):
            x, res = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
            got = lin(x, residual=res)
            assert rel_err(got, x @ held.T + lin.bias + res) < 1e-5, (type_name, n, rows)
            assert rel_err(got, x @ ref.T + lin.bias + res) < (1e-3 if type_name in K_QUANTS else 1e-5), (type_name, n, rows)
    kern.set_isa(-1)


def bf16_panel(kern):
    if kern.best_isa < 3 or not kern.has_bf16:
        pytest.skip("the bfloat16 panel GEMM needs AVX-512 with AVX512_BF16")
    kern.set_isa(3)


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to bfloat16 (to nearest even, as ``vcvtne2ps2bf16``), in float64."""
    return t.to(torch.bfloat16).double()


@pytest.mark.parametrize("type_name", GGUF_TYPES)
def test_bf16_panel_gemm_matches_rounded_product(kern, monkeypatch, type_name):
    """``bf16=True`` (``matmul_dtype="bfloat16"``): the panel GEMM multiplies
    the bfloat16-rounded activations and dequantized weights with float32
    sums (``vdpbf16ps``). Every format, partial panels, row counts
    ``panel_rows``..33 and 77, a bias and a residual: against the float64
    product of the same rounded values within float32 summation error
    (1e-5 of the largest output; measured ~1e-6), and within 1e-2 of the
    float32 product (the rounding; measured ~2.5e-3). Below ``panel_rows``
    rows the 16-bit integer kernel runs, as without ``bf16`` (in the row
    layout: a ``bf16`` projection is never interleaved)."""
    bf16_panel(kern)
    monkeypatch.setattr(quant_linear, "INTERLEAVE", False)
    k = 256 if type_name in K_QUANTS else (40 if type_name in ("F16", "BF16") else 96)
    try:
        for n in (75, 64, 9):
            raw = random_gguf(type_name, n, k, seed=n)
            w = from_gguf(raw, type_name, n, k)
            bias = torch.randn(n)
            lin, ref16 = QuantLinear([w], bias, kern, act_bits=16, bf16=True), QuantLinear([w], bias, kern, act_bits=16)
            held = kern.dequantize(w)
            g = torch.Generator().manual_seed(n)
            for rows in (*range(kern.panel_rows, 34), 77):
                x, res = torch.randn(rows, k, generator=g), torch.randn(rows, n, generator=g)
                got = lin(x, residual=res)
                exact = bf16_round(x) @ bf16_round(held).T + bias.double() + res.double()
                assert rel_err(got.double(), exact) < 1e-5, (type_name, n, rows)
                assert rel_err(got, x @ held.T + bias + res) < 1e-2, (type_name, n, rows)
            x = torch.randn(kern.panel_rows - 1, k, generator=g)
            assert torch.equal(lin(x), ref16(x)), "fewer rows than panel_rows: the integer kernel"
    finally:
        kern.set_isa(-1)


def test_bf16_panel_rows_result_does_not_depend_on_the_batch(kern):
    """On the bfloat16 panel a row's result is one ``vdpbf16ps`` chain per
    output whatever shares its call: bitwise equal in every slice of
    ``panel_rows`` rows or more, through ``QuantLinear`` and the parts of a
    mixed-format projection."""
    bf16_panel(kern)
    k = 256
    parts = [from_gguf(random_gguf(t, n, k, seed=i), t, n, k) for i, (t, n) in enumerate((("Q4_K", 40), ("Q6_K", 24), ("F16", 8)))]
    lin = QuantLinear(parts, torch.randn(72), kern, act_bits=16, bf16=True)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(5))
    p = kern.panel_rows
    try:
        full = lin(x)
        for lo, hi in ((0, p), (3, 40), (13, 64), (50, 64), (7, 7 + p)):
            assert torch.equal(lin(x[lo:hi]), full[lo:hi]), (lo, hi)
    finally:
        kern.set_isa(-1)


def test_bf16_descriptor_needs_16_bit_activations_and_an_even_width(kern):
    w = from_gguf(random_gguf("F16", 8, 33), "F16", 8, 33)
    q = from_gguf(random_gguf("Q8_0", 8, 64), "Q8_0", 8, 64)
    if not kern.has_bf16:
        with pytest.raises(ValueError, match="need AVX512_BF16"):
            kern.linear_desc([q], None, 16, bf16=True)
        return
    with pytest.raises(ValueError, match=r"16-bit activations \(got 8\)"):
        kern.linear_desc([q], None, 8, bf16=True)
    with pytest.raises(ValueError, match=r"an even width \(got 33\)"):
        kern.linear_desc([w], None, 16, bf16=True)


@pytest.mark.parametrize("bits", [8, 16])
def test_activation_quantization_same_on_every_isa(kern, bits):
    """The SIMD quantizers round exactly as the portable C one (half to even,
    same scales), including rows with a zero block and exact halves."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(bits)) * 3
    x[1, 32:64] = 0.0
    x[2, :32] = torch.arange(32) - 15.5  # many values land on .5 after scaling
    got = []
    for isa in isa_levels():
        kern.set_isa(isa)
        got.append(kern.quantize(x, bits))
    kern.set_isa(-1)
    for qa, fa in got[1:]:
        assert torch.equal(qa, got[0][0])
        torch.testing.assert_close(fa, got[0][1], rtol=1e-6, atol=1e-6)


def test_isa_levels_agree(kern):
    """The SIMD paths compute what the portable C path computes (up to float summation order)."""
    raw = random_gguf("Q4_K", 50, 768)
    w = from_gguf(raw, "Q4_K", 50, 768)
    x = torch.randn(9, 768, generator=torch.Generator().manual_seed(3))
    outs = []
    for isa in isa_levels():
        kern.set_isa(isa)
        out = torch.empty(9, 50)
        qa, fa = kern.quantize(x, 8)
        kern.matmul(w, qa, fa, out)
        outs.append(out)
    kern.set_isa(-1)
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("act_bits", [8, 16])
def test_quant_linear_parts_bias_residual(kern, act_bits):
    """A fused projection of parts in different formats (Q4_K, Q6_K, F16 as in
    a Q4_K_M file) with a bias and a residual equals the float product."""
    k = 256
    parts, refs = [], []
    for i, (t, n) in enumerate((("Q4_K", 40), ("Q4_K", 24), ("Q6_K", 16), ("F16", 8))):
        raw = random_gguf(t, n, k, seed=i)
        parts.append(from_gguf(raw, t, n, k))
        refs.append(dequant_reference(raw, t, n, k))
    bias = torch.randn(88)
    lin = QuantLinear(parts, bias, kern, act_bits=act_bits)
    il = kern.isa == 3  # runs of 16k rows at outputs 16j: interleaved where they can be (either act_bits)
    assert [p.kind for p in lin.parts] == [Q4I if il else Q4, Q6I if il else Q6, F16], "runs of one kind are merged"
    assert (lin.in_features, lin.out_features) == (k, 88)
    x, res = torch.randn(5, k), torch.randn(5, 88)
    want = x @ torch.cat(refs).T + bias + res
    assert rel_err(lin(x, residual=res), want) < (2.5e-2 if act_bits == 8 else 1e-3)
    assert rel_err(lin(x[:, :]), x @ torch.cat(refs).T + bias) < (2.5e-2 if act_bits == 8 else 1e-3)


@pytest.mark.parametrize("isa", isa_levels())
def test_quant_linear_float_gemm_path(kern, monkeypatch, isa):
    """Prefill-sized calls multiply in float (AVX-512: the panel GEMM from
    ``tq_set_panel_rows`` rows; below: dequantized tiles and PyTorch's GEMM
    from ``DEQUANT_ROWS``); same result as the integer kernel."""
    from tartlet.engine.models import quant_linear

    kern.set_isa(isa)
    raw = random_gguf("Q5_K", 300, 512)
    w = from_gguf(raw, "Q5_K", 300, 512)
    lin = QuantLinear([w], torch.randn(300), kern, act_bits=16)
    x, res = torch.randn(7, 512), torch.randn(7, 300)
    previous = kern.set_panel_rows(10**9)
    try:
        by_kernel = lin(x, residual=res)
        kern.set_panel_rows(4)
        monkeypatch.setattr(quant_linear, "DEQUANT_ROWS", 4)
        monkeypatch.setattr(quant_linear, "_TILE", 512 * 64)  # several tiles
        by_gemm = lin(x, residual=res)
    finally:
        kern.set_panel_rows(previous)
        kern.set_isa(-1)
    assert rel_err(by_gemm, by_kernel) < 1e-3
    assert rel_err(by_gemm, x @ kern.dequantize(w).T + lin.bias + res) < 1e-5


def test_quant_linear_8bit_rows_do_not_depend_on_the_batch(kern, monkeypatch):
    """With 8-bit activations the float GEMM path multiplies the same 8-bit
    blocks the integer kernel sees, so a row's result is the same whether it
    runs alone (kernel) or inside a prefill-sized batch (GEMM): equal up to
    float summation order, far below 8-bit rounding (~1e-2)."""
    from tartlet.engine.models import quant_linear

    raw = random_gguf("Q4_1", 96, 512)
    lin = QuantLinear([from_gguf(raw, "Q4_1", 96, 512)], None, kern, act_bits=8)
    x = torch.randn(40, 512, generator=torch.Generator().manual_seed(5))
    x[:, 7] *= 300  # an outlier channel, as after an RMSNorm
    alone = torch.cat([lin(x[i : i + 1]) for i in range(40)])
    monkeypatch.setattr(quant_linear, "DEQUANT_ROWS", 32)
    assert rel_err(lin(x), alone) < 1e-5


def test_zero_rows_on_a_fresh_thread(kern):
    """A call with no rows (the LM head of a pass whose rows want no logits)
    returns an empty result, also on a thread that never allocated the
    kernels' per-thread activation buffer (it used to fail there with a
    MemoryError: a 0-byte buffer read as a failed allocation)."""
    import threading

    raw = random_gguf("Q4_1", 40, 96)
    results: list[object] = []
    for bits in (8, 16):
        lin = QuantLinear([from_gguf(raw, "Q4_1", 40, 96)], torch.randn(40), kern, act_bits=bits)

        def call(lin: QuantLinear = lin) -> None:
            try:
                results.append(lin(torch.empty(0, 96)))
            except Exception as e:  # noqa: BLE001 - reported below
                results.append(e)

        t = threading.Thread(target=call)
        t.start()
        t.join()
    assert [tuple(r.shape) if isinstance(r, torch.Tensor) else r for r in results] == [(0, 40), (0, 40)]


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_quantize_float_matrix(kern, name):
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1)) * 0.1
    q = quantize(w, name)
    step = {"q8_0": 1 / 127, "q5_0": 1 / 15, "q5_1": 1 / 31, "q4_0": 1 / 7, "q4_1": 1 / 15}[name]
    # round to nearest: each weight within half a step of its block's range
    assert float((kern.dequantize(q) - w).abs().max()) <= 0.51 * step * float(w.abs().max()) * 2
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize(torch.randn(4, 40), name)
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize(w, "q3_x")


def test_select_rows_and_cat():
    raw = random_gguf("Q6_K", 10, 256)
    w = from_gguf(raw, "Q6_K", 10, 256)
    idx = torch.tensor([3, 1, 4])
    part = w.select_rows(idx)
    assert part.shape == (3, 256) and torch.equal(part.q, w.q[idx]) and torch.equal(part.d, w.d[idx])
    both = QuantWeight.cat([part, w])
    assert both.shape == (13, 256) and torch.equal(both.q[3:], w.q)
    with pytest.raises(ValueError, match="one kind"):
        QuantWeight.cat([w, from_gguf(random_gguf("Q8_0", 2, 256), "Q8_0", 2, 256)])


def test_bad_sizes_are_clear_errors():
    with pytest.raises(ValueError, match="divisible by 256"):
        from_gguf(np.zeros(144, np.uint8), "Q4_K", 1, 128)
    with pytest.raises(ValueError, match="does not hold"):
        from_gguf(np.zeros(100, np.uint8), "Q4_0", 2, 64)
    with pytest.raises(ValueError, match="no quantized kernel"):
        from_gguf(np.zeros(100, np.uint8), "IQ2_XXS", 1, 256)


def test_disabled_or_unbuildable(monkeypatch, caplog, tmp_path):
    monkeypatch.setattr(quant_kernels, "_loaded", False)
    monkeypatch.setenv("TARTLET_QUANT_KERNELS", "0")
    assert quant_kernels.load() is None
    monkeypatch.setattr(quant_kernels, "_loaded", False)
    monkeypatch.delenv("TARTLET_QUANT_KERNELS")
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="tartlet.engine.kernels.quant_kernels"):
        assert quant_kernels.load() is None
    assert "GGUF weights will be dequantized" in caplog.text
