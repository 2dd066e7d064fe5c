"""RoPE and the KV write of a layer in one Triton kernel (CUDA).

Op by op, rotating the query and key heads and writing keys and values to
the page pool takes five or six kernels a layer (products, a roll, two
``index_copy_``); at batch 1 a decode step is a few hundred such small
kernels, each costing a launch and a ramp. This kernel does it in one: per
(token, head) it rotates the head in the ``rotate_half`` layout of
Hugging Face's ``apply_rotary_pos_emb`` (``x * cos + rotate_half(x) * sin``,
``rotate_half(x) = cat(-x2, x1)``) in float32, writes query heads back in
place and key heads, with the matching value head, to the token's pool row.
The C kernel of :mod:`tartlet.engine.kernels.cpu_kernels` does the same on the CPU.
Triton is imported on first use; ``TRITON_INTERPRET=1`` runs it on CPU
tensors for tests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]  # Triton is untyped
    def rope_qkv_store(  # type: ignore[no-untyped-def]
        QKV, COS, SIN, K, V, SLOTS,
        stride_qkv, stride_cos, stride_ks, stride_vs,
        NH: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, HALF_P: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        h = tl.program_id(1)  # query heads, then key heads
        i = tl.arange(0, HALF_P)
        live = i < HD // 2
        row = QKV + t * stride_qkv + h * HD
        x1 = tl.load(row + i, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(row + HD // 2 + i, mask=live, other=0.0).to(tl.float32)
        c = tl.load(COS + t * stride_cos + i, mask=live, other=0.0)
        s = tl.load(SIN + t * stride_cos + i, mask=live, other=0.0)
        y1 = (x1 * c - x2 * s).to(QKV.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(QKV.dtype.element_ty)
        if h < NH:
            tl.store(row + i, y1, mask=live)
            tl.store(row + HD // 2 + i, y2, mask=live)
        else:
            kh = h - NH
            slot = tl.load(SLOTS + t)
            k_row = K + slot * stride_ks + kh * HD
            tl.store(k_row + i, y1.to(K.dtype.element_ty), mask=live)
            tl.store(k_row + HD // 2 + i, y2.to(K.dtype.element_ty), mask=live)
            v_src = QKV + t * stride_qkv + (NH + NKV + kh) * HD
            v_row = V + slot * stride_vs + kh * HD
            tl.store(v_row + i, tl.load(v_src + i, mask=live, other=0.0).to(V.dtype.element_ty), mask=live)
            tl.store(v_row + HD // 2 + i, tl.load(v_src + HD // 2 + i, mask=live, other=0.0).to(V.dtype.element_ty),
                     mask=live)  # fmt: skip

    return rope_qkv_store


def rope_qkv_store(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
    write_slots: torch.Tensor, nh: int, nkv: int, hd: int,
) -> torch.Tensor:  # fmt: skip
    """RoPE the query and key heads of ``qkv`` ``[T, (nh + 2 nkv) hd]``
    (rows contiguous) with float32 ``cos``/``sin`` ``[T, hd / 2]``; keys
    and values are written to rows ``write_slots`` (int64 ``[T]``) of
    ``k_pool``/``v_pool`` ``[slots, nkv, hd]`` (the dtype of ``qkv``).
    Returns the rotated queries ``[T, nh, hd]``, a view of ``qkv``
    (rotated in place).

    Raises:
        ValueError: mismatched shapes, dtypes or layouts, or an odd ``hd``.
    """
    T = qkv.shape[0]
    if hd % 2 or qkv.shape != (T, (nh + 2 * nkv) * hd) or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, (nh + 2 nkv) hd] = [{T}, {(nh + 2 * nkv) * hd}] with even hd, got {tuple(qkv.shape)}")
    if cos.shape != (T, hd // 2) or sin.shape != cos.shape or cos.dtype != torch.float32 or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError(f"cos and sin must be float32 [{T}, {hd // 2}] with the same layout")
    if k_pool.shape[1:] != (nkv, hd) or v_pool.shape != k_pool.shape or k_pool.stride(1) != hd or v_pool.stride(1) != hd:
        raise ValueError(f"the pool must be [slots, {nkv}, {hd}] with contiguous rows, got {tuple(k_pool.shape)}")
    if k_pool.dtype != qkv.dtype or write_slots.shape != (T,):
        raise ValueError(f"the pool must hold {qkv.dtype} and write_slots one row per token")
    if T:
        from triton import next_power_of_2

        _kernel()[(T, nh + nkv)](
            qkv, cos, sin, k_pool, v_pool, write_slots,
            qkv.stride(0), cos.stride(0), k_pool.stride(0), v_pool.stride(0),
            NH=nh, NKV=nkv, HD=hd, HALF_P=max(16, next_power_of_2(hd // 2)),
        )  # fmt: skip
    return qkv[:, : nh * hd].view(T, nh, hd)
