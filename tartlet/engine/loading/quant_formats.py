"""Quantized weight matrices: GGUF block formats repacked into the layouts the
quantized CPU kernels (``quant_kernels.c``) multiply.

GGUF formats read (block layouts of ggml's ``ggml-common.h``, the reference
for ``gguf.quants``; a block covers 32 weights, 256 for K-quants; ``d``,
``dmin``, ``m`` are float16):

=========  =====  ======================================================================
format     bytes  one block
=========  =====  ======================================================================
Q8_0        34    ``d``, ``int8 qs[32]``;               w = d * q
Q4_0        18    ``d``, ``qs[16]`` (nibbles);          w = d * (q - 8)
Q4_1        20    ``d``, ``m``, ``qs[16]``;             w = d * q + m
Q5_0        22    ``d``, ``qh[4]``, ``qs[16]``;         w = d * (q - 16), q = nibble | bit << 4
Q5_1        24    ``d``, ``m``, ``qh[4]``, ``qs[16]``;  w = d * q + m
Q4_K       144    ``d``, ``dmin``, 6-bit ``scales[12]``, ``qs[128]``; 8 sub-blocks of 32:
                  w = d * sc_i * q - dmin * m_i
Q5_K       176    Q4_K plus ``qh[32]``: 5-bit q
Q6_K       210    ``ql[128]``, ``qh[64]``, ``int8 scales[16]``, ``d``; 16 sub-blocks of 16:
                  w = d * sc_i * (q - 32)
F16, BF16   2/w   kept as is, multiplied by their own kernel
=========  =====  ======================================================================

In Q4_0/Q4_1/Q5_* byte ``j`` of ``qs`` holds element ``j`` in its low and
element ``j + 16`` in its high nibble; Q5's ``qh`` is a little-endian
``uint32`` whose bit ``j`` is bit 4 of element ``j``.

Every format becomes one of four kernel *kinds* over 32-weight blocks with
unsigned values ``q`` and ``w = d * q + m`` (struct of arrays: ``q`` bytes,
``d`` and ``m`` float16 per block; the byte layouts are documented at the top
of ``quant_kernels.c``): Q8 (Q8_0), Q4 (Q4_0, Q4_1, Q4_K), Q5 (Q5_0, Q5_1,
Q5_K), Q6 (Q6_K, with a ``d`` per 16 weights). Repacking is exact for the
32-block formats; for K-quants the sub-block scale ``d * sc`` (and minimum
``dmin * m``) is stored as one float16, a relative rounding of at most 2^-11.
Memory: Q4 kinds take 5 bits per weight (Q4_K files 4.5), Q5 6 (Q5_K 5.5),
Q6 7 (Q6_K 6.56), Q8 8.5 (Q8_0 8.5).

On CPUs with AVX-512 VNNI a Q4, Q5, Q6 or Q8 matrix with a multiple of 16
rows is regrouped once at load into kind ``Q4I``, ``Q5I``, ``Q6I`` or ``Q8I``
(:func:`interleave`: the same bytes, 16 rows interleaved block by block),
which the kernel of ``interleaved_avx512.h`` multiplies for any number of
activation rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

QK = 32
Q8, Q4, Q5, Q6, F16, BF16, Q4I, Q8I, Q5I, Q6I = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9
KIND_NAMES = {Q8: "q8", Q4: "q4", Q5: "q5", Q6: "q6", F16: "f16", BF16: "bf16", Q4I: "q4x16", Q8I: "q8x16",
              Q5I: "q5x16", Q6I: "q6x16"}
QBYTES = {Q8: 32, Q4: 16, Q5: 20, Q6: 24, Q4I: 16, Q8I: 32, Q5I: 20, Q6I: 24}
#: The interleaved kind of each kind that has one (see :func:`interleave`).
INTERLEAVED = {Q4: Q4I, Q8: Q8I, Q5: Q5I, Q6: Q6I}
#: The interleaved kinds.
INTERLEAVED_KINDS = frozenset(INTERLEAVED.values())
#: Rows interleaved in one group of the interleaved kinds.
INTERLEAVE_ROWS = 16
#: GGUF tensor types stored quantized (the others are dequantized at load).
GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16")


@dataclass
class QuantWeight:
    """A ``[N, K]`` weight matrix (PyTorch ``[out, in]`` orientation) in a kernel layout.

    Attributes:
        kind: ``Q8``, ``Q4``, ``Q5``, ``Q6`` (blocks of 32), ``Q4I``/``Q5I``/``Q6I``/``Q8I``
            (Q4/Q5/Q6/Q8 with 16 rows interleaved, :func:`interleave`) or
            ``F16``/``BF16``.
        shape: ``(N, K)``; ``K`` is a multiple of 32 for the block kinds.
        q: block kinds: uint8 ``[N, K / 32 * QBYTES[kind]]``; ``F16``/``BF16``:
            the ``[N, K]`` float16/bfloat16 matrix.
        d: float16 ``[N, K / 32]`` block scales (``[N, K / 16]`` for Q6, Q6I), or None.
        m: float16 ``[N, K / 32]`` block minimums (Q4, Q5, Q4I, Q5I), or None.
        (The interleaved kinds: the same sizes, bytes in the interleaved order.)
        source: the GGUF type it came from (``"Q4_K"`` ...), for reports.
    """

    kind: int
    shape: tuple[int, int]
    q: torch.Tensor
    d: torch.Tensor | None = None
    m: torch.Tensor | None = None
    source: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes held in memory."""
        return sum(t.numel() * t.element_size() for t in (self.q, self.d, self.m) if t is not None)

    def select_rows(self, index: torch.Tensor) -> "QuantWeight":
        """The matrix made of rows ``index`` (int64 ``[n]``), in that order.

        Raises:
            ValueError: an interleaved matrix (:data:`INTERLEAVED_KINDS`): its rows are not stored whole.
        """
        if self.kind in INTERLEAVED_KINDS:
            raise ValueError(f"rows of an interleaved ({KIND_NAMES[self.kind]}) matrix cannot be selected; "
                             "select before interleave()")

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index).contiguous()

        return QuantWeight(self.kind, (len(index), self.shape[1]), self.q.index_select(0, index).contiguous(), pick(self.d), pick(self.m), self.source)

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Stack matrices of one kind and width along rows.

        Raises:
            ValueError: kinds or widths differ, or the kind is interleaved (:data:`INTERLEAVED_KINDS`).
        """
        first = parts[0]
        if first.kind in INTERLEAVED_KINDS:
            raise ValueError(f"interleaved ({KIND_NAMES[first.kind]}) matrices cannot be stacked; "
                             "stack before interleave()")
        if any(p.kind != first.kind or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one kind and width can be stacked")
        def join(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]  # all None or none (one kind)

        return QuantWeight(first.kind, (sum(p.shape[0] for p in parts), first.shape[1]), torch.cat([p.q for p in parts]),
                           join([p.d for p in parts]), join([p.m for p in parts]), first.source)


def interleave(w: QuantWeight) -> QuantWeight:
    """``w`` (kind ``Q4``, ``Q5``, ``Q6`` or ``Q8``, ``N`` a multiple of
    :data:`INTERLEAVE_ROWS`) with its rows regrouped for the kernel of
    ``interleaved_avx512.h`` (kind ``Q4I``, ``Q5I``, ``Q6I`` or ``Q8I``, same
    values and byte count): rows in groups of 16, each group's blocks in
    order. Block ``b`` of group ``g`` is ``QB`` bytes of values at
    ``(g nb + b) QB`` and 16 scales (and for Q4I, Q5I 16 minimums) at
    ``(g nb + b) 16`` of ``d`` (and ``m``); Q6I's 16 scales of the first
    half block, then 16 of the second, at ``(g nb + b) 32``. Its 64-byte
    vectors hold 4 consecutive values of a
    row per 32-bit lane (lane ``L``: row ``16 g + L``): Q4I (``QB`` 256),
    vector ``c`` holds values ``8 c + e`` in its low nibbles and
    ``8 c + 4 + e`` in its high ones (``e = 0..3``); Q5I (``QB`` 320): the
    low 4 bits of its values so (256 bytes), then one vector whose lane
    holds the row's 4 bytes of high bits as the Q5 kind has them (bit ``t``
    of byte ``e``: bit 4 of value ``4 t + e``); Q6I (``QB`` 384): the low 4
    bits likewise, then two vectors whose lanes hold the row's 8 bytes of
    high bit pairs as the Q6 kind has them, bytes 0-3 then 4-7; Q8I (``QB``
    512), vector ``t`` holds values ``4 t + e`` as signed bytes ``q - 128``.

    Raises:
        ValueError: another kind, or ``N`` not a multiple of 16.
    """
    n, k = w.shape
    if w.kind not in INTERLEAVED or n % INTERLEAVE_ROWS:
        raise ValueError(f"only q4, q5, q6 and q8 matrices with a multiple of {INTERLEAVE_ROWS} rows interleave, got "
                         f"{KIND_NAMES[w.kind]} with {n} rows")
    assert w.d is not None and (w.m is not None or w.kind in (Q6, Q8))  # scales; Q4, Q5 have minimums too
    g, nb = n // INTERLEAVE_ROWS, k // QK
    q = w.q.numpy().reshape(n, nb, QBYTES[w.kind])
    if w.kind == Q8:
        v = q ^ 0x80  # q + 128 -> the signed value's two's complement byte
    else:  # the low 4 bits (Q4's bytes, Q5's first 16): byte j holds values j, j + 16
        v = np.concatenate([q[:, :, :16] & 0x0F, q[:, :, :16] >> 4], axis=2)  # [n, nb, 32]
    v = v.reshape(g, INTERLEAVE_ROWS, nb, 8, 4).transpose(0, 2, 3, 1, 4)  # [g, nb, quad t, lane L, e]
    if w.kind != Q8:
        v = v[:, :, 0::2] | (v[:, :, 1::2] << 4)  # vector c: quads 2c (low nibbles), 2c + 1 (high)
    v = v.reshape(g, nb, -1)
    if w.kind in (Q5, Q6):  # then the high bits, as they are: vectors of each lane's 4 bytes (Q6: bytes 0-3, 4-7)
        nh = 1 if w.kind == Q5 else 2
        high = q[:, :, 16:].reshape(g, INTERLEAVE_ROWS, nb, nh, 4).transpose(0, 2, 3, 1, 4).reshape(g, nb, 64 * nh)
        v = np.concatenate([v, high], axis=2)

    def rows(t: torch.Tensor | None) -> torch.Tensor | None:  # [n, nb * s] -> [g, nb, s, 16], stored as [n, nb * s]
        if t is None:
            return None
        s = t.shape[1] // nb  # scales per block: Q6's two
        return t.reshape(g, INTERLEAVE_ROWS, nb, s).permute(0, 2, 3, 1).contiguous().reshape(n, nb * s)

    return QuantWeight(INTERLEAVED[w.kind], (n, k), torch.from_numpy(np.ascontiguousarray(v).reshape(n, -1)),
                       rows(w.d), rows(w.m), w.source)


def _f16(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a.astype(np.float16)))


def _pack(kind: int, values: np.ndarray, d: np.ndarray, m: np.ndarray | None, n: int, k: int, source: str) -> QuantWeight:
    """Pack unsigned values ``[n * k / 32, 32]`` (0 .. 2^bits - 1) with float
    ``d`` (per block, per half block for Q6) and ``m`` into kind ``kind``."""
    v = values.astype(np.uint8).reshape(-1, QK)
    if kind == Q8:
        qb = v
    else:
        parts = [(v[:, :16] & 0x0F) | (v[:, 16:] << 4)]
        if kind == Q5:  # byte j, bit i: bit 4 of element 4 i + j
            bits = ((v >> 4) & 1).reshape(-1, 8, 4).astype(np.uint8)
            parts.append((bits << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8))
        elif kind == Q6:  # byte j, bits 2k, 2k + 1: bits 4, 5 of element 8 k + j
            pairs = ((v >> 4) & 3).reshape(-1, 4, 8).astype(np.uint8)
            parts.append((pairs << (2 * np.arange(4, dtype=np.uint8))[None, :, None]).sum(axis=1, dtype=np.uint8))
        qb = np.concatenate(parts, axis=1)
    q = torch.from_numpy(np.ascontiguousarray(qb.reshape(n, -1)))
    return QuantWeight(kind, (n, k), q, _f16(d.reshape(n, -1)), None if m is None else _f16(m.reshape(n, -1)), source)


def _split(blocks: np.ndarray, *sizes: int) -> list[np.ndarray]:
    return np.split(blocks, np.cumsum(sizes)[:-1], axis=1)


#: Elements repacked at a time: the numpy temporaries of one slice of rows
#: (up to ~8 bytes per element) stay near 32 MiB whatever the matrix size.
REPACK_CHUNK_ELEMENTS = 1 << 22


def gguf_blocks(data: np.ndarray, type_name: str, n: int, k: int) -> tuple[np.ndarray, int]:
    """The bytes of a GGUF block-type matrix of ``n`` rows and ``k`` columns
    as a flat uint8 array, and its block size in bytes (``gguf``'s
    ``GGML_QUANT_SIZES``), checked against the shape.

    Raises:
        ValueError: a width that is not a multiple of the block, or data of
            the wrong size.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if k % block:
        raise ValueError(f"a {type_name} matrix needs a width divisible by {block}, got {k}")
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1)
    if raw.size != n * k // block * size:
        raise ValueError(f"{type_name} data of {raw.size} bytes does not hold a [{n}, {k}] matrix")
    return raw, size


def from_gguf(data: np.ndarray, type_name: str, n: int, k: int, chunk_elements: int = REPACK_CHUNK_ELEMENTS) -> QuantWeight:
    """Repack the raw bytes of a GGUF matrix of ``n`` rows and ``k`` columns.

    A matrix of more than ``chunk_elements`` weights is repacked a slice of
    rows at a time into preallocated tensors, so the transient memory does
    not grow with the matrix: a 151936 x 896 Q5_0 embedding (Qwen2.5-0.5B)
    otherwise held 1.1 GiB of temporaries to produce 100 MiB.

    Args:
        data: the tensor's bytes (``gguf.ReaderTensor.data``: uint8, any shape
            of the right size; float16 for F16, uint16/bfloat16 bytes for BF16).
        type_name: GGUF type name, one of :data:`GGUF_TYPES`.
        n, k: rows (outputs) and columns (inputs).
        chunk_elements: weights repacked at a time (at least one row).

    Raises:
        ValueError: an unsupported type, or a size that does not match.
    """
    if type_name in ("F16", "BF16"):
        halves = np.ascontiguousarray(data).view(np.uint16).reshape(n, k)
        t = torch.from_numpy(halves.copy()).view(torch.float16 if type_name == "F16" else torch.bfloat16)
        return QuantWeight(F16 if type_name == "F16" else BF16, (n, k), t, source=type_name)
    if type_name not in GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} has no quantized kernel")
    raw, size = gguf_blocks(data, type_name, n, k)
    b = raw.reshape(n, -1)  # whole blocks per row
    rows = max(1, chunk_elements // k)
    if n <= rows:
        return _repack(b.reshape(-1, size), type_name, n, k)
    out: QuantWeight | None = None
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        part = _repack(b[r0:r1].reshape(-1, size), type_name, r1 - r0, k)
        if out is None:
            def empty(t: torch.Tensor | None) -> torch.Tensor | None:
                return None if t is None else torch.empty((n, t.shape[1]), dtype=t.dtype)

            out = QuantWeight(part.kind, (n, k), torch.empty((n, part.q.shape[1]), dtype=part.q.dtype), empty(part.d), empty(part.m), part.source)
        for dst, src in ((out.q, part.q), (out.d, part.d), (out.m, part.m)):
            if dst is not None and src is not None:  # the same parts are None in both
                dst[r0:r1] = src
    assert out is not None
    return out


def _repack(b: np.ndarray, type_name: str, n: int, k: int) -> QuantWeight:
    """Repack GGUF blocks ``b`` (uint8 ``[n * k / block, block bytes]``) of a block type."""
    import gguf.quants as gq

    def f16(a: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
        return a.view(np.float16).astype(np.float32)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # [nb, 16] -> [nb, 32] elements j, j + 16
        return np.concatenate([qs & 0x0F, qs >> 4], axis=1)

    def high32(qh: np.ndarray) -> np.ndarray:  # little-endian uint32 -> bit 4 of each of 32 elements
        bits = np.ascontiguousarray(qh).view(np.uint32)
        return ((bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4

    if type_name == "Q8_0":
        d, qs = _split(b, 2, 32)
        return _pack(Q8, qs ^ 0x80, f16(d), None, n, k, type_name)
    if type_name == "Q4_0":
        d, qs = _split(b, 2, 16)
        return _pack(Q4, nibbles(qs), f16(d), -8 * f16(d), n, k, type_name)
    if type_name == "Q4_1":
        d, m, qs = _split(b, 2, 2, 16)
        return _pack(Q4, nibbles(qs), f16(d), f16(m), n, k, type_name)
    if type_name == "Q5_0":
        d, qh, qs = _split(b, 2, 4, 16)
        return _pack(Q5, nibbles(qs) | high32(qh), f16(d), -16 * f16(d), n, k, type_name)
    if type_name == "Q5_1":
        d, m, qh, qs = _split(b, 2, 2, 4, 16)
        return _pack(Q5, nibbles(qs) | high32(qh), f16(d), f16(m), n, k, type_name)
    if type_name in ("Q4_K", "Q5_K"):
        if type_name == "Q4_K":
            d, dmin, scales, qs = _split(b, 2, 2, 12, 128)
        else:
            d, dmin, scales, qh, qs = _split(b, 2, 2, 12, 32, 128)
        sc, mn = gq.Q4_K.get_scale_min(scales)  # [nb, 8] 6-bit sub-block scales and minimums
        # 4 chunks of 32 bytes: low nibbles are sub-block 2 j, high nibbles 2 j + 1
        q = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F
        q = q.reshape(-1, 8, 32)
        if type_name == "Q5_K":  # bit i of qh[l] is bit 4 of element l of sub-block i
            q = q | (((qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1) << 4)
        return _pack(Q4 if type_name == "Q4_K" else Q5, q, f16(d) * sc, -f16(dmin) * mn, n, k, type_name)
    # Q6_K
    ql, qh, scales, d = _split(b, 128, 64, 16, 2)
    low = ((ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F).reshape(-1, 8, 32)
    high = ((qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3).reshape(-1, 8, 32)
    return _pack(Q6, low | (high << 4), f16(d) * scales.view(np.int8).astype(np.float32), None, n, k, type_name)


#: ``--quantize`` choices for float weights, and the GGUF format each produces.
QUANTIZE_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}


def quantize(w: torch.Tensor, name: str) -> QuantWeight:
    """Quantize a float ``[N, K]`` matrix with ``gguf.quants.quantize`` (the
    reference quantizers of llama.cpp, round to nearest) and repack it.

    Args:
        w: float weight, ``K`` a multiple of 32.
        name: one of :data:`QUANTIZE_TYPES`.

    Raises:
        ValueError: an unknown name or a width that is not a multiple of 32.
    """
    import gguf.quants as gq
    from gguf.constants import GGMLQuantizationType

    if name not in QUANTIZE_TYPES:
        raise ValueError(f"unknown quantization {name!r} (choose from {', '.join(QUANTIZE_TYPES)})")
    n, k = w.shape
    if k % QK:
        raise ValueError(f"cannot quantize a [{n}, {k}] matrix: width is not a multiple of {QK}")
    type_name = QUANTIZE_TYPES[name]
    raw = gq.quantize(w.detach().to(torch.float32).numpy(), GGMLQuantizationType[type_name])
    return from_gguf(raw, type_name, n, k)
