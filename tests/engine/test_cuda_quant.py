"""Quantized weights on the GPU (issue 39): the Triton kernels of
:mod:`tartlet.engine.cuda.quant_matmul` against the dequantized weight.

The kernel tests also run on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``, Triton installed), where float16 stands in for
bfloat16; the engine test needs a CUDA GPU (and ``gguf`` to read the file).
References: each kind's weight dequantized by a float32 unpacking of the
repacked layout written here from ``quant_kernels.c``'s description, checked
against ``gguf.quants.dequantize`` of the original GGUF bytes and against the
CPU kernels' own dequantizer when they build.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton", reason="the CUDA path needs Triton")

from tartlet.engine.cuda import quant_matmul as qm  # noqa: E402
from tartlet.engine.loading.quant_formats import BF16, F16, Q4, Q5, Q6, Q8, QBYTES, QuantWeight, from_gguf  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
DEV = "cuda" if HAS_CUDA else "cpu"
HALF = torch.bfloat16 if HAS_CUDA else torch.float16
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs a CUDA GPU or TRITON_INTERPRET=1")]  # fmt: skip


def reference(w: QuantWeight) -> torch.Tensor:
    """Float32 ``[N, K]`` of a Q8/Q4/Q5/Q6 weight, unpacked in PyTorch from the layout."""
    n, k = w.shape
    nb = k // 32
    q = w.q.cpu().reshape(n, nb, QBYTES[w.kind]).to(torch.int32)
    if w.kind == Q8:
        v = q - 128
    else:
        v = torch.cat([q[..., :16] & 15, q[..., :16] >> 4], -1)  # [n, nb, 32]
        e = torch.arange(32)
        if w.kind == Q5:
            v = v | (((q[..., 16 + (e & 3)] >> (e >> 2)) & 1) << 4)
        if w.kind == Q6:
            v = (v | (((q[..., 16 + (e & 7)] >> (2 * (e >> 3))) & 3) << 4)) - 32
    assert w.d is not None
    d = w.d.cpu().float()
    if w.kind == Q6:
        scale = d.reshape(n, nb, 2).repeat_interleave(16, -1)
    else:
        scale = d.reshape(n, nb, 1)
    out = v.float() * scale
    if w.kind in (Q4, Q5):
        assert w.m is not None
        out = out + w.m.cpu().float().reshape(n, nb, 1)
    return out.reshape(n, k)


def gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[QuantWeight, np.ndarray]:
    """A random GGUF matrix of ``type_name`` repacked, and its raw bytes (needs ``gguf``)."""
    pytest.importorskip("gguf")
    from test_quant_kernels import random_gguf

    raw = random_gguf(type_name, n, k, seed=seed)
    return from_gguf(raw, type_name, n, k), raw


KIND_OF = {"q8": Q8, "q4": Q4, "q5": Q5, "q6": Q6}
#: (N, K): odd outputs; K of 11 and 40 blocks, not a multiple of any config's blocks per step; one K of 256 x 5
SHAPES = [(37, 352), (64, 1280), (5, 160)]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_K", "Q4_1", "Q5_K", "Q5_0", "Q6_K"])
def test_reference_matches_gguf_and_cpu_kernels(type_name):
    """The reference unpacking of the repacked layout equals gguf's dequantizer
    of the original bytes (K-quants: within the float16 rounding of their
    folded sub-block scales) and the CPU kernels' dequantizer; the GPU
    dequantizer equals the reference."""
    from test_quant_kernels import dequant_reference

    n, k = 19, 512
    w, raw = gguf_weight(type_name, n, k)
    ref = reference(w)
    want = dequant_reference(raw, type_name, n, k)
    tol = 1e-3 if type_name.endswith("_K") else 1e-6
    assert float((ref - want).abs().max()) <= tol * float(want.abs().max())
    from tartlet.engine.kernels import quant_kernels

    kern = quant_kernels.load()
    if kern is not None:
        assert float((kern.dequantize(w) - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
    got = qm.dequantize(qm.to_device(w, DEV), dtype=torch.float32)
    assert float((got.cpu() - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


@pytest.mark.parametrize("kind", list(KIND_OF))
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("min_programs", [1] if HAS_CUDA else [1, qm.MIN_PROGRAMS])  # on a GPU: fewer compiles
def test_matmul_matches_dequantized(kind, rows, shape, min_programs, monkeypatch):
    """``x @ W^T`` by the GEMV (1, 3 rows) and tensor-core (16, 40 rows;
    off by default, turned on here) kernels equals the float32 product with
    the dequantized weight: float32 activations within float32 rounding,
    half ones within half rounding; with the config's rows per program and
    with them halved for more programs."""
    monkeypatch.setattr(qm, "MIN_PROGRAMS", min_programs)
    monkeypatch.setattr(qm, "DOT_MAX_ROWS", 256)
    n, k = shape
    g = torch.Generator(device=DEV).manual_seed(rows * 1000 + n)
    w = qm.random_weight(KIND_OF[kind], n, k, DEV, generator=g)
    ref = reference(w)
    for dtype, tol in ((torch.float32, 1e-5), (HALF, 1.5e-2)):
        x = torch.randn(rows, k, device=DEV, generator=g).to(dtype)
        want = x.float().cpu() @ ref.t()
        got = qm.quant_matmul(x, w)
        assert got.dtype == dtype and got.shape == (rows, n)
        err = float((got.float().cpu() - want).abs().max() / want.abs().max())
        assert err <= tol, f"{kind} {rows}x{k} -> {n} {dtype}: relative error {err:.2e}"


@pytest.mark.parametrize("rows", [2, 20])
def test_bias_residual_and_column_slices(rows):
    """Bias and residual are added in the kernel, and the output may be a
    column slice of a wider matrix (other columns untouched)."""
    n, k = 33, 288
    g = torch.Generator(device=DEV).manual_seed(7)
    w = qm.random_weight(Q4, n, k, DEV, generator=g)
    x = torch.randn(rows, k, device=DEV, generator=g)
    bias = torch.randn(n, device=DEV, generator=g)
    res = torch.randn(rows, n, device=DEV, generator=g)
    wide = torch.full((rows, n + 10), 7.0, device=DEV)
    qm.quant_matmul(x, w, bias, res, out=wide[:, 5 : 5 + n])
    want = x.cpu() @ reference(w).t() + bias.cpu() + res.cpu()
    assert float((wide[:, 5 : 5 + n].cpu() - want).abs().max()) <= 1e-4 * float(want.abs().max())
    assert bool((wide[:, :5] == 7).all()) and bool((wide[:, 5 + n :] == 7).all())


def test_cublas_path_in_slices(monkeypatch):
    """Above ``DOT_MAX_ROWS`` rows the weight is dequantized a slice of rows at
    a time and multiplied by the BLAS: the same product."""
    monkeypatch.setattr(qm, "DOT_MAX_ROWS", 8)
    monkeypatch.setattr(qm, "SCRATCH_ELEMENTS", 10 * 320)  # 10 rows a slice: 4 slices of a 37-row weight
    g = torch.Generator(device=DEV).manual_seed(3)
    w = qm.random_weight(Q6, 37, 320, DEV, generator=g)
    x = torch.randn(12, 320, device=DEV, generator=g)
    bias, res = torch.randn(37, device=DEV, generator=g), torch.randn(12, 37, device=DEV, generator=g)
    got = qm.quant_matmul(x, w, bias, res)
    want = x.cpu() @ reference(w).t() + bias.cpu() + res.cpu()
    assert float((got.cpu() - want).abs().max()) <= 1e-4 * float(want.abs().max())


def test_dequantize_selected_rows():
    """Embedding lookups: rows picked by an index tensor, repeats allowed."""
    w, _ = gguf_weight("Q5_K", 40, 256, seed=2)
    wd = qm.to_device(w, DEV)
    ids = torch.tensor([3, 39, 0, 3], device=DEV)
    got, want = qm.dequantize(wd, ids, torch.float32).cpu(), reference(w)[ids.cpu()]
    assert got.shape == (4, 256) and float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def test_linear_of_mixed_parts():
    """A fused projection of parts in different formats (Q4_K, Q4_K, Q6_K like
    a Q4_K_M file's Q, K, V; and a float part) with a bias: each part writes
    its columns, runs of one kind merged."""
    parts = [gguf_weight(t, n, 256, seed=i)[0] for i, (t, n) in enumerate([("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)])]
    flt = torch.randn(8, 256) * 0.05
    parts.append(QuantWeight(F16, (8, 256), flt.to(torch.float16)))
    bias = torch.randn(72)
    lin = qm.CudaQuantLinear(parts, bias, DEV, torch.float32)
    assert [p.kind for p in lin.parts] == [Q4, Q6, F16] and lin.out_features == 72 and lin.in_features == 256
    ref = torch.cat([reference(p) for p in parts[:3]] + [flt.to(torch.float16).float()])
    for rows in (1, 5, 300):  # GEMV, tensor-core and cuBLAS paths
        x = torch.randn(rows, 256)
        res = torch.randn(rows, 72)
        got = lin(x.to(DEV), residual=res.to(DEV))
        want = x @ ref.t() + bias + res
        assert float((got.cpu() - want).abs().max()) <= 1e-4 * float(want.abs().max())
    assert lin.nbytes == sum(p.nbytes for p in lin.parts) + 72 * 4


def test_bad_shapes_are_clear_errors():
    w = qm.random_weight(Q8, 16, 64, DEV)
    with pytest.raises(ValueError, match=r"x must be \[M, 64\]"):
        qm.quant_matmul(torch.zeros(2, 96, device=DEV), w)
    with pytest.raises(ValueError, match="bias must be float32"):
        qm.quant_matmul(torch.zeros(2, 64, device=DEV), w, bias=torch.zeros(15, device=DEV))
    with pytest.raises(ValueError, match="residual must be"):
        qm.quant_matmul(torch.zeros(2, 64, device=DEV), w, residual=torch.zeros(3, 16, device=DEV))
    with pytest.raises(ValueError, match="out must be"):
        qm.quant_matmul(torch.zeros(2, 64, device=DEV), w, out=torch.zeros(2, 15, device=DEV))
    with pytest.raises(ValueError, match="needs K a multiple of 32"):
        qm.quant_matmul(torch.zeros(2, 64, device=DEV), QuantWeight(Q4, (16, 64), w.q, w.d, w.d))
    with pytest.raises(ValueError, match="kinds q8, q4, q5, q6"):
        qm.dequantize(QuantWeight(BF16, (16, 64), torch.zeros(16, 64, dtype=torch.bfloat16)))
    with pytest.raises(ValueError, match="float16 minimums"):
        qm.quant_matmul(torch.zeros(1, 64, device=DEV), QuantWeight(Q4, (16, 64), torch.zeros(16, 32, dtype=torch.uint8, device=DEV),
                                                                    w.d, None))  # fmt: skip
    with pytest.raises(ValueError, match="one width"):
        qm.CudaQuantLinear([w, qm.random_weight(Q8, 16, 96, DEV)], None, DEV)


# -- the engine on CUDA --------------------------------------------------------


def gguf_engine(path, device: str, dtype: str):
    """An engine over ``path``: on the GPU with its GGUF blocks kept
    quantized; on the CPU (the reference) with the same repacked blocks
    dequantized to float32 by :func:`reference`, so both multiply the very
    same weight values."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.loading.loader import load_model

    cfg = EngineConfig(model=str(path), device=device, dtype=dtype, kv_cache_mb=16)
    loaded = load_model(path, dtype=cfg.torch_dtype(), quantized=True)
    weights = loaded.weights
    if device == "cpu":
        weights = {k: (v.q.float() if v.kind in (F16, BF16) else reference(v)) if isinstance(v, QuantWeight) else v
                   for k, v in weights.items()}  # fmt: skip
    return Engine(cfg, loaded.config, weights, loaded.tokenizer)


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_quantized_gguf_on_cuda_matches_cpu(dtype, tmp_path):
    """A Q4_K_M-like GGUF (Q4_K with Q6_K V, down and head, a Q8_0 embedding)
    served on the GPU keeps every projection quantized (CudaQuantLinear) and
    gives the logits of the CPU float32 engine over the same weights
    dequantized: 20-token prefill, then one token per step (decode through
    the CUDA graphs); in float32 the greedy tokens of a short prompt are the
    CPU's too."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")  # test_cuda's helpers
    from test_cuda import greedy, logits_run
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "q4km.gguf", {"attn_v": "Q6_K", "ffn_down": "Q6_K", "output": "Q6_K", "token_embd": "Q8_0"})
    ids = list(range(3, 40))
    cpu = gguf_engine(path, "cpu", "float32")
    try:
        want = logits_run(cpu, ids[:20], ids[20:])
        want_tokens = greedy(cpu, [ids[:12]], 8)[0]
    finally:
        cpu.close()
    eng = gguf_engine(path, "cuda", dtype)
    try:
        m = eng.model
        assert m.cuda_quant and isinstance(m.lm_head, qm.CudaQuantLinear) and isinstance(m.embed, QuantWeight)
        assert all(isinstance(layer[k], qm.CudaQuantLinear) for layer in m.layers for k in ("qkv", "o", "gate_up", "down"))
        print("weights:", m.weight_summary(), f"{m.weight_bytes() / 2**20:.2f} MiB")
        got = logits_run(eng, ids[:20], ids[20:])
        assert eng.runner.graphs is not None and eng.runner.graphs.replays >= len(ids) - 20
        tokens = greedy(eng, [ids[:12]], 8)[0]
        assert eng.pool.stats().used == 0
    finally:
        eng.close()
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    print(f"{dtype}: max abs logit diff {diff:.3e} (largest logit {scale:.2f}); greedy {tokens} vs CPU {want_tokens}")
    assert got.shape == want.shape
    assert diff <= (1e-4 if dtype == "float32" else 4e-2) * scale
    if dtype == "float32":
        assert tokens == want_tokens


@needs_cuda
def test_engine_load_keeps_gguf_blocks_on_cuda(tmp_path):
    """``Engine.load`` of a GGUF file on CUDA with ``quantize`` set keeps
    the blocks quantized (fewer weight bytes than bfloat16) and decodes;
    without it the weights are dequantized to bfloat16 (the faster choice
    beyond a few sequences)."""
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")  # test_cuda's helpers
    from tartlet.engine.core.engine import Engine, EngineConfig
    from test_cuda import greedy
    from tiny_gguf import write_tiny_llama

    path = write_tiny_llama(tmp_path / "q4.gguf", {"output": "Q6_K"})
    assert not EngineConfig(model=str(path), device="cuda").keeps_quantized()
    cfg = EngineConfig(model=str(path), device="cuda", kv_cache_mb=16, quantize="q8_0")
    assert cfg.keeps_quantized()
    eng = Engine.load(cfg)
    try:
        m = eng.model
        assert m.cuda_quant and all(isinstance(layer["qkv"], qm.CudaQuantLinear) for layer in m.layers)
        params = sum(lin.in_features * lin.out_features for lin in m._quant_linears())
        assert m.weight_bytes() < 2 * params  # bfloat16 would take 2 bytes a weight for these alone
        assert len(greedy(eng, [[5, 6, 7]], 4)[0]) == 4
    finally:
        eng.close()
