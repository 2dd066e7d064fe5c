"""Quantized projections on the GPU: Triton kernels that multiply
activations by a weight kept in the repacked block layout of
:mod:`tartlet.engine.loading.quant_formats` (issue 39).

The weight is the CPU path's struct of arrays, moved to the GPU as is: per
row of ``K`` weights, ``K / 32`` blocks of ``QBYTES[kind]`` bytes (``q``),
float16 scales ``d`` (``[N, K / 32]``, Q6 ``[N, K / 16]``) and, for Q4 and
Q5, float16 minimums ``m``; ``w = d q + m`` with ``m = -128 d`` (Q8) and
``-32 d`` (Q6). Block ``b``'s bytes ``j`` (``0..15``) hold element ``j`` in
the low nibble and ``j + 16`` in the high one (Q8: bytes ``j`` and ``16 + j``
are the elements); Q5's byte ``16 + (e & 3)`` bit ``e >> 2`` is bit 4 of
element ``e``, Q6's byte ``16 + (e & 7)`` bits ``2 (e >> 3)`` bits 4-5; Q6's
first scale covers elements 0-15 (the low nibbles), the second 16-31. So
every kernel reads a tile as two halves, the low and the high nibbles, each
``[rows, blocks x 16]``, and pairs them with the matching halves of ``x``.

Three paths, by the number of activation rows ``M`` (host-side ints, fixed
per CUDA graph, so every path is capturable: no host sync, outputs from
torch's caching allocator):

* ``M <= GEMV_MAX_ROWS`` (decode): :func:`_gemv` kernel, one program per
  ``BN`` output rows over all of ``K``, each weight byte read once and
  dequantized in registers, float32 sums, one multiply-add per weight and
  activation row;
* ``M <= DOT_MAX_ROWS`` (off by default: measured slower than the next):
  :func:`_dot` kernel, a tiled GEMM that dequantizes each ``[BN, 16 BB]``
  half tile to the compute dtype and multiplies it on the tensor cores
  (``tl.dot``);
* more rows (decode batches, prefill): the weight is dequantized a slice of
  rows at a time into a scratch matrix of the compute dtype
  (:func:`dequantize`) and multiplied by cuBLAS.

Block sizes: :data:`CONFIG` picks one of the candidate sets in
:data:`CONFIGS` (``"b"``, the fastest measured on an H100, or
``$TARTLET_CUDA_QUANT_CONFIG``; ``benchmarks/bench_quant_matmul.py`` times them). ``TRITON_INTERPRET=1``
runs the kernels on CPU tensors for tests (float16 stands in for bfloat16).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn.functional as F

from ..loading.quant_formats import BF16, F16, KIND_NAMES, Q4, Q5, Q6, Q8, QBYTES, QK, QuantWeight
from .attention import available as available  # whether Triton imports: these kernels need it too

#: Kinds the kernels multiply (float parts, F16/BF16, go to cuBLAS).
KINDS = (Q8, Q4, Q5, Q6)

#: Candidate block sizes: ``gemv`` (rows per program BN, blocks of 32 per
#: step BB, warps, SUMS: 1 sums the products of unscaled values per block and
#: scales the sums, one multiply-add per weight, 0 dequantizes every weight
#: first), ``dot`` (BN, BB, warps, stages; BM follows the row count),
#: ``dequant`` (BN, BB, warps). Memory-bound GEMV on an H100: "a" 16 rows x
#: 256 weights a step, "b" 8 x 512 (more programs for narrow matrices), "c"
#: 32 x 128 (fewer, wider programs), "a0" "a" dequantizing every weight.
CONFIGS: dict[str, dict[str, tuple[int, ...]]] = {
    "a": {"gemv": (16, 8, 4, 1), "dot": (64, 4, 4, 3), "dequant": (32, 8, 4)},
    "b": {"gemv": (8, 16, 4, 1), "dot": (32, 4, 4, 4), "dequant": (16, 16, 4)},
    "c": {"gemv": (32, 4, 8, 1), "dot": (128, 2, 8, 3), "dequant": (64, 4, 8)},
    "a0": {"gemv": (16, 8, 4, 0), "dot": (64, 4, 4, 3), "dequant": (32, 8, 4)},
}
#: The candidate in use (see :data:`CONFIGS`): ``$TARTLET_CUDA_QUANT_CONFIG`` when set, else "b" (on an
#: H100, one Llama-3-8B layer's Q4 projections at one row: "b" 111 us, "a" 164, "c" 325, "a0" 572;
#: bfloat16's F.linear 165: docs/benchmarks.md).
CONFIG = os.environ.get("TARTLET_CUDA_QUANT_CONFIG", "b")
#: Most activation rows the GEMV kernel takes (one multiply-add per weight per row: beyond a few rows
#: the CUDA cores, not memory, bound it, and the tensor-core kernel takes over).
GEMV_MAX_ROWS = 4
#: Most activation rows the dequantizing Triton GEMM takes; more go through a dequantized copy and cuBLAS.
#: Measured on an H100 (one Llama-3-8B layer, Q4): the GEMM took 1.0-1.3 ms at 16 and 64 rows, 6-8x
#: bfloat16's cuBLAS, so by default it takes none (``$TARTLET_CUDA_QUANT_DOT_ROWS`` sets it).
DOT_MAX_ROWS = int(os.environ.get("TARTLET_CUDA_QUANT_DOT_ROWS", GEMV_MAX_ROWS))
#: Fewest programs a launch aims at (about two per SM of an H100's 132): a config's rows per program (BN)
#: are halved (down to 4 for the GEMV, 16 for the GEMM) while a matrix would give fewer.
MIN_PROGRAMS = 256
#: Largest dequantized slice (elements) for the cuBLAS path: 32 Mi elements, 64 MiB in bfloat16.
SCRATCH_ELEMENTS = 1 << 25


@functools.cache
def _kernels() -> dict[str, Any]:
    from . import quant_triton  # imports Triton

    return {"gemv": quant_triton.gemv, "dot": quant_triton.dot, "dequant": quant_triton.dequant}


def _check_weight(w: QuantWeight) -> None:
    if w.kind not in KINDS:
        raise ValueError(f"the CUDA quantized kernels take kinds q8, q4, q5, q6, got {KIND_NAMES.get(w.kind, w.kind)}")
    n, k = w.shape
    nb = k // QK
    if k % QK or w.q.shape != (n, nb * QBYTES[w.kind]) or w.q.dtype != torch.uint8 or not w.q.is_contiguous():
        raise ValueError(f"a {KIND_NAMES[w.kind]} weight [{n}, {k}] needs K a multiple of {QK} and contiguous uint8 q "
                         f"[{n}, {nb * QBYTES[w.kind]}], got {tuple(w.q.shape)}")
    per = 2 if w.kind == Q6 else 1
    if w.d is None or w.d.shape != (n, nb * per) or w.d.dtype != torch.float16 or not w.d.is_contiguous():
        raise ValueError(f"a {KIND_NAMES[w.kind]} weight [{n}, {k}] needs float16 scales [{n}, {nb * per}]")
    if w.kind in (Q4, Q5) and (w.m is None or w.m.shape != (n, nb) or w.m.dtype != torch.float16 or not w.m.is_contiguous()):
        raise ValueError(f"a {KIND_NAMES[w.kind]} weight [{n}, {k}] needs float16 minimums [{n}, {nb}]")


def dequantize(w: QuantWeight, rows: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``w`` (kind Q8, Q4, Q5 or Q6, on the kernels' device)
    dequantized: rows ``rows`` (int64 ``[n]`` on that device, each in
    ``[0, N)``; all rows when None) as ``[n, K]`` of ``dtype`` (into ``out``
    when given: ``[n, K]`` with contiguous rows).

    Raises:
        ValueError: another kind, a malformed weight, or a bad ``rows``/``out``.
    """
    _check_weight(w)
    n_all, k = w.shape
    n = n_all if rows is None else rows.shape[0]
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows must be int64 [n], got {rows.dtype} {tuple(rows.shape)}")
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=w.q.device)
    elif out.shape != (n, k) or out.stride(1) != 1:
        raise ValueError(f"out must be [{n}, {k}] with contiguous rows, got {tuple(out.shape)}")
    if n:
        assert w.d is not None  # _check_weight
        bn, bb, warps = CONFIGS[CONFIG]["dequant"]
        nb = k // QK
        idx = rows if rows is not None else w.q  # any pointer when unused
        _kernels()["dequant"][(-(-n // bn), -(-nb // bb))](
            w.q, w.d, w.m if w.m is not None else w.d, idx, out, n, nb, w.q.stride(0), w.d.stride(0), out.stride(0), KIND=w.kind, QB=QBYTES[w.kind], HAS_IDX=rows is not None, BN=bn, BB=bb, num_warps=warps,
        )  # fmt: skip
    return out


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias) (+ residual)`` with ``W`` = ``w`` dequantized.

    Args:
        x: ``[M, K]`` (bfloat16, float16 or float32; rows contiguous).
        w: kind Q8, Q4, Q5 or Q6, ``[N, K]``, on ``x``'s device.
        bias: float32 ``[N]`` or None.
        residual: ``[M, N]`` (rows contiguous) added, or None.
        out: ``[M, N]`` of ``x``'s dtype with contiguous rows (may be a
            column slice of a wider matrix), or None for a new one.

    Returns:
        ``out``: ``[M, N]`` in ``x``'s dtype, sums in float32 (the cuBLAS path
        from :data:`DOT_MAX_ROWS` rows: cuBLAS's own accumulation).

    Raises:
        ValueError: shapes, dtypes or layouts that do not match, or a malformed weight.
    """
    _check_weight(w)
    n, k = w.shape
    if x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be [M, {k}] (bfloat16, float16 or float32, rows contiguous) for a [{n}, {k}] weight, "
                         f"got {x.dtype} {tuple(x.shape)}")
    m = x.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32):
        raise ValueError(f"bias must be float32 [{n}], got {bias.dtype} {tuple(bias.shape)}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [{m}, {n}] with contiguous rows, got {tuple(residual.shape)}")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype != x.dtype:
        raise ValueError(f"out must be {x.dtype} [{m}, {n}] with contiguous rows, got {out.dtype} {tuple(out.shape)}")
    if m == 0:
        return out
    if m > DOT_MAX_ROWS:
        return _dequant_gemm(x, w, bias, residual, out)
    nb = k // QK
    cfg = CONFIGS[CONFIG]
    mn = w.m if w.m is not None else w.d
    assert w.d is not None  # _check_weight
    bias_t = bias if bias is not None else w.d
    res = residual if residual is not None else out
    common = (x.stride(0), w.q.stride(0), w.d.stride(0), res.stride(0), out.stride(0))
    kern = _kernels()
    if m <= GEMV_MAX_ROWS:
        bn, bb, warps, sums = cfg["gemv"]
        while bn > 4 and -(-n // bn) < MIN_PROGRAMS:
            bn //= 2
        kern["gemv"][(-(-n // bn),)](
            x, w.q, w.d, mn, bias_t, res, out, n, *common, NB=nb, KIND=w.kind, QB=QBYTES[w.kind], ROWS=m,
            RP=max(2, 1 << (m - 1).bit_length()), HAS_BIAS=bias is not None, HAS_RES=residual is not None,
            BN=bn, BB=bb, SUMS=bool(sums), num_warps=warps,
        )  # fmt: skip
    else:
        bn, bb, warps, stages = cfg["dot"]
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        while bn > 16 and -(-m // bm) * -(-n // bn) < MIN_PROGRAMS:
            bn //= 2
        kern["dot"][(-(-m // bm), -(-n // bn))](
            x, w.q, w.d, mn, bias_t, res, out, m, n, *common, NB=nb, KIND=w.kind, QB=QBYTES[w.kind],
            HAS_BIAS=bias is not None, HAS_RES=residual is not None, IEEE=x.dtype == torch.float32,
            BM=bm, BN=bn, BB=bb, num_warps=warps, num_stages=stages,
        )  # fmt: skip
    return out


def _dequant_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, residual: torch.Tensor | None,
                  out: torch.Tensor) -> torch.Tensor:
    """Many rows: dequantize slices of ``w`` into a scratch matrix and multiply by cuBLAS."""
    n, k = w.shape
    step = max(1, SCRATCH_ELEMENTS // k)
    for s in range(0, n, step):
        e = min(n, s + step)
        rows = torch.arange(s, e, device=w.q.device) if (s, e) != (0, n) else None
        wt = dequantize(w, rows, x.dtype)
        o = out[:, s:e]
        if o.is_contiguous():
            torch.mm(x, wt.t(), out=o)
        else:
            o.copy_(x @ wt.t())
    if bias is not None:
        out.add_(bias.to(out.dtype))
    if residual is not None:
        out.add_(residual)
    return out


def to_device(w: QuantWeight, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> QuantWeight:
    """``w`` on ``device``: a block kind's ``q``, ``d``, ``m`` copied as they
    are; a float one (F16, BF16) as a matrix of ``dtype`` (for cuBLAS).

    Raises:
        ValueError: a kind the kernels do not take (interleaved), or a malformed weight.
    """
    if w.kind in (F16, BF16):
        return QuantWeight(w.kind, w.shape, w.q.to(device=device, dtype=dtype).contiguous(), source=w.source)
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device).contiguous()

    out = QuantWeight(w.kind, w.shape, w.q.to(device).contiguous(), move(w.d), move(w.m), source=w.source)
    _check_weight(out)
    return out


class CudaQuantLinear:
    """A projection ``y = x @ W^T + b`` whose weight stays quantized on the
    GPU: the CUDA sibling of :class:`~tartlet.engine.models.quant_linear.QuantLinear`
    (same call, same ``parts``), multiplied by :func:`quant_matmul`.

    Args:
        parts: the weight's row blocks, top to bottom, each ``[n_i, K]``
            (kinds Q8, Q4, Q5, Q6, or F16/BF16 float blocks), on any device;
            moved to ``device``, runs of one kind merged.
        bias: ``[sum n_i]`` or None (kept as float32).
        device: the GPU (or, under ``TRITON_INTERPRET=1``, the CPU).
        dtype: the compute dtype (float parts are kept in it).

    Raises:
        ValueError: parts of different widths, an unsupported kind, or a bias of the wrong size.
    """

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, device: torch.device | str,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"parts of one projection must have one width, got {sorted(widths)}")
        self.dtype = dtype
        merged: list[QuantWeight] = []
        run: list[QuantWeight] = []
        for p in parts + [QuantWeight(-1, (0, 0), torch.empty(0))]:  # a sentinel ends the last run
            if run and (p.kind != run[0].kind or p.kind in (F16, BF16)):
                one = run[0] if len(run) == 1 else QuantWeight.cat(run)
                merged.append(to_device(one, device, dtype))
                run = []
            run.append(p)
        self.parts = merged
        self.in_features = widths.pop()
        self.out_features = sum(p.shape[0] for p in merged)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match {self.out_features} outputs")
        self.bias = None if bias is None else bias.to(device=device, dtype=torch.float32).contiguous()
        self._bias_parts: list[torch.Tensor | None] = []
        n0 = 0
        for p in merged:
            self._bias_parts.append(None if self.bias is None else self.bias[n0 : n0 + p.shape[0]])
            n0 += p.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) memory."""
        return sum(p.nbytes for p in self.parts) + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + b (+ residual)``.

        Args:
            x: ``[T, in]`` in the compute dtype.
            residual: optional ``[T, out]`` added to the result.

        Returns:
            ``[T, out]`` of ``x``'s dtype, a new tensor.
        """
        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is not None and residual.stride(-1) != 1:
            residual = residual.contiguous()
        T = x.shape[0]
        out = torch.empty(T, self.out_features, dtype=x.dtype, device=x.device)
        n0 = 0
        for p, b in zip(self.parts, self._bias_parts):
            n1 = n0 + p.shape[0]
            o, r = out[:, n0:n1], None if residual is None else residual[:, n0:n1]
            if p.kind in (F16, BF16):
                y = F.linear(x, p.q, None if b is None else b.to(x.dtype))
                o.copy_(y if r is None else y.add_(r))
            else:
                quant_matmul(x, p, b, r, o)
            n0 = n1
        return out


def random_weight(kind: int, n: int, k: int, device: torch.device | str, scale: float = 0.02,
                  generator: torch.Generator | None = None) -> QuantWeight:
    """A random ``[n, k]`` weight of ``kind`` (Q8, Q4, Q5, Q6) built directly
    in the repacked layout on ``device`` (benchmarks: weights of magnitude
    ~``scale``, no GGUF file or CPU repacking)."""
    if kind not in KINDS or k % QK:
        raise ValueError(f"random weights of kinds q8, q4, q5, q6 with K a multiple of {QK}, got {kind}, K={k}")
    nb = k // QK
    q = torch.randint(0, 256, (n, nb * QBYTES[kind]), dtype=torch.uint8, device=device, generator=generator)
    levels = {Q8: 128, Q4: 8, Q5: 16, Q6: 32}[kind]
    d = (torch.rand(n, nb * (2 if kind == Q6 else 1), device=device, generator=generator) * 0.5 + 0.5) * scale / levels
    m = -levels * d if kind in (Q4, Q5) else None
    return QuantWeight(kind, (n, k), q, d.to(torch.float16), None if m is None else m.to(torch.float16),
                       source=KIND_NAMES[kind])
