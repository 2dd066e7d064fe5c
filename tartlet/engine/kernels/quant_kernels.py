"""Quantized CPU matrix kernels (``quant_kernels.c``), loaded with :mod:`ctypes`.

The method is llama.cpp's: activations are quantized on the fly to 8-bit
blocks of 32 (one float scale each) and multiplied with the 4/5/6/8-bit
weight blocks of :mod:`tartlet.engine.loading.quant_formats` by integer dot products
(AVX2 ``vpmaddubsw``, AVX-512 VNNI ``vpdpbusd``), one float multiply-add per
block. The instruction set is picked at run time from the CPU's features;
:meth:`QuantKernels.set_isa` forces a lower one (tests run every level the
machine has). The library is compiled once per machine (:mod:`c_build`);
without a compiler, or with ``TARTLET_QUANT_KERNELS=0``, :func:`load` returns
``None`` and GGUF weights are dequantized to float at load instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Literal, cast

import numpy as np
import torch

from ..loading import huge_pages
from ..loading.quant_formats import BF16, F16, INTERLEAVE_ROWS, INTERLEAVED, INTERLEAVED_KINDS, KIND_NAMES, Q4, Q5, Q6, Q8, QBYTES, QK, QuantWeight, gguf_blocks
from . import abi
from .abi import KV_KINDS
from .c_build import BASE_FLAGS, compile_library, cpu_flags, cpu_vendor, open_library
from .kernel_checks import F32, I64, bad_tensor
from .lora_layout import LORA_DTYPE_NAMES, LORA_DTYPES, LORA_MAX_BLOCKS, LORA_PROJECTIONS, LORA_W, LoraBatchDesc, LoraMat

log = logging.getLogger(__name__)

_DIR = Path(__file__).parent
_SOURCE = _DIR / "quant_kernels.c"
_HEADERS = tuple(_DIR / h for h in ("abi.h", "quant_kernels_isa.h", "quant_kernels_avx512.h", "panel_gemm_avx512.h",
                                    "panel_gemm_bf16.h", "interleaved_avx512.h", "float_kernels.h", "kv_int8.h",
                                    "decode_step.h", "lora_kernels.h", "lora_wide_avx512.h", "repack.h"))
_lock = threading.Lock()
_loaded: "QuantKernels | None | Literal[False]" = False  # False: not tried yet


def stream_prefetch_nta(vendor: str | None = None, env: str | None = None) -> bool:
    """Whether the interleaved kernel should prefetch a decode step's weight
    stream non-temporally (``True``) or into L1 (``False``): ``env``
    (default ``$TARTLET_STREAM_PREFETCH``) ``nta`` or ``l1`` if set, else by
    CPU vendor (default :func:`~.c_build.cpu_vendor`). Measured (batch-1
    decode, ``bench_roofline.py --compare-prefetch``): on a 2-vCPU Intel Xeon
    (family 6 model 207) prefetching into L1 took 0.77x the step's time on
    the default model and 0.69x on a 7B Q4_K_M file; on a 2-vCPU AMD Zen 4
    the non-temporal hint had won (4.84-4.94 against 5.09-6.33 ms a
    step, the default model: the stream stopped evicting the Python
    between steps from L2), and on a 2-vCPU AMD Zen 5 (family 26) the two
    were within noise (into L1: 0.95-0.99x the step on the default model,
    1.02x on the 7B file). Other vendors keep the non-temporal hint.

    Raises:
        ValueError: ``env`` is set to something else.
    """
    env = os.environ.get("TARTLET_STREAM_PREFETCH", "") if env is None else env
    if env:
        if env not in ("nta", "l1"):
            raise ValueError(f"TARTLET_STREAM_PREFETCH must be 'nta' or 'l1', got {env!r}")
        return env == "nta"
    return (cpu_vendor() if vendor is None else vendor) != "GenuineIntel"


#: Instruction-set levels of ``tq_set_isa``.
ISA_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX-512 VNNI (256-bit)", 3: "AVX-512 VNNI"}

_P, _I = ctypes.c_void_p, ctypes.c_int64

#: Most runs of one kind a :class:`LinearDesc` holds (``TQ_MAX_PARTS`` in the C file).
MAX_PARTS = 8


class _Part(ctypes.Structure):
    _fields_ = [("kind", _I), ("n", _I), ("q", _P), ("d", _P), ("m", _P)]


class LinearDesc(ctypes.Structure):
    """A projection as ``tq_linear`` reads it (``tq_linear_desc``): built once
    per :class:`~tartlet.engine.models.quant_linear.QuantLinear`, so a call passes
    one pointer instead of a dozen arguments per part."""

    _fields_ = [("nparts", _I), ("bits", _I), ("k", _I), ("n_total", _I), ("bias", _P), ("parts", _Part * MAX_PARTS),
                ("bf16", _I)]


class LayerDesc(ctypes.Structure):
    """One decoder layer as ``tq_decode_layers`` reads it (``tq_layer_desc``)."""

    _fields_ = [("ln1", _P), ("ln2", _P), ("qkv", ctypes.POINTER(LinearDesc)), ("o", ctypes.POINTER(LinearDesc)),
                ("gate_up", ctypes.POINTER(LinearDesc)), ("down", ctypes.POINTER(LinearDesc)),
                ("k_pool", _P), ("v_pool", _P)]


class AttnGroupDesc(ctypes.Structure):
    """A decode attention group (``tq_attn_group``), with its attention
    probe buffer and layer table (NULL: no probe)."""

    _fields_ = [("rows", _P), ("row_start", _I), ("B", _I), ("L", _I), ("kv_slots", _P), ("bias", _P), ("probe", _P),
                ("probe_layers", _P)]


#: One attention group of :meth:`QuantKernels.decode_layers`: ``(rows,
#: row_start, kv_slots, bias)``, plus ``(probe, probe_layers)`` for a probed group.
AttnGroupArgs = (tuple[torch.Tensor | None, int, torch.Tensor, torch.Tensor | None]
                 | tuple[torch.Tensor | None, int, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor])


class DecoderDesc(ctypes.Structure):
    """The layer stack (``tq_decoder_desc``)."""

    _fields_ = [("n_layers", _I), ("hidden", _I), ("nh", _I), ("nkv", _I), ("hd", _I), ("ffn", _I),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(LayerDesc)),
                ("final_norm", _P), ("head", ctypes.POINTER(LinearDesc)), ("kv_kind", _I)]


#: GGUF block types ``tq_repack_gguf`` reads: ``repack.h``'s code (G_*) and the kind it makes
REPACK_TYPES = {"Q8_0": (0, Q8), "Q4_0": (1, Q4), "Q4_1": (2, Q4), "Q5_0": (3, Q5), "Q5_1": (4, Q5), "Q4_K": (5, Q4),
                "Q5_K": (6, Q5), "Q6_K": (7, Q6)}

#: The C name of each structure above (``abi.h``'s table checks their layout).
STRUCTS = {"tq_part": _Part, "tq_linear_desc": LinearDesc, "tq_layer_desc": LayerDesc, "tq_attn_group": AttnGroupDesc,
           "tq_decoder_desc": DecoderDesc, "tq_lora_mat": LoraMat, "tq_lora_batch": LoraBatchDesc}

def abi_entries() -> dict[str, int]:
    """Everything this wrapper declares about ``quant_kernels.c``'s boundary,
    as :func:`.abi.check` compares it: struct layouts, the kernel kinds
    (``K_*``, :mod:`..loading.quant_formats`), KV kinds, GGUF repack codes
    (``G_*``) and ``TQ_MAX_PARTS``."""
    out: dict[str, int] = {}
    for c_name, struct in STRUCTS.items():
        out.update(abi.struct_entries(c_name, struct))
    out.update({f"enum K_{KIND_NAMES[k].upper().replace('X16', 'I')}": k for k in KIND_NAMES})
    out.update(abi.kv_kind_entries())
    out.update({f"enum G_{name}": code for name, (code, _) in REPACK_TYPES.items()})
    out["enum TQ_MAX_PARTS"] = MAX_PARTS
    out["enum TQ_LORA_MAX_BLOCKS"] = LORA_MAX_BLOCKS
    out.update({f"enum {LORA_DTYPE_NAMES[dt]}": code for dt, code in LORA_DTYPES.items()})
    out["enum TQ_LORA_W"] = LORA_W
    return out


def load() -> "QuantKernels | None":
    """The compiled kernels, or ``None`` when they cannot be had (the reason
    is logged once). Thread-safe; builds at most once per process."""
    global _loaded
    with _lock:
        if _loaded is False:
            flags = [*BASE_FLAGS, "-std=gnu11"]
            if {"avx2", "fma", "f16c"} <= cpu_flags():  # float_kernels.h's intrinsics (the quantized ones pick at run time)
                flags += ["-mavx2", "-mfma", "-mf16c"]
            lib = open_library(
                lambda rebuild=False: compile_library("quant_kernels", _SOURCE, flags, _HEADERS, rebuild=rebuild),
                "TARTLET_QUANT_KERNELS",
                "quantized CPU kernels", "GGUF weights will be dequantized",
            )  # fmt: skip
            _loaded = None if lib is None else QuantKernels(lib)
        return _loaded


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_rows(kernel: str, name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    """``t`` (unless None) is float32 ``shape`` on the CPU with contiguous rows."""
    if t is not None and not (t.shape == shape and t.dtype is F32 and t.is_cpu and t.stride(1) == 1):
        bad_tensor(kernel, name, t, shape, layout="rows contiguous")


def _check_bias(kernel: str, bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and not (bias.shape == (n,) and bias.dtype is F32 and bias.is_cpu and bias.is_contiguous()):
        bad_tensor(kernel, "bias", bias, [n])


class QuantKernels:
    """Typed wrappers of the compiled kernels. Activations and outputs are
    float32 CPU tensors with contiguous rows. Shapes, dtypes, layouts and
    devices of the arguments are checked before each call (:class:`ValueError`
    naming the argument, :mod:`.kernel_checks`); index values (rows, pool
    slots) and the weights' own tensors (built by :mod:`.quant_formats`) are not."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        """Raises:
            KernelAbiError: the library's boundary differs from this wrapper's
                (:mod:`.abi`)."""
        abi.check(lib, "quant kernels (quant_kernels.c)", abi_entries())
        self._lib = lib
        lib.tq_quantize.argtypes = [ctypes.c_int, _P, _I, _I, _I, _P, _P]
        lib.tq_matmul.argtypes = [ctypes.c_int, ctypes.c_int, _P, _P, _P, _I, _I, _P, _P, _I, _P, _I, _P, _P, _I]
        lib.tq_dequantize.argtypes = [ctypes.c_int, _P, _P, _P, _I, _P, _I, _P]
        lib.tq_matmul_half.argtypes = [ctypes.c_int, _P, _I, _I, _P, _I, _I, _P, _I, _P, _P, _I]
        for f in (lib.tq_quantize, lib.tq_matmul, lib.tq_dequantize, lib.tq_matmul_half):
            f.restype = None
        lib.tq_linear.argtypes = [ctypes.POINTER(LinearDesc), _P, _I, _I, _P, _P, _I]
        lib.tq_linear.restype = ctypes.c_int
        self._linear = lib.tq_linear
        lib.tq_decode_layers.argtypes = [ctypes.POINTER(DecoderDesc), _P, _I, _P, _P, _P, ctypes.POINTER(AttnGroupDesc),
                                         _I, ctypes.c_int, _P, _I, _P, ctypes.POINTER(LoraBatchDesc)]
        lib.tq_decode_layers.restype = ctypes.c_int
        lib.tq_decode_profile.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        lib.tq_decode_profile.restype = ctypes.c_int
        lib.tq_lora_apply.argtypes = [ctypes.POINTER(LoraMat), _P, _I, _I, _P, _I, _I, _I]
        lib.tq_lora_apply.restype = ctypes.c_int
        lib.tq_set_stream_prefetch.argtypes = [ctypes.c_int]
        lib.tq_set_stream_prefetch.restype = ctypes.c_int
        lib.tq_set_par_min.argtypes = [_I]
        lib.tq_set_par_min.restype = _I
        lib.tq_set_panel_rows.argtypes = [_I]
        lib.tq_set_panel_rows.restype = _I
        lib.tq_set_isa.argtypes = [ctypes.c_int]
        lib.tq_set_isa.restype = ctypes.c_int
        lib.tq_best_isa.restype = ctypes.c_int
        lib.tq_has_bf16.restype = ctypes.c_int
        lib.tq_repack_gguf.argtypes = [ctypes.c_int, _P, _I, _P, _P, _P]
        lib.tq_repack_gguf.restype = ctypes.c_int
        lib.tq_interleave.argtypes = [ctypes.c_int, _I, _I, _P, _P, _P, _P, _P, _P]
        lib.tq_interleave.restype = None
        self.best_isa: int = lib.tq_best_isa()
        #: Whether the CPU has AVX512_BF16, the panel GEMM's bfloat16 products
        #: (:meth:`linear_desc` ``bf16``).
        self.has_bf16: bool = bool(lib.tq_has_bf16())
        self.isa: int = lib.tq_set_isa(-1)
        #: How the interleaved kernel prefetches a decode step's weight stream
        #: (:func:`stream_prefetch_nta`, :meth:`set_stream_prefetch`).
        self.stream_nta: bool = stream_prefetch_nta()
        lib.tq_set_stream_prefetch(int(self.stream_nta))

    def repack_gguf(self, data: np.ndarray, type_name: str, n: int, k: int) -> QuantWeight:
        """:func:`~tartlet.engine.loading.quant_formats.from_gguf` of a block type
        (:data:`REPACK_TYPES`) in C (``repack.h``): the same bytes, without
        temporaries, 2-11x faster (one 4096 x 4096 matrix: Q4_K 7 vs 50 ms,
        Q6_K 12 vs 130, Q8_0 6 vs 12).

        Args:
            data: the tensor's bytes (``gguf.ReaderTensor.data``, any shape
                and dtype of the right size, contiguous).
            type_name: a key of :data:`REPACK_TYPES`.
            n, k: rows (outputs) and columns (inputs).

        Raises:
            ValueError: another type, a width that is not a multiple of the
                block, or data of the wrong size.
        """
        if type_name not in REPACK_TYPES:
            raise ValueError(f"GGUF type {type_name} is not repacked in C (types: {', '.join(REPACK_TYPES)})")
        code, kind = REPACK_TYPES[type_name]
        raw, size = gguf_blocks(data, type_name, n, k)
        nb = k // QK
        # the model's weights from now on: on huge pages when the load asks (huge_pages.for_new_weights)
        q = huge_pages.empty((n, nb * QBYTES[kind]), torch.uint8)
        d = huge_pages.empty((n, nb * (2 if kind == Q6 else 1)), torch.float16)  # Q6: a scale per 16 weights
        m = None if kind in (Q8, Q6) else huge_pages.empty((n, nb), torch.float16)
        if self._lib.tq_repack_gguf(code, raw.ctypes.data, raw.size // size, q.data_ptr(), d.data_ptr(), _ptr(m)):
            raise ValueError(f"GGUF type {type_name} is not repacked in C")  # REPACK_TYPES and repack.h disagree
        return QuantWeight(kind, (n, k), q, d, m, type_name)

    def interleave(self, parts: list[QuantWeight]) -> QuantWeight:
        """:func:`~tartlet.engine.loading.quant_formats.interleave` in C
        (``repack.h``) of ``parts`` stacked along rows
        (:meth:`QuantWeight.cat <tartlet.engine.loading.quant_formats.QuantWeight.cat>`):
        the same bytes, without numpy's temporaries; parts of a multiple of
        16 rows are written straight into their rows of the result (the
        layout goes by groups of 16 rows), so a fused projection is not
        stacked first.

        Raises:
            ValueError: parts of different kinds or widths, a kind other
                than Q4, Q5, Q6, Q8, or rows that are not a multiple of 16.
        """
        first = parts[0]
        if any(p.kind != first.kind or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one kind and width can be stacked")
        n, k = sum(p.shape[0] for p in parts), first.shape[1]
        if first.kind not in INTERLEAVED or n % INTERLEAVE_ROWS:
            raise ValueError(f"only q4, q5, q6 and q8 matrices with a multiple of {INTERLEAVE_ROWS} rows interleave, "
                             f"got {KIND_NAMES[first.kind]} with {n} rows")
        if any(p.shape[0] % INTERLEAVE_ROWS for p in parts):
            parts = [QuantWeight.cat(parts)]  # a part ends inside a group of 16 rows
        assert first.d is not None  # block kinds have scales
        qo = huge_pages.empty((n, first.q.shape[1]), torch.uint8)
        do = huge_pages.empty((n, first.d.shape[1]), torch.float16)
        mo = None if first.m is None else huge_pages.empty((n, first.m.shape[1]), torch.float16)
        r0 = 0
        for p in parts:
            q, d, m = p.q.contiguous(), cast(torch.Tensor, p.d).contiguous(), None if p.m is None else p.m.contiguous()
            r1 = r0 + p.shape[0]
            self._lib.tq_interleave(p.kind, p.shape[0], k // QK, q.data_ptr(), d.data_ptr(), _ptr(m), qo[r0:r1].data_ptr(),
                                    do[r0:r1].data_ptr(), None if mo is None else mo[r0:r1].data_ptr())
            r0 = r1
        return QuantWeight(INTERLEAVED[first.kind], (n, k), qo, do, mo, first.source)

    def set_isa(self, level: int) -> int:
        """Use instruction-set ``level`` (see :data:`ISA_NAMES`; ``-1`` or a
        level above the CPU's: the best it has). Returns the level in use.
        Process-wide."""
        self.isa = self._lib.tq_set_isa(level)
        return self.isa

    def set_stream_prefetch(self, nta: bool) -> bool:
        """How the interleaved kernel prefetches weights a call reads once
        (calls of up to 8 activation rows, a decode step's weight stream):
        ``True``, non-temporally (Q8I into L2; ``interleaved_avx512.h``,
        ``IL_PREFETCH``); ``False``, into L1 like weights read again. Returns
        the previous setting. Process-wide; the default comes from
        :func:`stream_prefetch_nta` (``bench_roofline.py --compare-prefetch``
        times the other)."""
        self.stream_nta = bool(nta)
        return bool(self._lib.tq_set_stream_prefetch(int(nta)))

    def set_parallel_threshold(self, block_rows: int) -> int:
        """Products of fewer than ``block_rows`` (``N * M * K / 32``) run on
        one thread; larger ones are split across OpenMP threads. Returns the
        previous threshold. Process-wide."""
        return int(self._lib.tq_set_par_min(block_rows))

    def set_panel_rows(self, rows: int) -> int:
        """Products of at least ``rows`` activation rows (default 8) take the
        float panel GEMM (``panel_gemm_avx512.h``) on the AVX-512 level, when
        their activations are 16-bit or their weights float16/bfloat16.
        Returns the previous row count (``rows <= 0`` only reads it).
        Process-wide."""
        return int(self._lib.tq_set_panel_rows(rows))

    @property
    def panel_rows(self) -> int:
        """The row count from which products take the panel GEMM (see
        :meth:`set_panel_rows`)."""
        return int(self._lib.tq_set_panel_rows(0))

    def quantize(self, x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of 32 of ``x`` float32 ``[M, K]`` (rows contiguous, ``K`` a
        multiple of 32) as ``bits``-bit integers (8: int8, scale
        ``d = max|x| / 127``; 16: int16, ``d = max|x| / 32767``; round half to
        even): values ``[M, K]`` and float32 ``[M, 4, K / 32]`` per row: the
        block scales ``d``, then ``d * sum(q)`` per block, then ``d * sum(q)``
        per half block (interleaved, ``2 * K / 32`` values)."""
        if bits not in (8, 16):
            raise ValueError(f"activations are quantized to 8 or 16 bits, not {bits}")
        xs = x.shape
        if not (len(xs) == 2 and xs[1] % 32 == 0 and x.dtype is F32 and x.is_cpu and x.stride(1) == 1):
            bad_tensor("quantize", "x", x, ["M", "K (a multiple of 32)"], layout="rows contiguous")
        M, K = xs
        qa = torch.empty(M, K, dtype=torch.int8 if bits == 8 else torch.int16)
        fa = torch.empty(M, 4, K // 32, dtype=torch.float32)
        self._lib.tq_quantize(bits, x.data_ptr(), x.stride(0), M, K, qa.data_ptr(), fa.data_ptr())
        return qa, fa

    def matmul(
        self, w: QuantWeight, qa: torch.Tensor, fa: torch.Tensor, out: torch.Tensor,
        bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    ) -> None:
        """``out = x @ w.T (+ bias) (+ residual)`` for a block-kind ``w``
        ``[N, K]`` from ``x``'s blocks (:meth:`quantize`, 8 or 16 bits).
        ``out`` and ``residual`` are float32 ``[M, N]`` with contiguous rows
        (``out`` may be a column slice of a wider matrix); ``bias`` float32 ``[N]``."""
        N, K = w.shape
        qs = qa.shape
        if not (len(qs) == 2 and qs[1] == K and qa.dtype in (torch.int8, torch.int16) and qa.is_cpu
                and qa.is_contiguous()):
            bad_tensor("matmul", "qa", qa, ["M", K], "int8 or int16")
        M = qs[0]
        fs = (M, 4, K // 32)
        if not (fa.shape == fs and fa.dtype is F32 and fa.is_cpu and fa.is_contiguous()):
            bad_tensor("matmul", "fa", fa, fs)
        _check_rows("matmul", "out", out, (M, N))
        _check_bias("matmul", bias, N)
        _check_rows("matmul", "residual", residual, (M, N))
        assert w.d is not None  # block kinds have scales
        self._lib.tq_matmul(w.kind, 8 if qa.dtype == torch.int8 else 16, w.q.data_ptr(), w.d.data_ptr(), _ptr(w.m), N, K, qa.data_ptr(), fa.data_ptr(), qa.shape[0],
          out.data_ptr(), out.stride(0), _ptr(bias), _ptr(residual), 0 if residual is None else residual.stride(0))

    def linear_desc(self, parts: list[QuantWeight], bias: torch.Tensor | None, bits: int,
                    bf16: bool = False) -> LinearDesc:
        """The descriptor of ``x @ W^T (+ bias)`` with ``W`` stacked from
        ``parts`` (one width ``K``) and activations quantized to ``bits``.
        ``bf16``: calls that take the panel GEMM (AVX-512, from
        :attr:`panel_rows` rows) multiply bfloat16-rounded activations and
        weights with float32 sums (``panel_gemm_bf16.h``) instead of float32
        ones; needs 16-bit activations, an even ``K`` and :attr:`has_bf16`.
        The tensors must outlive the descriptor (the caller keeps them).

        Raises:
            ValueError: more than :data:`MAX_PARTS` parts, ``bits`` not 8 or
                16, ``bf16`` where it cannot be had, or an interleaved
                (``Q4I``, ``Q5I``, ``Q8I``) part that does not start at a multiple of 16 outputs.
        """
        if len(parts) > MAX_PARTS:
            raise ValueError(f"a projection holds at most {MAX_PARTS} runs of one format, got {len(parts)}")
        if bits not in (8, 16):
            raise ValueError(f"activations are quantized to 8 or 16 bits, not {bits}")
        K = parts[0].shape[1]
        if bf16 and not (self.has_bf16 and bits == 16 and K % 2 == 0):
            raise ValueError(f"bfloat16 panel products need AVX512_BF16 (this CPU: {self.has_bf16}), "
                             f"16-bit activations (got {bits}) and an even width (got {K})")
        n0 = 0
        for p in parts:  # the kernels cut projections into runs of 16 outputs, aligned to the stack
            if p.kind in INTERLEAVED_KINDS and n0 % INTERLEAVE_ROWS:
                raise ValueError(f"an interleaved part must start at a multiple of {INTERLEAVE_ROWS} outputs, not {n0}")
            n0 += p.shape[0]
        desc = LinearDesc(len(parts), bits, K, sum(p.shape[0] for p in parts), _ptr(bias))
        desc.bf16 = int(bf16)
        for i, p in enumerate(parts):
            desc.parts[i] = _Part(p.kind, p.shape[0], p.q.data_ptr(), _ptr(p.d), _ptr(p.m))
        return desc

    def linear(self, desc: LinearDesc, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """``out = x @ W^T (+ bias) (+ residual)`` for a :meth:`linear_desc`:
        ``x`` float32 ``[M, K]`` (rows contiguous), ``out`` float32
        contiguous ``[M, N]``, ``residual`` float32 ``[M, N]`` (rows contiguous).

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device.
            MemoryError: the activation buffer could not be allocated.
        """
        xs, K, N = x.shape, desc.k, desc.n_total
        if not (len(xs) == 2 and xs[1] == K and x.dtype is F32 and x.is_cpu and x.stride(1) == 1):
            bad_tensor("linear", "x", x, ["M", K], layout="rows contiguous")
        os_ = (xs[0], N)
        if not (out.shape == os_ and out.dtype is F32 and out.is_cpu and out.is_contiguous()):
            bad_tensor("linear", "out", out, os_)
        if residual is not None:
            _check_rows("linear", "residual", residual, os_)
        if self._linear(desc, x.data_ptr(), x.stride(0), x.shape[0], out.data_ptr(), _ptr(residual),
                        0 if residual is None else residual.stride(0)):
            raise MemoryError(f"cannot allocate the quantized activations of a [{x.shape[0]}, {x.shape[1]}] input")

    def matmul_half(
        self, w: QuantWeight, x: torch.Tensor, out: torch.Tensor,
        bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
    ) -> None:
        """``out = x @ w.T (+ bias) (+ residual)`` for an ``F16``/``BF16``
        ``w``, with float32 ``x`` ``[M, K]`` (shapes as in :meth:`matmul`)."""
        N, K = w.shape
        xs = x.shape
        if not (len(xs) == 2 and xs[1] == K and x.dtype is F32 and x.is_cpu and x.stride(1) == 1):
            bad_tensor("matmul_half", "x", x, ["M", K], layout="rows contiguous")
        _check_rows("matmul_half", "out", out, (xs[0], N))
        _check_bias("matmul_half", bias, N)
        _check_rows("matmul_half", "residual", residual, (xs[0], N))
        self._lib.tq_matmul_half(int(w.kind == BF16), w.q.data_ptr(), N, K, x.data_ptr(), x.stride(0), x.shape[0],
                                 out.data_ptr(), out.stride(0), _ptr(bias), _ptr(residual),
                                 0 if residual is None else residual.stride(0))

    def dequantize(self, w: QuantWeight, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 ``[len(rows), K]`` (all ``N`` rows when ``rows`` is None) of
        ``w``; ``rows`` int64, each in ``[0, N)`` (not checked)."""
        N, K = w.shape
        if w.kind in (F16, BF16):
            return (w.q if rows is None else w.q.index_select(0, rows)).float()
        if rows is not None and not (rows.dim() == 1 and rows.dtype is I64 and rows.is_cpu and rows.is_contiguous()):
            bad_tensor("dequantize", "rows", rows, ["R"], "int64")
        R = N if rows is None else rows.numel()
        out = torch.empty(R, K, dtype=torch.float32)
        assert w.d is not None  # block kinds have scales
        self._lib.tq_dequantize(w.kind, w.q.data_ptr(), w.d.data_ptr(), _ptr(w.m), K, _ptr(rows), R, out.data_ptr())
        return out

    def decode_layers(
        self, desc: DecoderDesc, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, write_slots: torch.Tensor,
        groups: "list[AttnGroupArgs]", threads: int,
        out_rows: torch.Tensor | None = None, logits: torch.Tensor | None = None,
        lora: "tuple[list[ctypes.Array[LoraMat]], torch.Tensor] | None" = None,
    ) -> None:
        """Every layer of a decoder (``decode_step.h``) over ``T`` decode rows,
        in one OpenMP region on ``threads`` threads; then, when ``desc`` has
        a head and ``logits`` is given, the final norm and LM head of rows
        ``out_rows`` in the same region.

        Args:
            desc: from :func:`decoder_desc` (its tensors kept alive by the caller).
            x: float32 ``[T, H]`` contiguous, the residual stream; updated in place.
            cos, sin: float32 ``[T, head_dim / 2]`` RoPE angles of each row.
            write_slots: int64 ``[T]`` pool slot of each row's key/value.
            groups: per attention group ``(rows, row_start, kv_slots, bias)``:
                int64 ``[B]`` rows or ``None`` (rows ``row_start + b``),
                int64 ``[B, L]`` pool slots, float32 ``[B, L]`` additive mask
                or ``None``; every row in exactly one group. A probed group
                (the attention probe) adds ``(probe, probe_layers)``: float32
                ``[n, B, nh, L]`` contiguous, receiving layer ``l``'s softmax
                weights of every query head at ``probe[probe_layers[l]]``,
                and int64 ``[n_layers]`` (-1: layer ``l`` not probed; values
                not checked beyond the shape).
            out_rows: int64 ``[S]`` rows of ``x`` whose logits are wanted.
            logits: float32 ``[S, vocab]`` contiguous, written.
            lora: LoRA adapters of some rows: ``(adapters, row_adapter)``,
                each adapter a :func:`lora_mats` array of this decoder's
                layers, ``row_adapter`` int64 ``[T]``: each row's index into
                ``adapters``, or -1 (the base model only). Each projection of
                such a row adds ``(x @ at) @ bt`` after its base output.

        Raises:
            ValueError: a tensor of the wrong shape, dtype, layout or device,
                or a group's rows past ``T``.
            MemoryError: the scratch buffers could not be allocated.
        """
        kernel = "decode_layers"
        xs = x.shape
        if not (len(xs) == 2 and xs[1] == desc.hidden and x.dtype is F32 and x.is_cpu and x.is_contiguous()):
            bad_tensor(kernel, "x", x, ["T", desc.hidden])
        T, cs = xs[0], (xs[0], desc.hd // 2)
        if not (cos.shape == cs and cos.dtype is F32 and cos.is_cpu and cos.is_contiguous()):
            bad_tensor(kernel, "cos", cos, cs)
        if not (sin.shape == cs and sin.dtype is F32 and sin.is_cpu and sin.is_contiguous()):
            bad_tensor(kernel, "sin", sin, cs)
        if not (write_slots.shape == (T,) and write_slots.dtype is I64 and write_slots.is_cpu
                and write_slots.is_contiguous()):
            bad_tensor(kernel, "write_slots", write_slots, [T], "int64")
        arr = (AttnGroupDesc * len(groups))()
        for i, group in enumerate(groups):
            rows, row_start, kv, bias = group[:4]
            ks = kv.shape
            if not (len(ks) == 2 and kv.dtype is I64 and kv.is_cpu and kv.is_contiguous()):
                bad_tensor(kernel, f"groups[{i}] kv_slots", kv, ["B", "L"], "int64")
            if bias is not None and not (bias.shape == ks and bias.dtype is F32 and bias.is_cpu and bias.is_contiguous()):
                bad_tensor(kernel, f"groups[{i}] bias", bias, ks)
            if rows is None:
                if row_start < 0 or row_start + ks[0] > T:
                    raise ValueError(f"{kernel}: groups[{i}] rows {row_start}..{row_start + ks[0] - 1} are outside x's {T} rows")
            elif not (rows.shape == (ks[0],) and rows.dtype is I64 and rows.is_cpu and rows.is_contiguous()):
                bad_tensor(kernel, f"groups[{i}] rows", rows, [ks[0]], "int64")
            arr[i] = AttnGroupDesc(_ptr(rows), row_start, ks[0], ks[1], kv.data_ptr(), _ptr(bias))
            if len(group) == 6:  # the attention probe of this group
                probe, layers = group[4], group[5]
                nh = desc.nh
                if not (probe.dim() == 4 and probe.shape[1:] == (ks[0], nh, ks[1]) and probe.dtype is F32 and probe.is_cpu
                        and probe.is_contiguous()):
                    bad_tensor(kernel, f"groups[{i}] probe", probe, ["n", ks[0], nh, ks[1]])
                if not (layers.shape == (desc.n_layers,) and layers.dtype is I64 and layers.is_cpu and layers.is_contiguous()):
                    bad_tensor(kernel, f"groups[{i}] probe_layers", layers, [desc.n_layers], "int64")
                if int(layers.max()) >= probe.shape[0]:
                    raise ValueError(f"{kernel}: groups[{i}] probe_layers names index {int(layers.max())}, the probe holds {probe.shape[0]}")
                arr[i].probe, arr[i].probe_layers = probe.data_ptr(), layers.data_ptr()
        if logits is not None:
            ls = logits.shape
            vocab = desc.head.contents.n_total if desc.head else "vocab"
            if not (len(ls) == 2 and (not desc.head or ls[1] == vocab) and logits.dtype is F32 and logits.is_cpu
                    and logits.is_contiguous()):
                bad_tensor(kernel, "logits", logits, ["S", vocab])
            if out_rows is None or not (out_rows.shape == (ls[0],) and out_rows.dtype is I64 and out_rows.is_cpu
                                        and out_rows.is_contiguous()):
                bad_tensor(kernel, "out_rows", out_rows, [ls[0]], "int64")
        lb = None
        if lora is not None:
            mats, row_adapter = lora
            if not (row_adapter.shape == (T,) and row_adapter.dtype is I64 and row_adapter.is_cpu
                    and row_adapter.is_contiguous()):
                bad_tensor(kernel, "lora row_adapter", row_adapter, [T], "int64")
            n_mats = len(LORA_PROJECTIONS) * desc.n_layers
            if any(len(m) != n_mats for m in mats):
                raise ValueError(f"{kernel}: a LoRA adapter's matrices are not {n_mats} (4 per layer of {desc.n_layers})")
            ptrs = (_P * max(len(mats), 1))(*[ctypes.addressof(m) for m in mats])
            lb = LoraBatchDesc(len(mats), ctypes.cast(ptrs, ctypes.POINTER(_P)), row_adapter.data_ptr())
        if self._lib.tq_decode_layers(ctypes.byref(desc), x.data_ptr(), x.shape[0], cos.data_ptr(), sin.data_ptr(),
                                      write_slots.data_ptr(), arr, len(groups), threads, _ptr(out_rows),
                                      0 if logits is None else logits.shape[0], _ptr(logits),
                                      None if lb is None else ctypes.byref(lb)):
            raise MemoryError(f"cannot allocate the scratch buffers of a {x.shape[0]}-row decode step")


    #: Phases of :meth:`decode_profile`, in its order.
    DECODE_PHASES = ("QKV projection + RoPE/KV write", "attention", "output projection + norm", "gate/up projection",
                     "SiLU * up", "down projection + norm", "LM head")

    def decode_profile(self, enable: bool) -> dict[str, float]:
        """Seconds the fused decode step spent per phase (thread 0's clock,
        each phase up to its end as thread 0 sees it) since the last call, and
        whether to keep the clock running (it costs two clock reads per phase)."""
        out = (ctypes.c_double * len(self.DECODE_PHASES))()
        self._lib.tq_decode_profile(int(enable), out)
        return dict(zip(self.DECODE_PHASES, out))


    def lora_apply(self, mat: LoraMat, x: torch.Tensor, y: torch.Tensor, lo: int = 0, hi: int | None = None) -> None:
        """``y[:, lo:hi] += (x @ at) @ bt[:, lo:hi]`` with one adapter's
        matrices of one projection (a :class:`LoraMat` of
        :func:`~.lora_layout.lora_mats`, ``at`` ``[K, r]``, ``bt`` ``[r, N]``)
        by the fused step's LoRA kernels alone, on the instruction set in use.
        ``x`` float32 ``[T, K]``, ``y`` float32 ``[T, N]`` (changed in place),
        both contiguous; ``0 <= lo <= hi <= N`` (``hi`` None: ``N``).

        Raises:
            ValueError: a tensor of the wrong shape, dtype or layout, or a
                column range outside ``y``.
            MemoryError: the scratch could not be allocated."""
        T, K = x.shape if x.dim() == 2 else (-1, -1)
        if not (T >= 0 and x.dtype is F32 and x.is_cpu and x.is_contiguous()):
            bad_tensor("lora_apply", "x", x, ["T", "K"])
        N = y.shape[1] if y.dim() == 2 else -1
        if not (y.shape == (T, N) and y.dtype is F32 and y.is_cpu and y.is_contiguous()):
            bad_tensor("lora_apply", "y", y, [T, "N"])
        hi = N if hi is None else hi
        if not 0 <= lo <= hi <= N:
            raise ValueError(f"lora_apply: columns [{lo}, {hi}) are not within y's {N}")
        if self._lib.tq_lora_apply(ctypes.byref(mat), x.data_ptr(), T, K, y.data_ptr(), N, lo, hi):
            raise MemoryError(f"cannot allocate the scratch of a {T}-row LoRA update")


def decoder_desc(layers: list[LayerDesc], hidden: int, nh: int, nkv: int, hd: int, ffn: int, eps: float,
                 scale: float, final_norm: torch.Tensor | None = None,
                 head: LinearDesc | None = None, kv_dtype: torch.dtype = torch.float32,
                 ) -> tuple[DecoderDesc, ctypes.Array[LayerDesc]]:
    """A :class:`DecoderDesc` over ``layers`` and the array holding them
    (keep both alive, and ``final_norm`` float32 ``[hidden]`` and ``head``,
    the LM head's descriptor, when given: then the step computes logits too).
    ``kv_dtype``: what the layers' pools hold, a key of :data:`KV_KINDS`
    (float32 or float16 values, or int8 rows: ``kv_int8.h``).

    Raises:
        ValueError: another ``kv_dtype``."""
    if kv_dtype not in KV_KINDS:
        raise ValueError(f"the fused step reads float32, float16 or int8 KV pools, not {kv_dtype}")
    arr = (LayerDesc * len(layers))(*layers)
    desc = DecoderDesc(len(layers), hidden, nh, nkv, hd, ffn, eps, scale, arr)
    desc.kv_kind = KV_KINDS[kv_dtype]
    if head is not None and final_norm is not None:
        desc.final_norm, desc.head = final_norm.data_ptr(), ctypes.pointer(head)
    return desc, arr
