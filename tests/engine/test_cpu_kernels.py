"""The fused C kernels equal the PyTorch ops they replace, and their absence
is survivable (the model falls back to PyTorch)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tartlet.engine.kernels import cpu_kernels

NH, NKV, HD = 9, 3, 64
SLOTS = 256 * 16


@pytest.fixture(scope="module")
def kern():
    if not cpu_kernels.find_compiler():
        pytest.skip("no C compiler on this machine: the engine runs the PyTorch path (tested elsewhere)")
    k = cpu_kernels.load()
    assert k is not None, "the C kernels did not build on this machine (see the warning logged)"
    return k


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_rms_norm(kern, rows):
    g = gen(rows)
    x = torch.randn(rows, 2 * 576, generator=g)[:, :576]  # strided rows
    w = torch.randn(576, generator=g)
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


@pytest.mark.parametrize("rows", [1, 7, 80])
def test_rope_qkv_store(kern, rows):
    g = gen(rows)
    qkv = torch.randn(rows, (NH + 2 * NKV) * HD, generator=g)
    freqs = torch.randint(0, 500, (rows, 1), generator=g).float() * (1e4 ** (-torch.arange(0, HD, 2) / HD))
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(SLOTS, generator=g)[:rows]
    kp, vp = torch.zeros(SLOTS, NKV, HD), torch.zeros(SLOTS, NKV, HD)
    q = kern.rope_qkv_store(qkv, cos, sin, kp, vp, slots, NH, NKV, HD)

    c, s = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    qk = qkv[:, : (NH + NKV) * HD].view(rows, NH + NKV, HD)
    want = qk * c + rotate_half(qk) * s
    torch.testing.assert_close(q, want[:, :NH], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kp[slots], want[:, NH:], rtol=1e-5, atol=1e-5)
    assert torch.equal(vp[slots], qkv[:, (NH + NKV) * HD :].view(rows, NKV, HD))
    untouched = torch.ones(SLOTS, dtype=torch.bool)
    untouched[slots] = False
    assert not kp[untouched].any() and not vp[untouched].any(), "wrote outside the write slots"


@pytest.mark.parametrize("rows", [1, 7, 80])
def test_rope_qkv_store_float16_pool(kern, rows):
    """A float16 pool gets the float32 kernel's keys and values rounded as
    ``Tensor.half()`` rounds them (bit for bit), and the same queries."""
    g = gen(100 + rows)
    qkv = torch.randn(rows, (NH + 2 * NKV) * HD, generator=g) * 300  # some values past float16's precision
    freqs = torch.randint(0, 500, (rows, 1), generator=g).float() * (1e4 ** (-torch.arange(0, HD, 2) / HD))
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.randperm(SLOTS, generator=g)[:rows]
    kp, vp = torch.zeros(SLOTS, NKV, HD), torch.zeros(SLOTS, NKV, HD)
    kh, vh = torch.zeros(SLOTS, NKV, HD, dtype=torch.float16), torch.zeros(SLOTS, NKV, HD, dtype=torch.float16)
    q = kern.rope_qkv_store(qkv, cos, sin, kp, vp, slots, NH, NKV, HD)
    qh = kern.rope_qkv_store(qkv, cos, sin, kh, vh, slots, NH, NKV, HD)
    assert torch.equal(qh, q)
    assert torch.equal(kh, kp.half()) and torch.equal(vh, vp.half())


def sdpa_reference(q, kp, vp, slots, bias):
    B, L = slots.shape
    k = kp[slots].transpose(1, 2)  # [B, nkv, L, hd]
    v = vp[slots].transpose(1, 2)
    mask = None if bias is None else bias.view(B, 1, 1, L)
    o = F.scaled_dot_product_attention(q[:, None].transpose(1, 2), k, v, attn_mask=mask, scale=HD**-0.5, enable_gqa=True)
    return o.transpose(1, 2).reshape(B, NH * HD)


@pytest.mark.parametrize("batch,length,masked", [(1, 1, False), (1, 40, False), (6, 37, True), (16, 130, True)])
def test_paged_decode_attention(kern, batch, length, masked):
    """Scattered pages, padding and holes in the mask, queries on chosen rows."""
    g = gen(batch * length)
    kp, vp = torch.randn(SLOTS, NKV, HD, generator=g), torch.randn(SLOTS, NKV, HD, generator=g)
    pages = torch.randperm(SLOTS // 16, generator=g)[: batch * -(-length // 16)].view(batch, -1)
    slots = (pages[:, :, None] * 16 + torch.arange(16)).reshape(batch, -1)[:, :length].contiguous()
    bias = None
    if masked:
        visible = torch.rand(batch, length, generator=g) > 0.3
        visible[:, -1] = True  # a token always sees itself
        visible[0, length // 2 :] = False  # padding of a shorter sequence
        visible[0, length // 2 - 1] = True
        bias = torch.zeros(batch, length).masked_fill_(~visible, float("-inf"))
    rows = torch.randperm(batch + 3, generator=g)[:batch]  # the batch's rows are scattered
    q_all = torch.randn(batch + 3, NH, HD, generator=g)
    out = torch.full((batch + 3, NH * HD), 7.0)
    kern.paged_decode_attention(q_all, kp, vp, slots, bias, rows, 0, out, HD**-0.5)
    want = sdpa_reference(q_all[rows], kp, vp, slots, bias)
    torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)
    others = torch.ones(batch + 3, dtype=torch.bool)
    others[rows] = False
    assert torch.all(out[others] == 7.0), "wrote rows outside the batch"

    # contiguous rows given by their start
    out2 = torch.zeros(batch + 3, NH * HD)
    kern.paged_decode_attention(q_all, kp, vp, slots, bias, None, 2, out2, HD**-0.5)
    torch.testing.assert_close(out2[2 : 2 + batch], sdpa_reference(q_all[2 : 2 + batch], kp, vp, slots, bias), rtol=1e-5, atol=1e-5)

    # float16 pools: the float32 arithmetic on the widened values, bit for bit
    out16, want16 = torch.full((batch + 3, NH * HD), 7.0), torch.full((batch + 3, NH * HD), 7.0)
    kern.paged_decode_attention(q_all, kp.half(), vp.half(), slots, bias, rows, 0, out16, HD**-0.5)
    kern.paged_decode_attention(q_all, kp.half().float(), vp.half().float(), slots, bias, rows, 0, want16, HD**-0.5)
    assert torch.equal(out16, want16)


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (3, 1), (5, 1023), (4, 1024), (7, 1025), (64, 3000)])
def test_argmax_rows_is_torch_argmax(kern, rows, vocab):
    """Greedy sampling's argmax: the same index as ``torch.argmax`` on random
    rows, on ties (the first maximum, across and within blocks of 1024),
    rows of -inf, +inf twice, NaNs (the first NaN wins, even after a larger
    number), -0.0 against 0.0, and strided rows."""
    x = torch.randn(rows, vocab, generator=gen(vocab))
    tie = x.clone()
    tie[:, -1] = x.max() + 1
    tie[:, vocab // 2] = x.max() + 1
    inf = x.clone()
    inf[0, vocab // 2] = inf[0, -1] = float("inf")
    nan = x.clone()
    nan[0, -1] = float("nan")
    nan[-1, vocab // 3] = float("nan")
    nan[-1, 0] = 1e30
    zeros = torch.zeros(rows, vocab)
    zeros[0, vocab // 3] = -0.0
    strided = torch.randn(rows, 2 * vocab, generator=gen(1))[:, :vocab]
    for t in (x, tie, inf, nan, zeros, torch.full((rows, vocab), float("-inf")), strided):
        assert kern.argmax_rows(t) == t.argmax(-1).tolist()
    assert kern.argmax_rows(torch.zeros(0, 5)) == []
    with pytest.raises(ValueError, match="argmax_rows"):
        kern.argmax_rows(x.double())


@pytest.mark.parametrize("vocab", [1, 1023, 1024, 1025, 3000, 49152])
def test_argmax_masked_is_torch_masked_argmax(kern, vocab):
    """Greedy sampling under a logit mask: the index ``torch.argmax`` gives
    for the row with its forbidden positions set to -inf, on sparse, half
    and full masks, ties inside and across blocks of 1024, a forbidden
    larger value, NaNs (an allowed one wins, a forbidden one is ignored);
    the first allowed position when every allowed value is -inf (torch says
    0 there, allowed or not); -1 when nothing is allowed."""
    g = gen(vocab)
    for density in (0.001, 0.5, 1.0):
        x = torch.randn(vocab, generator=g)
        m = torch.rand(vocab, generator=g) < density
        m[torch.randint(vocab, (1,), generator=g)] = True
        cases = [x]
        tie = x.clone()
        tie[m] = 7.0  # every allowed position ties: the first allowed one
        cases.append(tie)
        big = x.clone()
        big[~m] = 1e30  # forbidden maxima
        cases.append(big)
        nan_out = x.clone()
        nan_out[~m] = float("nan")
        cases.append(nan_out)
        for t in cases:
            assert kern.argmax_masked(t, m) == int(t.masked_fill(~m, float("-inf")).argmax()), density
        nan_in = x.clone()
        allowed_ids = m.nonzero().flatten()
        nan_in[allowed_ids[-1]] = float("nan")
        assert kern.argmax_masked(nan_in, m) == int(allowed_ids[-1])
        assert kern.argmax_masked(torch.full((vocab,), float("-inf")), m) == int(allowed_ids[0])
    assert kern.argmax_masked(torch.randn(vocab), torch.zeros(vocab, dtype=torch.bool)) == -1
    with pytest.raises(ValueError, match="argmax_masked"):
        kern.argmax_masked(torch.randn(vocab), torch.ones(vocab + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="argmax_masked"):
        kern.argmax_masked(torch.randn(vocab), torch.ones(vocab, dtype=torch.uint8))


def test_no_compiler_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="tartlet.engine.kernels.cpu_kernels"):
        assert cpu_kernels.load() is None
    assert "fused CPU kernels unavailable" in caplog.text and "no-such-cc" in caplog.text


def test_broken_compile_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    with caplog.at_level(logging.WARNING, logger="tartlet.engine.kernels.cpu_kernels"):
        assert cpu_kernels.load() is None
    assert "failed to compile" in caplog.text


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setenv("TARTLET_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None


def test_builds_into_cache_once(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path))
    assert cpu_kernels.load() is not None
    (lib,) = (tmp_path / "kernels").glob("cpu_kernels-*.so")
    mtime = lib.stat().st_mtime_ns
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    assert cpu_kernels.load() is not None
    assert lib.stat().st_mtime_ns == mtime, "rebuilt although the source did not change"


def test_portable_build_without_avx2(monkeypatch, tmp_path):
    """A CPU without AVX2/FMA gets the plain C loops; they give the same results."""
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    monkeypatch.setattr(cpu_kernels, "_cpu_flags", lambda: set())
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path))
    k = cpu_kernels.load()
    assert k is not None
    g = gen(1)
    kp, vp = torch.randn(SLOTS, NKV, HD, generator=g), torch.randn(SLOTS, NKV, HD, generator=g)
    slots = torch.randperm(SLOTS, generator=g)[: 3 * 50].view(3, 50)
    bias = torch.zeros(3, 50)
    bias[1, 20:] = float("-inf")
    q = torch.randn(3, NH, HD, generator=g)
    out = torch.zeros(3, NH * HD)
    k.paged_decode_attention(q, kp, vp, slots, bias, None, 0, out, HD**-0.5)
    torch.testing.assert_close(out, sdpa_reference(q, kp, vp, slots, bias), rtol=1e-5, atol=1e-5)
    x, w = torch.randn(4, 576, generator=g), torch.randn(576, generator=g)
    torch.testing.assert_close(k.rms_norm(x, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5), rtol=1e-5, atol=1e-5)
    # float16 pools: the plain C conversions round as Tensor.half() does, edge values included
    # (ties, subnormals, overflow to inf, inf, NaN), and read back exactly (the sums may run in
    # another order than over float32 pools)
    out16 = torch.zeros(3, NH * HD)
    k.paged_decode_attention(q, kp.half(), vp.half(), slots, bias, None, 0, out16, HD**-0.5)
    torch.testing.assert_close(out16, sdpa_reference(q, kp.half().float(), vp.half().float(), slots, bias), rtol=1e-5, atol=1e-5)
    n = (NH + 2 * NKV) * HD
    edge = torch.tensor([0.0, -0.0, 1e-8, 2.9802322e-08, 5.9604645e-08, 8.940697e-08, 6.0975552e-05, 6.1035156e-05,
                         1.0009765625, 1.00048828125, 1.00146484375, 65504.0, 65519.99, 65520.0, 1e6, -3e5,
                         float("inf"), float("-inf"), float("nan"), 1 / 3])
    qkv = torch.randn(2, n, generator=g) * torch.logspace(-9, 6, n)
    qkv[0, n - NKV * HD : n - NKV * HD + edge.numel()] = edge  # the values, stored as they are
    cos, sin = torch.ones(2, HD // 2), torch.zeros(2, HD // 2)
    ws = torch.tensor([5, 9])
    kp, vp = torch.zeros(16, NKV, HD), torch.zeros(16, NKV, HD)
    kh, vh = torch.zeros(16, NKV, HD, dtype=torch.float16), torch.zeros(16, NKV, HD, dtype=torch.float16)
    assert torch.equal(k.rope_qkv_store(qkv, cos, sin, kh, vh, ws, NH, NKV, HD), k.rope_qkv_store(qkv, cos, sin, kp, vp, ws, NH, NKV, HD))
    want_k, want_v = kp.half(), vp.half()
    assert torch.equal(kh.view(torch.int16), want_k.view(torch.int16))
    nan = want_v.isnan()
    assert torch.equal(vh.isnan(), nan) and torch.equal(vh[~nan], want_v[~nan])


def test_greedy_sampler_uses_the_argmax_kernel(kern, monkeypatch):
    """SlotSampler with the kernel gives what PyTorch's argmax gives (a
    masked row included), and PyTorch's argmax is not called."""
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec, SlotSampler

    V = 3000
    logits = torch.randn(4, V, generator=gen(5))
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[7, 2999]] = True
    slots = [OutputSlot(0, SamplerSpec()), OutputSlot(1, SamplerSpec(), allowed), OutputSlot(3, SamplerSpec())]
    want = SlotSampler(V).run(logits, slots)
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("torch.argmax was called"))
    got = SlotSampler(V, kern.argmax_rows).run(logits, slots)
    assert got == want and got[1] in (7, 2999)


def test_masked_greedy_slots_take_the_masked_argmax_kernel(kern, monkeypatch):
    """With ``argmax_masked``, a greedy slot with a mask is sampled without
    the masked copy of the logits (no clone), with the tokens PyTorch's
    masked path gives; an empty mask fails that slot alone; a masked draw
    still takes the copy."""
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec, SlotSampler
    from tartlet.sdk.errors import SamplingError

    V = 3000
    logits = torch.randn(4, V, generator=gen(6))
    masks = [torch.rand(V, generator=gen(i)) < 0.1 for i in range(3)]
    slots = [OutputSlot(0, SamplerSpec(), masks[0]), OutputSlot(1, SamplerSpec()),
             OutputSlot(2, SamplerSpec(), masks[1]), OutputSlot(3, SamplerSpec(), torch.zeros(V, dtype=torch.bool))]
    want = SlotSampler(V).run(logits, slots)
    with monkeypatch.context() as mp:
        mp.setattr(torch.Tensor, "clone", lambda *a, **k: pytest.fail("the logits were copied"))
        got = SlotSampler(V, kern.argmax_rows, kern.argmax_masked).run(logits, slots)
    assert got[:3] == want[:3] and isinstance(got[3], SamplingError) and isinstance(want[3], SamplingError)
    for i in (0, 2):
        assert bool(slots[i].allowed[got[i]])
    drawn = [OutputSlot(0, SamplerSpec(temperature=0.8, seed=3), masks[2])]
    assert SlotSampler(V, kern.argmax_rows, kern.argmax_masked).run(logits, drawn) == SlotSampler(V).run(logits, drawn)
