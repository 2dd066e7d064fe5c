"""Chunk-level selection for the KV eviction policies
(:mod:`tartlet.kv_eviction`: H2O, SnapKV and TOVA take ``chunk``).

ChunkKV (Liu et al., 2025, "ChunkKV: Semantic-Preserving KV Cache
Compression for Efficient Long-Context LLM Inference", arXiv:2502.00299)
keeps or drops runs of contiguous tokens instead of single tokens: a
phrase or sentence the answer needs survives whole instead of losing
scattered tokens to its neighbours' scores. Here the chunks are fixed
spans of ``chunk`` context positions aligned to position 0: chunk ``c`` is
positions ``[c * chunk, (c + 1) * chunk)``. With ``chunk`` equal to the
context's page size a chunk is exactly a page, so each chunk evicted whole
releases its page (:meth:`Context.drop_masked_pages`; the partly filled
last page excepted); a divisor or multiple of the page size keeps the same
alignment. ``chunk=1`` is token-level selection, unchanged.

Score of a chunk: the **sum** of the policy's per-token scores of its
tokens that are still kept, the protected ones included (attention sinks,
H2O's recent window, SnapKV's observation window; a position without a
score, such as SnapKV's window, counts 0), as ChunkKV sums its tokens'
scores. A sum rather than a mean: a chunk that lost tokens already ranks
lower, so the policy finishes the chunk it started (and frees its page)
before it opens holes elsewhere.

Budget: still in tokens, exactly as at ``chunk=1``. To evict ``n`` tokens
the chunks are taken lowest score first (ties: the earlier chunk), each
with all its evictable tokens (kept and not protected), while they fit in
``n``; the first chunk that does not fit gives its ``n - taken``
lowest-scored evictable tokens (ties: earlier first) and is left partly
kept. So at most one chunk is partly evicted per eviction, and the kept
count equals the budget between passes; a decode step over budget by one
token takes one token of the lowest chunk, which (its sum now lower) tends
to be the lowest again at the next step until it is gone.
"""

from __future__ import annotations

from collections.abc import Sequence


def lowest_chunks(score: Sequence[float], kept: Sequence[int], candidates: Sequence[int], n: int,
                  chunk: int) -> list[int]:
    """The ``n`` positions (fewer if there are fewer ``candidates``) to
    evict under chunk-level selection (module docstring).

    Args:
        score: per context position, its token score (floats; positions at
            or past ``len(score)`` count 0); lower is evicted first.
        kept: per context position, nonzero when the position is kept
            (``len(kept)`` is the context length).
        candidates: the evictable positions (kept, not protected), any order.
        n: how many to evict (<= 0: none).
        chunk: positions per chunk, >= 1; 1 ranks single tokens (ties:
            earlier first), the token-level selection.

    Returns:
        The positions to evict, ascending.
    """
    if n <= 0 or not candidates:
        return []
    key = lambda j: (score[j] if j < len(score) else 0.0, j)  # noqa: E731
    if chunk <= 1:
        return sorted(sorted(candidates, key=key)[:n])
    groups: dict[int, list[int]] = {}
    for j in candidates:
        groups.setdefault(j // chunk, []).append(j)
    sums = {}
    for c in groups:
        lo, hi = c * chunk, min(len(kept), (c + 1) * chunk)
        sums[c] = sum(score[j] for j in range(lo, min(hi, len(score))) if kept[j])
    out: list[int] = []
    for c in sorted(groups, key=lambda c: (sums[c], c)):
        room = n - len(out)
        if room <= 0:
            break
        members = groups[c]
        out += members if len(members) <= room else sorted(members, key=key)[:room]
    return sorted(out)

