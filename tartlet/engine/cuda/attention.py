"""Paged decode attention on CUDA, as a Triton kernel.

One program per (request, KV head) reads the request's keys and values
straight from the page pool through its KV slot list (vLLM's
``slot_mapping`` view of the page table: a pool row per token), so nothing
is gathered into a padded copy first as the PyTorch path does. The query
heads that share the KV head (grouped-query attention) are one ``[REP,
head_dim]`` tile multiplied on the tensor cores; the softmax is the online
(streaming) one of FlashAttention (Dao et al. 2022, "FlashAttention",
algorithm 1) over blocks of ``BLOCK_N`` slots. The loop stops at each
request's own length read from device memory, so one launch shape serves
any lengths: what lets the decode step be captured in a CUDA graph with
its slot lists padded to a bucket (:mod:`tartlet.engine.cuda.graphs`).

Triton is imported on first use: the CPU engine never needs it. Under
``TRITON_INTERPRET=1`` the same kernel runs on CPU tensors (slowly), which
is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..core.batch import AttentionGroup


def available() -> bool:
    """Whether Triton can be imported (the CUDA decode kernel's requirement)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]  # Triton is untyped
    def decode_attention(  # type: ignore[no-untyped-def]
        Q, K, V, SLOTS, LENS, MASK, ROWS, OUT,
        stride_qt, stride_ks, stride_vs, stride_sb, stride_mb, stride_ot,
        scale,
        REP: tl.constexpr, REP_P: tl.constexpr, HD: tl.constexpr, HD_P: tl.constexpr,
        BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, PREC: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0)
        h = tl.program_id(1)  # KV head
        row = tl.load(ROWS + b)
        n = tl.load(LENS + b)
        r = tl.arange(0, REP_P)
        d = tl.arange(0, HD_P)
        qmask = (r < REP)[:, None] & (d < HD)[None, :]
        heads = h * REP + r  # the query heads of KV head h
        q = tl.load(Q + row * stride_qt + heads[:, None] * HD + d[None, :], mask=qmask, other=0.0)
        m_i = tl.full([REP_P], float("-inf"), tl.float32)
        l_i = tl.zeros([REP_P], tl.float32)
        acc = tl.zeros([REP_P, HD_P], tl.float32)
        start = 0
        while start < n:  # a while loop: Triton's interpreter cannot range() over a loaded bound
            cols = start + tl.arange(0, BLOCK_N)
            live = cols < n
            slots = tl.load(SLOTS + b * stride_sb + cols, mask=live, other=0)
            if HAS_MASK:
                live = live & (tl.load(MASK + b * stride_mb + cols, mask=live, other=0) != 0)
            kv_mask = live[:, None] & (d < HD)[None, :]
            k = tl.load(K + slots[:, None] * stride_ks + h * HD + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * scale  # [REP_P, BLOCK_N]
            s = tl.where(live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing visible yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            v = tl.load(V + slots[:, None] * stride_vs + h * HD + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            start += BLOCK_N
        out = acc / tl.maximum(l_i, 1e-30)[:, None]  # a request with no visible slot gets zeros
        tl.store(OUT + row * stride_ot + heads[:, None] * HD + d[None, :], out.to(OUT.dtype.element_ty), mask=qmask)

    return decode_attention


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_slots: torch.Tensor,
    lens: torch.Tensor,
    mask: torch.Tensor | None,
    rows: torch.Tensor,
    out: torch.Tensor,
    scale: float,
) -> None:
    """Single-query attention of ``B`` requests over their pool rows,
    written into ``out``.

    Args:
        q: ``[T, num_heads, head_dim]`` queries (row stride may exceed
            ``num_heads * head_dim``: a view into the QKV projection).
        k_cache, v_cache: one layer's pool ``[slots, num_kv_heads, head_dim]``
            (float32, bfloat16 or float16; the dtype of ``q``).
        kv_slots: int64 ``[B, L]`` pool row of each request's keys, in order.
        lens: int32 ``[B]`` columns of ``kv_slots`` each request reads
            (``<= L``; 0 gives a zero output).
        mask: bool ``[B, L]`` (True = may attend) or ``None`` (every column
            below ``lens``).
        rows: int32 ``[B]`` row of ``q`` and ``out`` of each request.
        out: ``[T, num_heads * head_dim]``, contiguous; rows ``rows`` written.
        scale: score scale (``1 / sqrt(head_dim)`` for most models).

    Raises:
        ValueError: mismatched shapes or dtypes.
    """
    T, nh, hd = q.shape
    nkv = k_cache.shape[1]
    B = kv_slots.shape[0]
    if k_cache.shape[2] != hd or v_cache.shape != k_cache.shape or nh % nkv:
        raise ValueError(f"query heads {nh}x{hd} do not match a KV pool of {tuple(k_cache.shape[1:])}")
    if q.dtype != k_cache.dtype or k_cache.stride(1) != hd or q.stride(1) != hd or q.stride(2) != 1:
        raise ValueError(f"decode attention needs {q.dtype} queries and pool with contiguous heads")
    if lens.shape != (B,) or rows.shape != (B,) or (mask is not None and mask.shape != kv_slots.shape):
        raise ValueError(f"lens, rows and mask must cover the {B} requests of kv_slots {tuple(kv_slots.shape)}")
    if out.shape != (T, nh * hd) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{T}, {nh * hd}], got {tuple(out.shape)}")
    if B == 0:
        return
    from triton import next_power_of_2 as pow2

    rep = nh // nkv
    m = kv_slots if mask is None else mask  # any tensor: HAS_MASK is False
    _kernel()[(B, nkv)](
        q, k_cache, v_cache, kv_slots, lens, m, rows, out,
        q.stride(0), k_cache.stride(0), v_cache.stride(0), kv_slots.stride(0), m.stride(0), out.stride(0),
        scale,
        REP=rep, REP_P=max(16, pow2(rep)), HD=hd, HD_P=max(16, pow2(hd)), BLOCK_N=32 if hd > 128 else 64,
        HAS_MASK=mask is not None, PREC="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip


def decode_plan(g: "AttentionGroup") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The kernel's view of a single-query attention group (once per pass,
    shared by the layers): int32 ``rows`` ``[B]``, int32 ``lens`` ``[B]``
    (one past each request's last visible column) and the bool ``[B, L]``
    mask, or ``None`` when the group has none (every column visible).
    Tensor ops only, on the group's device, so a CUDA graph can capture it."""
    B, L = g.kv_slots.shape
    dev = g.kv_slots.device
    rows = torch.arange(g.row_start, g.row_start + B, device=dev) if g.rows is None else g.rows
    if g.mask is None:
        return rows.to(torch.int32), torch.full((B,), L, dtype=torch.int32, device=dev), None
    m = g.mask.view(B, L)
    lens = (m * torch.arange(1, L + 1, device=dev)).amax(1)
    return rows.to(torch.int32), lens.to(torch.int32), m
