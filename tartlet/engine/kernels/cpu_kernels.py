"""Fused float32 CPU kernels for the decode path (``cpu_kernels.c``).

On a CPU a decode step is a few large matrix multiplications plus hundreds
of tiny element-wise ops, and at a few rows each tiny op costs far more in
dispatch than in arithmetic (~8 us each on a 2-core VM, ~40 per layer). The
C kernels replace the worst chains: RMSNorm, RoPE + the KV-cache write, and
decode attention read straight from the page pool (no gathered copy of the
keys and values). Results equal the PyTorch path up to float32 summation
order (checked by ``tests/engine/test_cpu_kernels.py``). The RoPE + KV write and
the attention also serve int8 pools (``kv_int8.h``; rows as
:mod:`tartlet.engine.core.kv_quant` lays them out: keys and values are quantized
as they are written and dequantized inside the attention loops) and float16
pools (rounded to nearest even as they are written, as ``Tensor.half()``
does, and widened inside the attention loops).

The C file is compiled on first use (:mod:`tartlet.engine.kernels.c_build`: once per
machine, cached under ``$TARTLET_CACHE_DIR/kernels``), then loaded with
:mod:`ctypes`. When
no compiler is found, compilation fails or ``TARTLET_CPU_KERNELS=0`` is set,
:func:`load` returns ``None`` and the model keeps the PyTorch path.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from pathlib import Path
from typing import Literal

import torch

from ..core.kv_quant import SCALE_BYTES
from . import abi
from .c_build import BASE_FLAGS, compile_library, cpu_flags, find_compiler, open_library  # noqa: F401 (find_compiler: re-exported)
from .kernel_checks import F32, I64, bad_tensor

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_kernels.c")
_lock = threading.Lock()
_loaded: "CpuKernels | None | Literal[False]" = False  # False: not tried yet


_cpu_flags = cpu_flags  # module attribute, so tests can pretend a CPU without AVX2


def _build(rebuild: bool = False) -> Path:
    """Compile ``cpu_kernels.c`` (once per source/flags/compiler, or again
    with ``rebuild``) and return the library path.

    Raises:
        RuntimeError: no C compiler, or it failed (its stderr is included).
    """
    flags = [*BASE_FLAGS, "-std=c11"]
    if {"avx2", "fma", "f16c"} <= _cpu_flags():
        flags += ["-mavx2", "-mfma", "-mf16c"]
    headers = tuple(_SOURCE.parent / h for h in ("abi.h", "float_kernels.h", "kv_int8.h"))
    return compile_library("cpu_kernels", _SOURCE, flags, headers, rebuild=rebuild)


def load() -> "CpuKernels | None":
    """The compiled kernels, or ``None`` when they cannot be had (the reason
    is logged once). Thread-safe; builds at most once per process."""
    global _loaded
    with _lock:
        if _loaded is False:
            lib = open_library(_build, "TARTLET_CPU_KERNELS", "fused CPU kernels", "using the PyTorch path")
            _loaded = None if lib is None else CpuKernels(lib)
        return _loaded


_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


#: extra bytes per pool row after ``head_dim`` values, per pool dtype (int8: the row's scale)
_POOL_EXTRA = {torch.float32: 0, torch.float16: 0, torch.int8: SCALE_BYTES}

#: the pool dtypes the kernels read and write
POOL_DTYPES = tuple(_POOL_EXTRA)


def _check_pools(kernel: str, k_pool: torch.Tensor, v_pool: torch.Tensor, nkv: int, hd: int) -> None:
    ks, extra = k_pool.shape, _POOL_EXTRA.get(k_pool.dtype)
    if not (extra is not None and len(ks) == 3 and ks[1] == nkv and ks[2] == hd + extra and k_pool.is_cpu
            and k_pool.is_contiguous()):
        bad_tensor(kernel, "k_pool", k_pool, ["slots", nkv, f"{hd} (float32, float16) or {hd + SCALE_BYTES} (int8)"],
                   "float32, float16 or int8")
    if not (v_pool.dtype is k_pool.dtype and v_pool.shape == ks and v_pool.is_cpu and v_pool.is_contiguous()):
        bad_tensor(kernel, "v_pool", v_pool, list(ks), str(k_pool.dtype).replace("torch.", ""))


class CpuKernels:
    """Typed wrappers of the compiled kernels. Every tensor is float32 (int64
    for indexes) on the CPU; shapes as documented per method. Shapes, dtypes,
    layouts and devices are checked before each call (:class:`ValueError`
    naming the argument, :mod:`.kernel_checks`); index values (pool slots,
    rows) are not: the model builds them."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        """Raises:
            KernelAbiError: the library's boundary differs from this wrapper's
                (:mod:`.abi`)."""
        abi.check(lib, "CPU kernels (cpu_kernels.c)", abi.kv_kind_entries())
        self._lib = lib
        self._rms = lib.tq_rms_norm
        self._rms.argtypes = [_P, _I, _P, _P, _I, _I, _F]
        self._rope = lib.tq_rope_qkv_store
        self._rope.argtypes = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I]
        self._attn = lib.tq_paged_decode_attention
        self._attn.argtypes = [_P, _I, _P, _P, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _P]
        self._rope_q8 = lib.tq_rope_qkv_store_q8
        self._rope_q8.argtypes = self._rope.argtypes
        self._attn_q8 = lib.tq_paged_decode_attention_q8
        self._attn_q8.argtypes = self._attn.argtypes
        self._rope_f16 = lib.tq_rope_qkv_store_f16
        self._rope_f16.argtypes = self._rope.argtypes
        self._attn_f16 = lib.tq_paged_decode_attention_f16
        self._attn_f16.argtypes = self._attn.argtypes
        self._argmax = lib.tq_argmax_rows
        self._argmax.argtypes = [_P, _I, _I, _I, _P]
        self._argmax_masked = lib.tq_argmax_masked
        self._argmax_masked.argtypes = [_P, _P, _I]
        self._argmax_masked.restype = ctypes.c_int64
        for f in (self._rms, self._rope, self._argmax):
            f.restype = None
        for f in (self._attn, self._rope_q8, self._attn_q8, self._rope_f16, self._attn_f16):
            f.restype = ctypes.c_int  # -1: scratch memory could not be allocated
        # per pool dtype: the RoPE + KV write and the attention over it
        self._rope_by = {torch.float32: self._rope, torch.int8: self._rope_q8, torch.float16: self._rope_f16}
        self._attn_by = {torch.float32: self._attn, torch.int8: self._attn_q8, torch.float16: self._attn_f16}

    def argmax_rows(self, x: torch.Tensor) -> list[int]:
        """Index of the first maximum of each row of ``x`` float32 ``[S, V]``
        (rows may be strided, columns contiguous): ``x.argmax(-1).tolist()``,
        a NaN counting as the maximum as in PyTorch; greedy sampling.

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device.
        """
        xs, xst = x.shape, x.stride()
        if not (len(xs) == 2 and xs[1] > 0 and xst[1] == 1 and x.dtype is F32 and x.is_cpu):
            bad_tensor("argmax_rows", "x", x, ["S", "V (> 0)"], layout="columns contiguous")
        out = torch.empty(xs[0], dtype=torch.int64)
        self._argmax(x.data_ptr(), xst[0], xs[0], xs[1], out.data_ptr())
        return out.tolist()

    def argmax_masked(self, x: torch.Tensor, allowed: torch.Tensor) -> int:
        """Index of the first maximum of float32 ``x`` ``[V]`` (contiguous)
        over the positions bool ``allowed`` ``[V]`` (contiguous) marks True:
        ``x.masked_fill(~allowed, -inf).argmax()`` without the copy (a NaN at
        an allowed position counts as the maximum, as in PyTorch; when every
        allowed value is -inf, the first allowed position, where PyTorch
        gives 0 allowed or not); -1 when nothing is allowed. Greedy sampling
        under a grammar's mask.

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device.
        """
        if not (x.dim() == 1 and x.dtype is F32 and x.is_cpu and x.is_contiguous()):
            bad_tensor("argmax_masked", "x", x, ["V"])
        V = x.shape[0]
        if not (allowed.shape == (V,) and allowed.dtype is torch.bool and allowed.is_cpu and allowed.is_contiguous()):
            bad_tensor("argmax_masked", "allowed", allowed, [V], dtype="bool")
        return int(self._argmax_masked(x.data_ptr(), allowed.data_ptr(), V))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x**2, -1) + eps))`` of ``x`` ``[T, H]``
        (rows may be strided, columns contiguous); returns a new ``[T, H]``.

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device.
        """
        xs, xst = x.shape, x.stride()
        if not (len(xs) == 2 and xst[1] == 1 and x.dtype is F32 and x.is_cpu):
            bad_tensor("rms_norm", "x", x, ["T", "H"], layout="columns contiguous")
        T, H = xs
        if not (weight.shape == (H,) and weight.dtype is F32 and weight.is_cpu and weight.is_contiguous()):
            bad_tensor("rms_norm", "weight", weight, [H])
        out = torch.empty(T, H, dtype=torch.float32)
        self._rms(x.data_ptr(), xst[0], weight.data_ptr(), out.data_ptr(), T, H, eps)
        return out

    def rope_qkv_store(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
        write_slots: torch.Tensor, nh: int, nkv: int, hd: int,
    ) -> torch.Tensor:
        """RoPE the query and key heads of ``qkv`` ``[T, (nh + 2 nkv) hd]``
        (contiguous) with ``cos``/``sin`` ``[T, hd/2]``; keys and values are
        written to rows ``write_slots`` ``[T]`` of ``k_pool``/``v_pool``
        ``[slots, nkv, hd]`` float32 or float16 (rounded to nearest even), or
        int8 ``[slots, nkv, hd + 4]`` (quantized,
        :mod:`tartlet.engine.core.kv_quant`). Returns the queries ``[T, nh, hd]``.

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device,
                or an odd ``hd``.
            MemoryError: the int8 or float16 kernel's scratch row could not
                be allocated.
        """
        kernel = "rope_qkv_store"
        if hd % 2:
            raise ValueError(f"{kernel}: hd must be even, got {hd}")
        width, qs = (nh + 2 * nkv) * hd, qkv.shape
        if not (len(qs) == 2 and qs[1] == width and qkv.dtype is F32 and qkv.is_cpu and qkv.is_contiguous()):
            bad_tensor(kernel, "qkv", qkv, ["T", f"(nh + 2 nkv) hd = {width}"])
        T = qs[0]
        cs = (T, hd // 2)
        if not (cos.shape == cs and cos.dtype is F32 and cos.is_cpu and cos.is_contiguous()):
            bad_tensor(kernel, "cos", cos, cs)
        if not (sin.shape == cs and sin.dtype is F32 and sin.is_cpu and sin.is_contiguous()):
            bad_tensor(kernel, "sin", sin, cs)
        _check_pools(kernel, k_pool, v_pool, nkv, hd)
        if not (write_slots.shape == (T,) and write_slots.dtype is I64 and write_slots.is_cpu
                and write_slots.is_contiguous()):
            bad_tensor(kernel, "write_slots", write_slots, [T], "int64")
        q = torch.empty(T, nh, hd, dtype=torch.float32)
        args = (qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                write_slots.data_ptr(), T, nh, nkv, hd)
        if self._rope_by[k_pool.dtype](*args):  # -1: no scratch row (float32's needs none and returns None)
            raise MemoryError(f"{kernel}: cannot allocate a {hd}-float scratch row")
        return q

    def paged_decode_attention(
        self, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor, bias: torch.Tensor | None,
        rows: torch.Tensor | None, row_start: int, out: torch.Tensor, scale: float, probe: torch.Tensor | None = None,
    ) -> None:
        """One query per sequence: for ``b < B``, row ``rows[b]`` (or
        ``row_start + b``) of ``q`` ``[T, nh, hd]`` attends to pool slots
        ``slots[b]`` (``[B, L]``) with additive mask ``bias`` ``[B, L]`` (0 or
        -inf; ``None``: all visible); the result goes to the same row of
        ``out`` ``[T, nh * hd]``. Grouped-query heads: head ``h`` reads KV
        head ``h // (nh / nkv)``. The pools are float32 or float16
        ``[slots, nkv, hd]`` (widened on the fly), or int8
        ``[slots, nkv, hd + 4]`` (dequantized on the fly,
        :mod:`tartlet.engine.core.kv_quant`). ``probe`` (the attention
        probe, :mod:`tartlet.engine.core.attention_probe`), when given,
        float32 ``[B, nh, L]`` contiguous: receives each query head's softmax
        weights over its ``L`` slots (masked slots 0), the same numbers the
        weighted sum of values uses; ``None`` costs nothing.

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device,
                ``nh`` not a multiple of the pool's ``nkv``, or rows past ``T``.
            MemoryError: the per-thread score buffer could not be allocated.
        """
        kernel = "paged_decode_attention"
        qs, qst = q.shape, q.stride()
        if not (len(qs) == 3 and qst[2] == 1 and qst[1] == qs[2] and q.dtype is F32 and q.is_cpu):
            bad_tensor(kernel, "q", q, ["T", "nh", "hd"], layout="rows of contiguous heads")
        T, nh, hd = qs
        ks = k_pool.shape
        if not (len(ks) == 3 and ks[1] > 0 and nh % ks[1] == 0):
            bad_tensor(kernel, "k_pool", k_pool, ["slots", f"a divisor of nh = {nh}", hd], "float32, float16 or int8")
        nkv = ks[1]
        _check_pools(kernel, k_pool, v_pool, nkv, hd)
        ss = slots.shape
        if not (len(ss) == 2 and slots.dtype is I64 and slots.is_cpu and slots.is_contiguous()):
            bad_tensor(kernel, "slots", slots, ["B", "L"], "int64")
        B, L = ss
        if bias is not None and not (bias.shape == ss and bias.dtype is F32 and bias.is_cpu and bias.is_contiguous()):
            bad_tensor(kernel, "bias", bias, ss)
        if rows is None:
            if row_start < 0 or row_start + B > T:
                raise ValueError(f"{kernel}: rows {row_start}..{row_start + B - 1} are outside q's {T} rows")
        elif not (rows.shape == (B,) and rows.dtype is I64 and rows.is_cpu and rows.is_contiguous()):
            bad_tensor(kernel, "rows", rows, [B], "int64")
        os_ = (T, nh * hd)
        if not (out.shape == os_ and out.dtype is F32 and out.is_cpu and out.is_contiguous()):
            bad_tensor(kernel, "out", out, os_)
        if probe is not None and not (probe.shape == (B, nh, L) and probe.dtype is F32 and probe.is_cpu
                                      and probe.is_contiguous()):
            bad_tensor(kernel, "probe", probe, [B, nh, L])
        attn = self._attn_by[k_pool.dtype]  # _check_pools: one of the three
        if attn(q.data_ptr(), qst[0], k_pool.data_ptr(), v_pool.data_ptr(), slots.data_ptr(), _ptr(bias),
                _ptr(rows), row_start, out.data_ptr(), B, L, nh, nkv, hd, scale, _ptr(probe)):
            raise MemoryError(f"{kernel}: cannot allocate the attention scores of {L} positions")
