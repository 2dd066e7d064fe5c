"""Admission: whether a request's first pass may run at all, checked before
any compute (so a prompt that can never fit fails at once instead of after
prefilling, and evicting, the pool's worth of tokens)."""

from __future__ import annotations

from ...sdk.errors import ContextLengthError, KvCacheFullError
from .kv_cache import PagePool
from .sequence import Sequence


def admission_error(seq: Sequence, n: int, pool: PagePool, max_seq_len: int,
                    max_batch_tokens: int) -> ContextLengthError | KvCacheFullError | None:
    """The error for appending ``n`` tokens to ``seq`` (``ContextLengthError``
    past ``max_seq_len`` tokens, ``KvCacheFullError`` per :func:`never_fits`),
    or ``None`` when the pass may be scheduled."""
    if len(seq) + n > max_seq_len:
        return ContextLengthError(f"context would hold {len(seq) + n} tokens, more than the model's {max_seq_len}")
    return never_fits(seq, n, pool, max_batch_tokens)


def never_fits(seq: Sequence, n: int, pool: PagePool, max_batch_tokens: int) -> KvCacheFullError | None:
    """The error for appending ``n`` tokens to ``seq`` when the result
    would need more live pages than the whole pool has (so it could never
    run, even with every other sequence gone), else ``None``. Checked
    before any compute, so such a prompt fails at once instead of after
    prefilling (and evicting) the pool's worth of tokens. With a window
    on every layer (``PagePool.window``) a sequence holds at most the
    pages of one chunk and the ``W - 1`` tokens before it."""
    ps = pool.page_size
    end = len(seq) + n
    if max(len(seq.pages), -(-end // ps)) <= pool.num_pages:  # a bound of `need` below: most calls stop here
        return None
    need = seq.live_pages() + max(0, -(-end // ps) - len(seq.pages))
    w = pool.window
    if w is not None:
        need = min(need, -(-(w - 1 + min(n, max_batch_tokens)) // ps) + 1)
    if need <= pool.num_pages:
        return None
    return KvCacheFullError(
        f"KV cache too small: the context would hold {end} tokens in {need} page(s) of {ps} tokens, "
        f"but the whole pool has {pool.num_pages} pages ({pool.num_pages * ps} tokens)"
    )
