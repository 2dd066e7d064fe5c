"""Argument checks shared by the ctypes kernel wrappers (:mod:`.cpu_kernels`,
:mod:`.quant_kernels`).

A C kernel trusts every pointer and size it is given, so a tensor of the
wrong shape, dtype, layout or device reads or writes out of bounds instead
of failing. The wrappers therefore check each tensor before the call, in
O(1) per tensor (dtype, device, dimensions, the strides the C code assumes;
never the values, such as index ranges, which would cost a pass over the
data): each check is a plain boolean test on the hot path, and only when it
fails is :func:`bad_tensor` called to build the message, which names the
argument and gives the expected against the actual shape, dtype and layout.
"""

from __future__ import annotations

from typing import NoReturn, Sequence

import torch

F32, I64 = torch.float32, torch.int64


def bad_tensor(
    kernel: str, name: str, t: object, shape: Sequence[object], dtype: str = "float32", layout: str = "contiguous"
) -> NoReturn:
    """Raise the :class:`ValueError` of argument ``name`` of ``kernel``.

    Args:
        shape: the expected shape, each entry a size or a name (``"T"``).
        dtype: the expected dtype(s), in words.
        layout: the expected memory layout, in words (``"contiguous"``,
            ``"rows contiguous"``).
    """
    want = f"{layout} {dtype} CPU tensor of shape [{', '.join(str(s) for s in shape)}]"
    if isinstance(t, torch.Tensor):
        got = (f"{str(t.dtype).replace('torch.', '')} {t.device.type.upper()} tensor of shape {list(t.shape)}"
               f" (strides {list(t.stride())})")
    else:
        got = type(t).__name__
    raise ValueError(f"{kernel}: {name} must be a {want}, got a {got}")
