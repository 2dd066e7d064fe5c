"""How the fused decode step stores an adapter's matrices
(``lora_kernels.h``): the ``tq_lora_mat`` / ``tq_lora_batch`` structures
of ``quant_kernels.c``'s boundary and the packed layout they point into.

The step reads each adapter of a batch once per step; at 8-16 adapters a
step that is as many bytes as the base weights. Row-major ``A^T`` ``[k,
r]`` and ``B^T`` ``[r, n]`` made those reads many short streams (one per
rank row of ``B^T``, ``n`` values each) that ran at a quarter of the
bandwidth the base weights' single stream gets. :func:`lora_pack` lays each
matrix out in the order the kernels read it, one contiguous run.
"""

from __future__ import annotations

import ctypes

import torch

from .kernel_checks import F32, bad_tensor

_P, _I = ctypes.c_void_p, ctypes.c_int64

#: Ranks a group of a packed ``at`` holds, columns a panel of a packed ``bt`` (``TQ_LORA_W``).
LORA_W = 16


def lora_pack(at: torch.Tensor, bt: torch.Tensor, blocks: "tuple[tuple[int, int, int, int], ...]") -> tuple[torch.Tensor, torch.Tensor]:
    """``at`` ``[k, r]`` and ``bt`` ``[r, n]`` (any one dtype) as the fused
    step reads them, same dtype: ``at`` as ``[ceil(r / W), k, W]`` rank
    groups (``W`` = :data:`LORA_W`; ranks past ``r`` zero); ``bt`` flat,
    its diagonal ``blocks`` ``(n0, n1, c0, c1)`` (outputs ``[n0, n1)`` use
    ranks ``[c0, c1)`` only; empty: the whole matrix, one block) one after
    another, each as ``[P, c1 - c0, W]`` column panels: panel ``p`` holds
    columns ``W * (n0 // W + p)`` to ``+ W``, zeros outside ``[n0, n1)``
    (``P = ceil(n1 / W) - n0 // W``)."""
    (k, r), n, w = at.shape, bt.shape[1], LORA_W
    g = -(-r // w)
    ap = at.new_zeros(k, g * w)
    ap[:, :r] = at
    parts = [bt.new_zeros(0)]
    for n0, n1, c0, c1 in blocks or ((0, n, 0, r),):
        j0, j1 = n0 // w, -(-n1 // w)
        blk = bt.new_zeros(c1 - c0, (j1 - j0) * w)
        blk[:, n0 - j0 * w : n1 - j0 * w] = bt[c0:c1, n0:n1]
        parts.append(blk.view(c1 - c0, j1 - j0, w).transpose(0, 1).reshape(-1))
    return ap.view(k, g, w).transpose(0, 1).contiguous(), torch.cat(parts)


#: Most diagonal blocks a :class:`LoraMat` describes (``TQ_LORA_MAX_BLOCKS``).
LORA_MAX_BLOCKS = 4


#: ``tq_lora_mat.dtype`` per storage dtype of an adapter's matrices (``TQ_LORA_*``).
LORA_DTYPES = {torch.float32: 0, torch.float16: 1, torch.int8: 2}
LORA_DTYPE_NAMES = {torch.float32: "TQ_LORA_F32", torch.float16: "TQ_LORA_F16", torch.int8: "TQ_LORA_I8"}


class LoraMat(ctypes.Structure):
    """One adapter's update of one projection (``tq_lora_mat``): ``at``
    ``A^T`` ``[k, r]``, ``bt`` ``(s B)^T`` ``[r, n]`` of one of
    :data:`LORA_DTYPES`, packed by :func:`lora_pack` (int8: with ``scale``
    float32 ``[r]``, rank ``c`` of ``x @ at`` multiplied by ``scale[c]``),
    or ``at`` NULL where the adapter leaves the projection alone;
    ``blocks[:nblocks]`` ``(n0, n1, c0, c1)``: outputs ``[n0, n1)`` use
    ranks ``[c0, c1)`` only (``nblocks`` 0: ``bt`` is dense). An adapter is
    an array of ``4 * n_layers`` of them (:func:`lora_mats`)."""

    _fields_ = [("at", _P), ("bt", _P), ("scale", _P), ("r", _I), ("dtype", _I), ("nblocks", _I),
                ("blocks", (_I * 4) * LORA_MAX_BLOCKS)]


class LoraBatchDesc(ctypes.Structure):
    """The adapters of one fused step (``tq_lora_batch``): row ``t`` uses
    ``adapters[row_adapter[t]]`` (an array of :class:`LoraMat`), or none when
    that is negative."""

    _fields_ = [("n_adapters", _I), ("adapters", ctypes.POINTER(_P)), ("row_adapter", _P)]


#: The projections of a layer in a :class:`LoraMat` array, in order (``4 * layer + index``).
LORA_PROJECTIONS = ("qkv", "o", "gate_up", "down")

#: One projection's LoRA matrices for :func:`lora_mats`: ``at``, ``bt``, the
#: diagonal blocks of ``bt`` and (int8 matrices) the per-rank scale.
LoraParts = tuple[torch.Tensor, torch.Tensor, "tuple[tuple[int, int, int, int], ...]", "torch.Tensor | None"]


def lora_mats(layers: "list[dict[str, LoraParts]]", shapes: "list[dict[str, tuple[int, int]]]",
              ) -> "tuple[ctypes.Array[LoraMat], list[torch.Tensor]]":
    """The :class:`LoraMat` array of one adapter and the packed matrices it
    points into (:func:`lora_pack`; keep them while the array is used):
    ``layers[l][proj] = (at, bt, blocks, scale)`` for the projections it
    changes (keys of :data:`LORA_PROJECTIONS`; ``at`` ``[k, r]``, ``bt``
    ``[r, n]``; ``blocks`` as :class:`LoraMat`'s, or empty; ``scale``
    float32 ``[r]`` for int8 matrices, else None), checked against
    ``shapes[l][proj] = (k, n)``, the base projection's input and output
    widths. ``scale`` must outlive the array too.

    Raises:
        ValueError: a matrix that is not of :data:`LORA_DTYPES` on the CPU,
            contiguous, of the shape ``[k, r]`` / ``[r, n]`` (both of one
            dtype), a missing or misshapen scale, or blocks outside the
            matrix or more than :data:`LORA_MAX_BLOCKS`.
    """
    arr = (LoraMat * (len(LORA_PROJECTIONS) * len(layers)))()
    keep: list[torch.Tensor] = []
    for li, layer in enumerate(layers):
        for pi, proj in enumerate(LORA_PROJECTIONS):
            if proj not in layer:
                continue
            at, bt, blocks, scale = layer[proj]
            k, n = shapes[li][proj]
            r = at.shape[1] if at.dim() == 2 else -1
            for name, t, shape in (("at", at, (k, r)), ("bt", bt, (r, n))):
                if not (t.shape == shape and t.dtype in LORA_DTYPES and t.dtype == at.dtype and t.is_cpu
                        and t.is_contiguous()):
                    bad_tensor("lora_mats", f"layer {li} {proj} {name}", t, shape, f"float32, float16 or int8 (as at, {at.dtype})")
            if at.dtype == torch.int8 and not (scale is not None and scale.shape == (r,) and scale.dtype is F32
                                               and scale.is_cpu and scale.is_contiguous()):
                bad_tensor("lora_mats", f"layer {li} {proj} scale", scale, [r])
            if len(blocks) > LORA_MAX_BLOCKS or any(not (0 <= n0 <= n1 <= n and 0 <= c0 <= c1 <= r) for n0, n1, c0, c1 in blocks):
                raise ValueError(f"lora_mats: layer {li} {proj}: blocks {blocks} are not up to {LORA_MAX_BLOCKS} "
                                 f"blocks of a [{r}, {n}] matrix")
            ap, bp = lora_pack(at, bt, blocks)
            keep += [ap, bp]
            m = LoraMat(ap.data_ptr(), bp.data_ptr(), scale.data_ptr() if scale is not None and at.dtype == torch.int8 else None, r,
                        LORA_DTYPES[at.dtype], len(blocks))
            for i, b in enumerate(blocks):
                m.blocks[i][:] = b
            arr[len(LORA_PROJECTIONS) * li + pi] = m
    return arr, keep
