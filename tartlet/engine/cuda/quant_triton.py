"""The Triton kernels of :mod:`tartlet.engine.cuda.quant_matmul` (imported
on first use: this module imports Triton). Layout and paths: see there."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]  # Triton is untyped
def half_tiles(Q, D, Mn, rn, nmask, b0, NB, stride_q, stride_d,  # type: ignore[no-untyped-def]
               KIND: tl.constexpr, QB: tl.constexpr, BB: tl.constexpr):  # fmt: skip
    """Rows ``rn`` x blocks ``b0 .. b0 + BB`` dequantized to float32 halves
    ``[BN, 16 BB]``: the low-nibble elements (``j``) and the high ones (``16 + j``)."""
    kk = tl.arange(0, BB * 16)
    blk = b0 + kk // 16
    j = kk % 16
    live = nmask[:, None] & (blk < NB)[None, :]
    qrow = Q + rn[:, None].to(tl.int64) * stride_q + blk[None, :] * QB
    if KIND == 0:  # Q8: bytes j and 16 + j, m = -128 d
        lo = tl.load(qrow + j[None, :], mask=live, other=0).to(tl.float32) - 128.0
        hi = tl.load(qrow + 16 + j[None, :], mask=live, other=0).to(tl.float32) - 128.0
    else:
        byte = tl.load(qrow + j[None, :], mask=live, other=0).to(tl.int32)
        qlo = byte & 15
        qhi = byte >> 4
        if KIND == 2:  # Q5: bit 4 of element e in bit e >> 2 of byte 16 + (e & 3)
            hb = tl.load(qrow + 16 + (j & 3)[None, :], mask=live, other=0).to(tl.int32)
            qlo = qlo | (((hb >> (j >> 2)[None, :]) & 1) << 4)
            qhi = qhi | (((hb >> (4 + (j >> 2))[None, :]) & 1) << 4)
        if KIND == 3:  # Q6: bits 4-5 of element e in bits 2 (e >> 3) of byte 16 + (e & 7), m = -32 d
            hb = tl.load(qrow + 16 + (j & 7)[None, :], mask=live, other=0).to(tl.int32)
            qlo = qlo | (((hb >> (2 * (j >> 3))[None, :]) & 3) << 4)
            qhi = qhi | (((hb >> (4 + 2 * (j >> 3))[None, :]) & 3) << 4)
            qlo = qlo - 32
            qhi = qhi - 32
        lo = qlo.to(tl.float32)
        hi = qhi.to(tl.float32)
    drow = D + rn[:, None].to(tl.int64) * stride_d
    if KIND == 3:  # a scale per 16 elements: the low nibbles take the first
        lo = lo * tl.load(drow + 2 * blk[None, :], mask=live, other=0.0).to(tl.float32)
        hi = hi * tl.load(drow + 2 * blk[None, :] + 1, mask=live, other=0.0).to(tl.float32)
    else:
        d = tl.load(drow + blk[None, :], mask=live, other=0.0).to(tl.float32)
        lo = lo * d
        hi = hi * d
        if KIND == 1 or KIND == 2:  # Q4, Q5: a minimum per block
            m = tl.load(Mn + rn[:, None].to(tl.int64) * stride_d + blk[None, :], mask=live, other=0.0).to(tl.float32)
            lo = lo + m
            hi = hi + m
    return lo, hi


@triton.jit  # type: ignore[untyped-decorator]
def block_tiles(Q, D, Mn, rn, nmask, b0, NB, stride_q, stride_d,  # type: ignore[no-untyped-def]
                KIND: tl.constexpr, QB: tl.constexpr, BB: tl.constexpr):  # fmt: skip
    """Rows ``rn`` x blocks ``b0 .. b0 + BB`` as unscaled values, float32
    ``[BN, BB, 16]`` halves (low nibbles: elements ``j``, high: ``16 + j``),
    and each half's scale and minimum ``[BN, BB]``: ``w = d q + m``."""
    rb = b0 + tl.arange(0, BB)
    j = tl.arange(0, 16)[None, None, :]
    bmask = nmask[:, None] & (rb < NB)[None, :]
    live = bmask[:, :, None]
    qrow = Q + rn[:, None, None].to(tl.int64) * stride_q + rb[None, :, None] * QB
    if KIND == 0:  # Q8: bytes j and 16 + j, m = -128 d
        qlo = tl.load(qrow + j, mask=live, other=0)
        qhi = tl.load(qrow + 16 + j, mask=live, other=0)
    else:
        byte = tl.load(qrow + j, mask=live, other=0).to(tl.int32)
        qlo = byte & 15
        qhi = byte >> 4
        if KIND == 2:  # Q5: bit 4 of element e in bit e >> 2 of byte 16 + (e & 3)
            hb = tl.load(qrow + 16 + (j & 3), mask=live, other=0).to(tl.int32)
            qlo = qlo | (((hb >> (j >> 2)) & 1) << 4)
            qhi = qhi | (((hb >> (4 + (j >> 2))) & 1) << 4)
        if KIND == 3:  # Q6: bits 4-5 of element e in bits 2 (e >> 3) of byte 16 + (e & 7), m = -32 d
            hb = tl.load(qrow + 16 + (j & 7), mask=live, other=0).to(tl.int32)
            qlo = qlo | (((hb >> (2 * (j >> 3))) & 3) << 4)
            qhi = qhi | (((hb >> (4 + 2 * (j >> 3))) & 3) << 4)
    drow = D + rn[:, None].to(tl.int64) * stride_d
    if KIND == 3:  # a scale per 16 elements: the low nibbles take the first
        dlo = tl.load(drow + 2 * rb[None, :], mask=bmask, other=0.0).to(tl.float32)
        dhi = tl.load(drow + 2 * rb[None, :] + 1, mask=bmask, other=0.0).to(tl.float32)
        mlo = -32.0 * dlo
        mhi = -32.0 * dhi
    else:
        dlo = tl.load(drow + rb[None, :], mask=bmask, other=0.0).to(tl.float32)
        dhi = dlo
        if KIND == 0:
            mlo = -128.0 * dlo
        else:  # Q4, Q5: a minimum per block
            mlo = tl.load(Mn + rn[:, None].to(tl.int64) * stride_d + rb[None, :], mask=bmask, other=0.0).to(tl.float32)
        mhi = mlo
    return qlo.to(tl.float32), qhi.to(tl.float32), dlo, dhi, mlo, mhi


@triton.jit  # type: ignore[untyped-decorator]
def gemv(X, Q, D, Mn, Bias, R, Y, N, stride_x, stride_q, stride_d, stride_r, stride_y,  # type: ignore[no-untyped-def]
         NB: tl.constexpr, KIND: tl.constexpr, QB: tl.constexpr, ROWS: tl.constexpr, RP: tl.constexpr,
         HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr, SUMS: tl.constexpr):  # fmt: skip
    """``Y = X W^T`` for ``ROWS`` rows of ``X``; ``SUMS``: products of the
    unscaled values summed per block, then scaled (``d sum(q x) + m sum(x)``:
    one multiply-add per weight), else every weight dequantized first."""
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    nmask = rn < N
    rr = tl.arange(0, RP)
    acc = tl.zeros((RP, BN), dtype=tl.float32)
    for b0 in range(0, NB, BB):
        if SUMS:
            qlo, qhi, dlo, dhi, mlo, mhi = block_tiles(Q, D, Mn, rn, nmask, b0, NB, stride_q, stride_d, KIND, QB, BB)
            rb = b0 + tl.arange(0, BB)
            xo = rb[:, None] * 32 + tl.arange(0, 16)[None, :]  # [BB, 16]
            xm = (rb < NB)[:, None]
            for r in tl.static_range(ROWS):
                xl = tl.load(X + r * stride_x + xo, mask=xm, other=0.0).to(tl.float32)
                xh = tl.load(X + r * stride_x + xo + 16, mask=xm, other=0.0).to(tl.float32)
                slo = tl.sum(qlo * xl[None, :, :], 2)  # [BN, BB]
                shi = tl.sum(qhi * xh[None, :, :], 2)
                blocks = dlo * slo + dhi * shi + mlo * tl.sum(xl, 1)[None, :] + mhi * tl.sum(xh, 1)[None, :]
                acc += tl.where(rr[:, None] == r, tl.sum(blocks, 1)[None, :], 0.0)
        else:
            lo, hi = half_tiles(Q, D, Mn, rn, nmask, b0, NB, stride_q, stride_d, KIND, QB, BB)
            kk = tl.arange(0, BB * 16)
            blk = b0 + kk // 16
            xo2 = blk * 32 + kk % 16
            kmask = blk < NB
            for r in tl.static_range(ROWS):
                xl2 = tl.load(X + r * stride_x + xo2, mask=kmask, other=0.0).to(tl.float32)
                xh2 = tl.load(X + r * stride_x + xo2 + 16, mask=kmask, other=0.0).to(tl.float32)
                part = tl.sum(lo * xl2[None, :] + hi * xh2[None, :], 1)
                acc += tl.where(rr[:, None] == r, part[None, :], 0.0)
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0)[None, :]
    live = (rr < ROWS)[:, None] & nmask[None, :]
    if HAS_RES:
        acc += tl.load(R + rr[:, None] * stride_r + rn[None, :], mask=live, other=0.0).to(tl.float32)
    tl.store(Y + rr[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=live)


@triton.jit  # type: ignore[untyped-decorator]
def dot(X, Q, D, Mn, Bias, R, Y, M, N, stride_x, stride_q, stride_d, stride_r, stride_y,  # type: ignore[no-untyped-def]
        NB: tl.constexpr, KIND: tl.constexpr, QB: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, IEEE: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):  # fmt: skip
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mmask = rm < M
    nmask = rn < N
    kk = tl.arange(0, BB * 16)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    xrow = X + rm[:, None].to(tl.int64) * stride_x
    for b0 in range(0, NB, BB):
        lo, hi = half_tiles(Q, D, Mn, rn, nmask, b0, NB, stride_q, stride_d, KIND, QB, BB)
        blk = b0 + kk // 16
        xo = (blk * 32 + kk % 16)[None, :]
        xm = mmask[:, None] & (blk < NB)[None, :]
        xl = tl.load(xrow + xo, mask=xm, other=0.0)
        xh = tl.load(xrow + xo + 16, mask=xm, other=0.0)
        if IEEE:
            acc += tl.dot(xl, tl.trans(lo.to(xl.dtype)), input_precision="ieee")
            acc += tl.dot(xh, tl.trans(hi.to(xh.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(xl, tl.trans(lo.to(xl.dtype)))
            acc += tl.dot(xh, tl.trans(hi.to(xh.dtype)))
    if HAS_BIAS:
        acc += tl.load(Bias + rn, mask=nmask, other=0.0)[None, :]
    live = mmask[:, None] & nmask[None, :]
    if HAS_RES:
        acc += tl.load(R + rm[:, None].to(tl.int64) * stride_r + rn[None, :], mask=live, other=0.0).to(tl.float32)
    tl.store(Y + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=live)


@triton.jit  # type: ignore[untyped-decorator]
def dequant(Q, D, Mn, Idx, Y, N, NB, stride_q, stride_d, stride_y,  # type: ignore[no-untyped-def]
            KIND: tl.constexpr, QB: tl.constexpr, HAS_IDX: tl.constexpr, BN: tl.constexpr, BB: tl.constexpr):  # fmt: skip
    ro = tl.program_id(0) * BN + tl.arange(0, BN)  # output rows
    nmask = ro < N
    b0 = tl.program_id(1) * BB
    if HAS_IDX:
        rn = tl.load(Idx + ro, mask=nmask, other=0)
    else:
        rn = ro
    lo, hi = half_tiles(Q, D, Mn, rn, nmask, b0, NB, stride_q, stride_d, KIND, QB, BB)
    kk = tl.arange(0, BB * 16)
    blk = b0 + kk // 16
    live = nmask[:, None] & (blk < NB)[None, :]
    out = Y + ro[:, None].to(tl.int64) * stride_y + (blk * 32 + kk % 16)[None, :]
    tl.store(out, lo.to(Y.dtype.element_ty), mask=live)
    tl.store(out + 16, hi.to(Y.dtype.element_ty), mask=live)
