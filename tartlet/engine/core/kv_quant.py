"""The int8 KV page format: 8-bit keys and values with a scale per row.

``kv_dtype = "int8"`` stores each (token, KV head) row of ``head_dim``
values ``x`` as ``head_dim`` int8 quants ``q`` followed by their float32
scale ``d`` (4 bytes, native byte order), so a pool row is
``head_dim + 4`` bytes instead of ``4 * head_dim`` (float32): the page pool
tensors are int8 ``[layers, slots, kv_heads, head_dim + 4]``. Because the
scale sits in the row it belongs to, everything that moves KV rows (fork
and copy-on-write, snapshots on disk, prefix-cache sharing) moves the
scales with them unchanged.

The quantization is llama.cpp's ``Q8_0`` (``ggml-quants.c``,
``quantize_row_q8_0``: symmetric absmax, ``d = max|x| / 127``,
``q = round(x * 127 / max|x|)``, round to nearest with ties to even as in its
AVX2 path's ``_mm256_round_ps``) with the block widened from 32 values to
one head row and the scale kept in float32 rather than float16. Dequantized,
``x ~ q * d`` with an error of at most ``d / 2`` per value.

The C kernels of :mod:`tartlet.engine.kernels.cpu_kernels` (``kv_int8.h``) write
and read the same layout bit for bit; these functions are the PyTorch path
(no compiler, CUDA, bfloat16 compute) and the prefill path's dequantizer.
"""

from __future__ import annotations

import torch

#: bytes of the float32 scale after each row's quants
SCALE_BYTES = 4


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Last dimension of a pool tensor of ``dtype``: ``head_dim``, plus the
    scale's 4 bytes for int8."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """Quantize ``x`` ``[..., head_dim]`` (any float dtype) row by row.

    Returns:
        int8 ``[..., head_dim + 4]``: each row's quants, then its float32
        scale as 4 bytes. An all-zero row gets scale 0 and zero quants.
    """
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    d = amax / 127
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(x * inv).to(torch.int8)  # half to even, like the C kernel's rintf
    return torch.cat((q, d.view(torch.int8)), -1)


def dequantize_rows(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_rows`: int8 ``[..., head_dim + 4]`` to
    ``[..., head_dim]`` of ``dtype`` (``q * d``, computed in float32)."""
    hd = packed.shape[-1] - SCALE_BYTES
    d = packed[..., hd:].contiguous().view(torch.float32)
    return (packed[..., :hd].float() * d).to(dtype)


def to_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ``[..., head_dim]`` as rows of a pool of ``dtype``."""
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)


def from_pool(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows (int8 ``[..., head_dim + 4]`` or float ``[..., head_dim]``)
    as ``[..., head_dim]`` values of ``dtype``."""
    return dequantize_rows(rows, dtype) if rows.dtype == torch.int8 else rows.to(dtype)
