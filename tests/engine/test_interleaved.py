"""Q4, Q5, Q6 and Q8 weights interleaved by 16 rows (kinds ``Q4I``, ``Q5I``, ``Q6I``, ``Q8I``, ``interleaved_avx512.h``).

The layout holds the same values as the row layout (dequantized bit for bit
equal). The AVX-512 VNNI kernel and its portable C twin compute the same
bits, for 16-bit and 8-bit activations and any number of activation rows,
so a row's result is the same in a batch of any size; against the quantized
activations times the dequantized weight they agree to float32 summation
order (1e-5 of the largest output; 1e-3 for the K-quants, whose sub-block
scales are rounded to float16 at repack), and with the row layout's integer
kernels on the same 8-bit blocks to summation order too (1e-5: the row
kernels sum two blocks per vector and reduce the lanes at the end, the
interleaved one block by block, so the bits differ).
"""

from __future__ import annotations

import pytest
import torch

from tartlet.engine.loading.quant_formats import F16, INTERLEAVED, Q4, Q4I, Q5I, Q6I, Q8I, QuantWeight, from_gguf, interleave
from tartlet.engine.models import quant_linear
from tartlet.engine.models.quant_linear import QuantLinear
from test_quant_kernels import isa_levels, random_gguf, rel_err

TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]


def q4(type_name: str, n: int, k: int, seed: int = 0) -> QuantWeight:
    return from_gguf(random_gguf(type_name, n, k, seed=seed), type_name, n, k)


@pytest.mark.parametrize("type_name", TYPES)
def test_interleave_keeps_every_value(kern, type_name):
    w = q4(type_name, 48, 256)
    wi = interleave(w)
    assert (wi.kind, wi.shape, wi.nbytes) == (INTERLEAVED[w.kind], w.shape, w.nbytes)
    for isa in isa_levels():
        kern.set_isa(isa)
        assert torch.equal(kern.dequantize(wi), kern.dequantize(w)), isa
    kern.set_isa(-1)
    rows = torch.tensor([47, 0, 16, 17, 16])
    assert torch.equal(kern.dequantize(wi, rows), kern.dequantize(w, rows))


def test_interleave_refuses_what_it_cannot_hold():
    with pytest.raises(ValueError, match="only q4, q5, q6 and q8 matrices with a multiple of 16 rows interleave, got q4 with 40 rows"):
        interleave(q4("Q4_0", 40, 64))
    with pytest.raises(ValueError, match="got f16 with 16 rows"):
        interleave(q4("F16", 16, 64))
    wi = interleave(q4("Q4_1", 32, 64))
    for wi in (wi, interleave(q4("Q5_1", 16, 64)), interleave(q4("Q6_K", 16, 256)), interleave(q4("Q8_0", 16, 64))):
        with pytest.raises(ValueError, match=r"interleaved \(q[4568]x16\) matrices cannot be stacked"):
            QuantWeight.cat([wi, wi])
        with pytest.raises(ValueError, match="cannot be selected"):
            wi.select_rows(torch.tensor([0]))


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_rows_do_not_depend_on_the_batch(kern, type_name, bits):
    """Every row count 1..19, 24, 31, 33, 40, 64, 70, 131 and 138 (8-bit Q4I's
    and Q8I's wide passes of 16 and the passes of 8 after them, passes of 8
    and every tail; Q5I's and Q6I's row tiles up to 128 rows, their passes beyond),
    a bias and a residual, 16-bit and 8-bit activations: each row's
    result is the same bits alone, in any slice and on every instruction
    set (the portable C twin, ``matmul_il_c``, below AVX-512 VNNI: the
    oracle of the AVX-512 kernel); against the exact product of the
    quantized activations."""
    k = 256 if type_name.endswith("_K") else 288
    w = q4(type_name, 64, k, seed=1)
    wi = interleave(w)
    held = kern.dequantize(w)
    g = torch.Generator().manual_seed(2)
    n = 138
    x, res, bias = torch.randn(n, k, generator=g) * 4, torch.randn(n, 64, generator=g), torch.randn(64, generator=g)
    x[:, ::5] *= 40  # both bytes of the 16-bit values matter
    qa, fa = kern.quantize(x, bits)
    full = torch.empty(n, 64)
    kern.matmul(wi, qa, fa, full, bias=bias, residual=res)
    xq = (qa.view(n, -1, 32).float() * fa[:, 0, :, None]).view(n, k)
    assert rel_err(full, xq @ held.T + bias + res) < (1e-3 if type_name.endswith("_K") else 1e-5)
    for isa in isa_levels():
        kern.set_isa(isa)
        for lo, hi in [(r, r + 1) for r in range(0, n, 7)] + [(0, m) for m in range(2, 20)] + [(0, 24), (0, 31), (3, 36), (2, 42), (0, 64), (1, 70), (1, 71), (7, n)]:
            out = torch.empty(hi - lo, 64)
            kern.matmul(wi, qa[lo:hi], fa[lo:hi], out, bias=bias, residual=res[lo:hi])
            assert torch.equal(out, full[lo:hi]), (type_name, isa, lo, hi)
    kern.set_isa(-1)


def test_stream_prefetch_changes_no_result_and_follows_the_vendor(kern, monkeypatch):
    """The weight-stream prefetch hint (non-temporal, or into L1: a speed
    choice, ``set_stream_prefetch``) leaves every result bit for bit as it
    was, at one row (the stream) and at 9 rows (Q5I's row tile); the default
    is by CPU vendor (L1 on Intel, where it measured 0.69-0.77x a batch-1
    step's time) unless ``TARTLET_STREAM_PREFETCH`` names one, and anything
    else there is refused."""
    from tartlet.engine.kernels.quant_kernels import stream_prefetch_nta

    for type_name in ("Q4_K", "Q5_K", "Q8_0"):
        wi = interleave(q4(type_name, 64, 256, seed=5))
        g = torch.Generator().manual_seed(6)
        for bits in (8, 16):
            qa, fa = kern.quantize(torch.randn(9, 256, generator=g), bits)
            outs = []
            for nta in (True, False, kern.stream_nta):
                before = kern.set_stream_prefetch(nta)
                try:
                    for m in (1, 9):
                        out = torch.empty(m, 64)
                        kern.matmul(wi, qa[:m], fa[:m], out)
                        outs.append(out)
                finally:
                    kern.set_stream_prefetch(before)
            assert all(torch.equal(outs[i], outs[i % 2]) for i in range(6)), (type_name, bits)  # [1 row, 9 rows] x 3
    assert stream_prefetch_nta("GenuineIntel", "") is False
    assert stream_prefetch_nta("AuthenticAMD", "") is True
    assert stream_prefetch_nta("GenuineIntel", "nta") is True
    assert stream_prefetch_nta("AuthenticAMD", "l1") is False
    with pytest.raises(ValueError, match="TARTLET_STREAM_PREFETCH must be 'nta' or 'l1', got 'T0'"):
        stream_prefetch_nta("GenuineIntel", "T0")
    monkeypatch.setenv("TARTLET_STREAM_PREFETCH", "nta")
    assert stream_prefetch_nta("GenuineIntel") is True


@pytest.mark.parametrize("type_name", TYPES)
def test_eight_bit_interleaved_against_the_row_layout(kern, type_name):
    """The same 8-bit blocks through the interleaved kernel and through the
    row layout's 8-bit kernel (every instruction set: tile_avx512, the
    AVX2 / 256-bit VNNI kernels, the portable C one), row counts 1, 3, 8,
    16, 17 and 64 with a bias and a residual: equal to float32 summation
    order (1e-5 of the largest output), not bit for bit (see the module
    docstring). The Q8 activations span the whole int8 range, so Q8I's
    ``- 128 sum(a)`` correction is exercised at its extremes."""
    k = 256 if type_name.endswith("_K") else 288
    w = q4(type_name, 48, k, seed=3)
    wi = interleave(w)
    g = torch.Generator().manual_seed(4)
    x, res, bias = torch.randn(64, k, generator=g), torch.randn(64, 48, generator=g), torch.randn(48, generator=g)
    x[:, 3] *= 300  # an outlier channel: the other values of its blocks round to few levels
    qa, fa = kern.quantize(x, 8)
    assert int(qa.min()) == -127 and int(qa.max()) == 127
    for isa in isa_levels():
        kern.set_isa(isa)
        for m in (1, 3, 8, 16, 17, 64):
            il, rows = torch.empty(m, 48), torch.empty(m, 48)
            kern.matmul(wi, qa[:m], fa[:m], il, bias=bias, residual=res[:m])
            kern.matmul(w, qa[:m], fa[:m], rows, bias=bias, residual=res[:m])
            assert rel_err(il, rows) < 1e-5, (type_name, isa, m)
    kern.set_isa(-1)


def test_quant_linear_interleaves_where_it_can(kern, monkeypatch):
    """``QuantLinear`` interleaves a Q4 (or Q5, Q6, Q8) run of a multiple of 16 rows that
    starts at a multiple of 16 outputs, with 16-bit or 8-bit activations, no
    bfloat16 panel and the AVX-512 VNNI kernels in use; the result equals
    the row layout's within rounding (1e-5 below 8 rows: summation order;
    from 8 the row layout's float panel multiplies unrounded 16-bit
    activations, so there the 16-bit rounding too: 1e-4; 8-bit activations
    take integer kernels at every row count in both layouts: 1e-5)."""
    if kern.best_isa < 3:
        pytest.skip("interleaving serves the AVX-512 VNNI kernel; this CPU has none")
    a, b, c = q4("Q4_1", 32, 256, 5), q4("F16", 16, 256, 6), q4("Q4_0", 48, 256, 7)
    b24, odd = q4("F16", 24, 256, 8), q4("Q4_0", 40, 256, 9)
    assert b.kind == F16
    kinds = lambda lin: [p.kind for p in lin.parts]  # noqa: E731
    lin = QuantLinear([a, b, c], None, kern)
    assert kinds(lin) == [Q4I, b.kind, Q4I]
    assert kinds(QuantLinear([b24, c], None, kern)) == [b.kind, Q4], "starts at output 24"
    assert kinds(QuantLinear([odd], None, kern)) == [Q4], "40 rows"
    assert kinds(QuantLinear([q4("Q8_0", 16, 256, 10), b], None, kern)) == [Q8I, b.kind]
    assert kinds(QuantLinear([q4("Q5_1", 16, 256, 11), b], None, kern)) == [Q5I, b.kind]
    assert kinds(QuantLinear([q4("Q6_K", 16, 256, 12), b], None, kern)) == [Q6I, b.kind]
    lin8 = QuantLinear([a, b, c], None, kern, act_bits=8)
    assert kinds(lin8) == [Q4I, b.kind, Q4I]
    if kern.has_bf16:
        assert kinds(QuantLinear([a], None, kern, bf16=True)) == [Q4]
    kern.set_isa(1)
    try:
        assert kinds(QuantLinear([a], None, kern)) == [Q4]
    finally:
        kern.set_isa(-1)
    monkeypatch.setattr(quant_linear, "INTERLEAVE", False)
    rows, rows8 = QuantLinear([a, b, c], None, kern), QuantLinear([a, b, c], None, kern, act_bits=8)
    assert kinds(rows) == kinds(rows8) == [Q4, b.kind, Q4]
    x = torch.randn(11, 256, generator=torch.Generator().manual_seed(9))
    for m in (1, 5, 11):  # the row layout's integer kernel below 8 rows, its float panel from 8
        assert rel_err(lin(x[:m]), rows(x[:m])) < (1e-5 if m < 8 else 1e-4), m
        assert rel_err(lin8(x[:m]), rows8(x[:m])) < 1e-5, m


def test_descriptor_refuses_a_misaligned_interleaved_part(kern):
    b, wi = q4("Q4_0", 24, 64), interleave(q4("Q4_0", 16, 64))
    with pytest.raises(ValueError, match="must start at a multiple of 16 outputs, not 24"):
        kern.linear_desc([b, wi], None, 16)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q8_0"])
def test_tied_head_keeps_one_copy(tmp_path, monkeypatch, type_name):
    """A tied Q4_0 or Q8_0 head (vocabulary padded to 272 = 17 x 16 rows) is
    interleaved once and the token lookups read that copy: resident weights
    stay within 1.2x of the file; logits of a prompt and 4 decode steps
    agree with the row layout's within the kernels' rounding, and the greedy
    tokens are equal."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.kernels.quant_kernels import load

    k = load()
    if k is None or k.best_isa < 3:
        pytest.skip("interleaving serves the AVX-512 VNNI kernel; this CPU has none")
    from test_loader import engine_logits
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "tied.gguf", {}, default=type_name, tied=True, vocab_multiple=16)
    eng = Engine.load(EngineConfig(model=str(path), kv_cache_mb=8))
    try:
        m = eng.model
        assert [p.kind for p in m.lm_head.parts] == [Q4I if type_name == "Q4_0" else Q8I] and m.embed is m.lm_head.parts[0]
        assert m.weight_bytes() <= 1.2 * path.stat().st_size
    finally:
        eng.close()
    ids = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 60]
    got = engine_logits(path, "auto", ids, split=7)
    monkeypatch.setattr(quant_linear, "INTERLEAVE", False)
    want = engine_logits(path, "auto", ids, split=7)
    assert rel_err(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("act_bits", [8, "auto"])
def test_eight_bit_projections_interleave_in_the_engine(tmp_path, monkeypatch, act_bits):
    """With ``act_bits`` 8 (every projection) or ``"auto"`` (8 bits into the
    output and down projections) the layer projections of a tiny Llama in a
    Q4_K / Q5_0 / Q6_K / Q8_0 mix are interleaved as with 16 bits (kinds
    ``Q4I``, ``Q5I``, ``Q6I``, ``Q8I``); the logits of a 7-token prompt and
    4 decode steps (the fused step: projections split into column chunks)
    agree with the row layout's to summation order (float32 KV pages: with
    float16 ones a value at a rounding boundary of the pages may land on
    the neighbouring level, ~2e-3 measured; measured 1.3e-7 for 8 bits and
    7e-6 for "auto", whose 16-bit projections' float panel / one16 kernel
    sum in another order too), and the greedy tokens are equal."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.kernels.quant_kernels import load

    k = load()
    if k is None or k.best_isa < 3:
        pytest.skip("interleaving serves the AVX-512 VNNI kernel; this CPU has none")
    from test_loader import engine_logits
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "mix.gguf", {"attn_v": "Q6_K", "ffn_down": "Q8_0", "ffn_up": "Q5_0"})
    eng = Engine.load(EngineConfig(model=str(path), kv_cache_mb=8, act_bits=act_bits))
    try:
        layer = eng.model.layers[0]
        kinds = {p: ([q.kind for q in layer[p].parts], layer[p].act_bits) for p in ("qkv", "o", "gate_up", "down")}
        low = 8 if act_bits == 8 else 16
        assert kinds == {"qkv": ([Q4I, Q6I], low), "o": ([Q4I], 8), "gate_up": ([Q4I, Q5I], low), "down": ([Q8I], 8)}
    finally:
        eng.close()
    ids = [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 60]
    got = engine_logits(path, "auto", ids, split=7, act_bits=act_bits, kv_dtype="float32")
    monkeypatch.setattr(quant_linear, "INTERLEAVE", False)
    want = engine_logits(path, "auto", ids, split=7, act_bits=act_bits, kv_dtype="float32")
    assert rel_err(got, want) < 1e-4
    assert torch.equal(got.argmax(-1), want.argmax(-1))
