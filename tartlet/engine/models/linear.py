"""One projection ``y = x @ W^T + b``, with its weight kept in the layout its
device multiplies fastest.

Decode on a CPU multiplies a few rows by each weight matrix, which is where
the BLAS choice matters most. Measured on a 2-core AVX2 machine (float32,
``benchmarks/bench_decode.py`` and the table in ``docs/benchmarks.md``):

* **oneDNN, weights prepacked once** (``torch.ops.mkldnn._reorder_linear_weight``
  into its blocked layout, then ``_linear_pointwise``): 1.5-3.5x faster than
  MKL ``sgemm`` for 2-64 rows (MKL re-packs the whole weight on every call;
  the 49,152 x 576 output projection at 16 rows: 17 ms vs 59 ms), and no
  slower for prefill-sized batches. The residual add or bias is fused into
  the same call as a oneDNN post-op.
* **a transposed ``[in, out]`` copy** for exactly one row: MKL's GEMV streams
  the rows of that layout ~1.3x faster than oneDNN for the layer-sized
  matrices (not for the vocabulary projection). It costs a second copy of
  the weight, so it is optional.

On other devices and dtypes (CUDA, or bfloat16 on a CPU without native bf16
kernels) the weight stays ``[out, in]`` and ``F.linear`` is used.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: Batch size the oneDNN layout is chosen for; measured as good from 2 to 512 rows.
_PACK_ROWS = 16


def onednn_packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights for ``device``/``dtype`` can be prepacked for oneDNN
    (CPU, float32, a PyTorch built with oneDNN)."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]  # unannotated in torch


class Linear:
    """A weight (and optional bias) ready to multiply.

    Args:
        weight: ``[out, in]`` tensor in the compute dtype, on its device
            (Hugging Face ``nn.Linear`` layout).
        bias: ``[out]`` or ``None``.
        pack: prepack the weight for oneDNN (see
            :func:`onednn_packing_available`); when packing fails the plain
            layout is used and a warning is logged.
        gemv_copy: also keep an ``[in, out]`` copy for single-row inputs
            (only meaningful with ``pack``; doubles this weight's memory).

    Attributes:
        in_features, out_features: the weight's shape.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = False, gemv_copy: bool = False) -> None:
        if weight.dim() != 2:
            raise ValueError(f"a linear weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        if bias is not None and bias.shape != (self.out_features,):
            raise ValueError(f"bias shape {tuple(bias.shape)} does not match {self.out_features} outputs")
        self.bias = bias
        self.weight: torch.Tensor | None = weight  # [out, in], for F.linear
        self.packed: torch.Tensor | None = None  # oneDNN blocked layout
        self.weight_t: torch.Tensor | None = None  # [in, out], for single rows
        if pack:
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_ROWS)
            except (RuntimeError, AttributeError) as e:  # a build or CPU without the kernel
                log.warning("oneDNN weight packing unavailable (%s); using plain matrix multiplication", e)
            else:
                self.weight = None
                if gemv_copy:
                    self.weight_t = weight.t().contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + b (+ residual)``.

        Args:
            x: ``[T, in]`` in the compute dtype.
            residual: optional ``[T, out]`` added to the result (fused into
                the multiplication where the kernel allows).

        Returns:
            ``[T, out]``, a new tensor.
        """
        if self.weight_t is not None and x.shape[0] == 1:
            y = x @ self.weight_t if self.bias is None else torch.addmm(self.bias, x, self.weight_t)
        elif self.packed is not None:
            if residual is not None and self.bias is None:
                fused: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, None, "add")
                return fused
            y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            assert self.weight is not None  # kept when not packed
            if residual is not None and self.bias is None and x.is_cuda:
                # one cuBLAS call: the residual is the GEMM's C operand (beta = 1)
                return torch.addmm(residual, x, self.weight.t())
            y = F.linear(x, self.weight, self.bias)
        return y if residual is None else y.add_(residual)
