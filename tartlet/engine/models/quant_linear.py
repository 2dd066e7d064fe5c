"""A projection ``y = x @ W^T + b`` whose weight stays quantized (the
quantized twin of :class:`tartlet.engine.models.linear.Linear`, same call).

The weight is a stack of parts along the outputs (fused Q/K/V or gate/up,
whose parts may come in different GGUF formats, e.g. Q4_K for Q and K and
Q6_K for V in a ``Q4_K_M`` file): one :class:`QuantWeight` per run of equal
kinds. ``x`` is quantized once per call to blocks of 32 integers, 16-bit or
8-bit (llama.cpp's choice, ~1.5x faster in the kernel; in every projection
it flipped SmolLM2-135M's greedy answer to "What is the capital of
France?": the inputs of the projections after an RMSNorm have outliers
100-470x the block median; the model picks per projection, see
``act_bits`` of :class:`~tartlet.engine.models.llama.LlamaModel`), and every part writes its
columns of one output matrix (bias and residual added in the kernel), all
in one C call (``tq_linear``) over a descriptor built at load.

On AVX-512 VNNI, Q4, Q5, Q6 and Q8 parts (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
Q5_K, Q6_K, Q8_0) with a multiple of 16 rows are interleaved by 16 rows at
load (:func:`~tartlet.engine.loading.quant_formats.interleave`) and
multiplied by the integer kernel of ``interleaved_avx512.h`` for any number
of rows, with 16-bit activations (two ``vpdpbusd`` per 4 values) or 8-bit
ones (one: ~1.5x the 16-bit speed at 8+ rows): no per-row horizontal sums
(2-3x the row-at-a-time kernel at one row, 4-6x at 8+ rows with 8-bit
activations), faster than the float panel GEMM at 8+ rows, and a row's
result is the same bits in a batch of any size.

Larger batches (prefill, large decode batches) of the other kinds multiply
in float instead. On AVX-512, from ``QuantKernels.panel_rows`` rows (8), the same C call
runs the panel GEMM (``panel_gemm_avx512.h``: 32 weight rows at a time
dequantized into a cache-resident panel). Below AVX-512, from
:data:`DEQUANT_ROWS` rows, each part is dequantized into float32 tiles
multiplied by PyTorch's GEMM, which beats the integer kernel once a tile is
reused by that many rows. Either way no float copy of the weights is kept.
"""

from __future__ import annotations

import torch

from ..kernels.quant_kernels import QuantKernels
from ..loading.quant_formats import BF16, F16, INTERLEAVE_ROWS, INTERLEAVED, QuantWeight

#: Interleave eligible Q4/Q5/Q8 parts at load (see the module docstring);
#: False keeps the row layout (for A/B measurements:
#: ``benchmarks/bench_roofline.py --compare-row-layout``).
INTERLEAVE = True

#: Row count from which a call dequantizes weight tiles into a float GEMM
#: (below AVX-512; there the C panel GEMM takes over from
#: ``QuantKernels.panel_rows``, 8 rows).
#: Measured on the default model, all projections of a step on one thread
#: (CPU ms, integer kernel with the AVX-512 16-row groups vs tiles): 16 rows
#: 77 vs 221, 32 rows 148 vs 209, 48 rows 282 vs 206, 64 rows 343 vs 222
#: (the tiles cost about the same for any row count: dequantizing them is
#: most of it). Before the 16-row groups: B=16 88 ms by the integer kernel
#: vs 104 ms by tiles; B=32 200 vs 153 ms (2 vCPUs, whole decode steps).
DEQUANT_ROWS = 40

#: Values of ``matmul_dtype`` (:class:`~tartlet.engine.models.llama.LlamaModel`): the
#: precision of the panel GEMM's products.
MATMUL_DTYPES = ("float32", "bfloat16")

#: Largest float32 tile (elements) dequantized at once on the GEMM path
#: (16 MiB). 4 MiB tiles were tried: on one thread the 49152 x 576 head
#: times 64 rows took 49 instead of 87 CPU ms, but whole 64-row decode steps
#: on 2 threads took 251 instead of 232 ms (more, smaller parallel
#: dequantizations and GEMMs, and output columns copied from each tile).
_TILE = 1 << 22


class QuantLinear:
    """A quantized weight (and optional float bias) ready to multiply.

    Args:
        parts: the weight's row blocks, top to bottom, each ``[n_i, K]``; runs
            of one kind are merged.
        bias: float32 ``[sum n_i]`` or None.
        kernels: the loaded :class:`QuantKernels`.
        act_bits: 8 or 16, the precision ``x`` is quantized to (see the module docstring).
        bf16: the panel GEMM (AVX-512, 8+ rows) multiplies bfloat16 values
            (:meth:`QuantKernels.linear_desc`); needs ``act_bits`` 16.

    With no ``bf16``, the AVX-512 VNNI kernels in use and :data:`INTERLEAVE`,
    each Q4, Q5, Q6 or Q8 part of a multiple of 16 rows that starts at a
    multiple of 16 outputs is replaced by its interleaved copy (``parts``
    then holds kind ``Q4I``, ``Q5I``, ``Q6I`` or ``Q8I``), for 8-bit and
    16-bit activations alike.

    Raises:
        ValueError: parts of different widths, or a bias of the wrong size.
    """

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, kernels: QuantKernels, act_bits: int = 16,
                 bf16: bool = False) -> None:
        if act_bits not in (8, 16):
            raise ValueError(f"act_bits must be 8 or 16, got {act_bits}")
        self.act_bits = act_bits
        widths = {p.shape[1] for p in parts}
        if len(widths) != 1:
            raise ValueError(f"parts of one projection must have one width, got {sorted(widths)}")
        runs: list[list[QuantWeight]] = []  # consecutive parts of one kind
        for p in parts:
            if runs and runs[-1][0].kind == p.kind:
                runs[-1].append(p)
            else:
                runs.append([p])
        interleaved = INTERLEAVE and not bf16 and kernels.isa == 3  # either act_bits: interleaved_avx512.h
        merged: list[QuantWeight] = []
        n0 = 0
        for run in runs:
            rows = sum(p.shape[0] for p in run)
            if interleaved and run[0].kind in INTERLEAVED and rows % INTERLEAVE_ROWS == 0 and n0 % INTERLEAVE_ROWS == 0:
                merged.append(kernels.interleave(run))  # quant_formats.interleave in C, stacked in the same pass
            else:
                merged.append(run[0] if len(run) == 1 else QuantWeight.cat(run))
            n0 += rows
        self.parts = merged
        self.in_features = widths.pop()
        self.out_features = sum(p.shape[0] for p in merged)
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match {self.out_features} outputs")
        self.bias = None if bias is None else bias.to(torch.float32).contiguous()
        self.kernels = kernels
        self.bf16 = bf16
        self._desc = kernels.linear_desc(merged, self.bias, act_bits, bf16)

    @property
    def nbytes(self) -> int:
        """Bytes of weight (and bias) memory."""
        return sum(p.nbytes for p in self.parts) + (0 if self.bias is None else self.bias.numel() * 4)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + b (+ residual)``.

        Args:
            x: float32 ``[T, in]``, rows contiguous.
            residual: optional float32 ``[T, out]``, added to the result.

        Returns:
            float32 ``[T, out]``, a new tensor.
        """
        if x.stride(-1) != 1:
            x = x.contiguous()
        T = x.shape[0]
        out = torch.empty(T, self.out_features, dtype=torch.float32)
        if T >= DEQUANT_ROWS and self.kernels.isa < 3:  # AVX-512: the C panel GEMM (quant_kernels.py)
            return self._float_gemm(x, out, residual)
        self.kernels.linear(self._desc, x, out, residual)
        return out

    def _float_gemm(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if self.act_bits == 8 and any(p.kind not in (F16, BF16) for p in self.parts):
            # the 8-bit blocks the integer kernel would see, so a row's result does not depend on
            # how many rows share its batch (16-bit rounding is below the GEMM's own error)
            qa, fa = self.kernels.quantize(x, 8)
            x = (qa.view(x.shape[0], -1, 32).float() * fa[:, 0, :, None]).view(x.shape)
        n0 = 0
        for p in self.parts:
            step = max(1, _TILE // self.in_features)
            for s in range(0, p.shape[0], step):
                rows = torch.arange(s, min(s + step, p.shape[0]))
                w = self.kernels.dequantize(p, rows)
                o = out[:, n0 + s : n0 + s + len(rows)]
                torch.mm(x, w.t(), out=o) if o.is_contiguous() else o.copy_(x @ w.t())
            n0 += p.shape[0]
        if self.bias is not None:
            out.add_(self.bias)
        if residual is not None:
            out.add_(residual)
        return out


def embedding_rows(kernels: QuantKernels, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``, each in ``[0, vocab)``) of a quantized
    embedding ``[vocab, H]``, dequantized to float32 ``[T, H]``."""
    return kernels.dequantize(weight, ids.contiguous())
