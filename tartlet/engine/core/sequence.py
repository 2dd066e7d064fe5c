"""A sequence: one context's tokens and the page table of their KV.

Logical token ``i`` of a sequence lives in page table entry ``i // page_size``
at slot ``i % page_size``. Entries are page ids of the :class:`PagePool`, or
``None`` for a dropped page: released by :meth:`Sequence.drop_masked_pages`
(its tokens are masked) or by :meth:`Sequence.drop_out_of_window` (its tokens
lie before the sliding window of every later query). Either way its tokens
stay in ``tokens`` but no longer take part in attention. All full pages are
immutable; only the last, partly filled page is written, and it is made
private (copy-on-write) before a write.

Sliding windows. When every layer of the model slides with window ``W``
(``PagePool.window``, set by the scheduler from
:meth:`ModelConfig.uniform_window`), :meth:`Sequence.reserve` first releases
the pages wholly before the window of the first token it appends, the way
vLLM's sliding-window KV manager frees blocks before the window of the
computed tokens: a query at token index ``i`` sees indexes ``> i - W``, so
with ``n`` tokens in the cache, tokens ``<= n - W`` are never read again by
appended tokens. A released page is only unreferenced by this sequence
(forks, snapshots and the prefix cache keep their own references; a
committed page stays in the prefix cache until evicted). The page table
keeps ``None`` there and the prefix keys stay, so later full pages are still
registered and prefix-matched: a page's KV depends on its token prefix only,
not on which earlier pages are still held, and a prefix match walks pages
from the first, so it can never hand out a prefix whose early pages are
gone. The one edit that could need released KV again is cutting the
sequence back: :meth:`truncate` hides (masks) any released token that the
next query's window would reach, so attention never reads a reused page,
and the sequence stops being pure (its later pages are not registered).
The engine's own cut-backs (a generator re-running its last token,
rejected speculative drafts, a failed one-chunk request rolled back) stay
within what was never released; a long prefill that fails after some of its
chunks ran is rolled back with its released tokens hidden.

LoRA adapters. Tokens computed with an adapter have other KV than the base
model's, so the sequence records which adapter computed each token
(:attr:`Sequence.adapter_runs`, runs of tokens: nothing kept while every
token is the base model's) and a page's prefix-cache key includes the
adapters of its tokens (:meth:`Sequence.page_adapters`): pages are shared
only between sequences whose tokens and adapters agree.

Sequences are owned by the scheduler thread: their methods are called with no
forward pass of the same sequence in flight.

Accounting. A sequence may be charged to a :class:`PageAccount` (its
instance's, or its owner's snapshot account): every page entering or leaving
its page table is held or released there, and every step that takes pages
(reserve, fork, prefix attach) checks the account's quota first, raising
:class:`KvQuotaError` with nothing changed.
"""

from __future__ import annotations

from .kv_accounting import PageAccount
from .kv_cache import EMPTY_KEY, PagePool, page_key


class Sequence:
    """Tokens, positions and page table of one context.

    Attributes:
        tokens: token ids in the KV cache, in logical order.
        positions: RoPE position of each token (``positions[i] == i`` unless
            the inferlet chose explicit positions).
        pages: page table; ``pages[j]`` holds tokens ``[j*ps, (j+1)*ps)``.
        masked: per token, ``1`` when hidden from attention by
            :meth:`mask_range`.
        pure: every token so far was computed the default way (causal, no
            masks, positions == indexes); only then are full pages registered
            in the prefix cache.
        keys: content key of each full page while the sequence is pure.
        account: the :class:`PageAccount` charged with this sequence's pages
            (None: not accounted).
        window_dropped: leading page table entries released by
            :meth:`drop_out_of_window` (all ``None``; entries after it may be
            ``None`` too, e.g. after a snapshot is read back).
        adapter_runs: ``(first token index, adapter key)`` of each run of
            tokens computed with one LoRA adapter (key ``b""``: the base
            model), in order; empty while every token is the base model's.
    """

    def __init__(self, pool: PagePool, account: PageAccount | None = None) -> None:
        self.pool = pool
        self.account = account
        self.tokens: list[int] = []
        self.positions: list[int] = []
        self.pages: list[int | None] = []
        self.masked = bytearray()
        self.pure = True
        self.keys: list[bytes] = []
        self.freed = False
        self.window_dropped = 0
        self.adapter_runs: list[tuple[int, bytes]] = []
        #: why the sequence is unusable (set with ``freed`` when a fork into it failed)
        self.error: str | None = None

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def adapted(self) -> bool:
        """Whether some token was computed with a LoRA adapter."""
        return any(key for _, key in self.adapter_runs)

    def _tag(self, start: int, adapter: bytes) -> None:
        """Record that tokens from index ``start`` on are computed with
        ``adapter`` (``b""``: the base model)."""
        current = self.adapter_runs[-1][1] if self.adapter_runs else b""
        if adapter != current:
            self.adapter_runs.append((start, adapter))

    def page_adapters(self, j: int) -> bytes:
        """The adapters of page ``j``'s tokens, as :func:`page_key` takes
        them: ``b""`` when the base model computed them all, else each run
        within the page as its offset (2 bytes, little-endian) and key."""
        runs = self.adapter_runs
        if not runs:
            return b""
        if runs[0][0] > 0:
            runs = [(0, b"")] + runs  # the base model's tokens before the first run
        ps = self.page_size
        lo, hi = j * ps, (j + 1) * ps
        out = []
        for k, (start, key) in enumerate(runs):
            end = runs[k + 1][0] if k + 1 < len(runs) else hi
            if end > lo and start < hi:
                out.append((max(start, lo) - lo, key))
        if all(not key for _, key in out):
            return b""
        return b"".join(off.to_bytes(2, "little") + key for off, key in out)

    def live_pages(self) -> int:
        """Page table entries that still hold KV (not dropped)."""
        return sum(1 for p in self.pages if p is not None)

    # -- growth -------------------------------------------------------------
    def match_prefix(self, tokens: list[int], limit: int, adapter: bytes = b"") -> int:
        """Attach committed pages from the prefix cache for a leading run of
        ``tokens`` that is about to be appended, so they need no compute.

        Only whole pages are matched, only while this sequence is pure and
        page-aligned, and never more than ``limit`` tokens; ``adapter`` is
        the key of the LoRA adapter the tokens are to be computed with
        (``b""``: the base model), and only pages computed with it match.
        Returns the number of tokens attached (their KV is already in the cache).
        """
        ps = self.page_size
        if not self.pure or len(self.tokens) % ps:
            return 0
        n = 0
        prev = self.keys[-1] if self.keys else EMPTY_KEY
        tag = b"\x00\x00" + adapter if adapter else b""  # page_adapters() of a page computed with it alone
        while n + ps <= min(limit, len(tokens)):
            block = tokens[n : n + ps]
            key = page_key(prev, block, tag)
            page = self.pool.lookup(key)
            if page is None:
                break
            if self.account is not None:
                if self.account.room() == 0 and not self.account.holds(page):
                    self.pool.release(page)  # over quota: compute it instead (reserve then reports the quota)
                    break
                self.account.hold(page)
            start = len(self.tokens)
            self._tag(start, adapter)
            self.tokens.extend(block)
            self.positions.extend(range(start, start + ps))
            self.masked.extend(bytes(ps))
            self.pages.append(page)
            self.keys.append(key)
            prev = key
            n += ps
        return n

    def reserve(self, tokens: list[int], positions: list[int], custom_attention: bool, adapter: bytes = b"") -> list[int]:
        """Append ``tokens`` (with their RoPE ``positions``) and return the KV
        slot (pool row) each one is written to. Allocates pages as needed and
        makes the partly filled last page private first. ``adapter``: the
        key of the LoRA adapter that computes them (``b""``: the base model).

        When every layer slides (``PagePool.window``), the pages wholly before
        the window of token ``len(self)`` are released first
        (:meth:`drop_out_of_window`); they stay released if this raises.

        Raises:
            KvCacheFullError: the pool cannot supply the pages; the sequence
                is left unchanged (but for the released pages).
            KvQuotaError: the account cannot take the pages; likewise.
        """
        ps = self.page_size
        n0 = len(self.tokens)
        if self.pool.window is not None:
            self.drop_out_of_window(n0)
        n1 = n0 + len(tokens)
        need = -(-n1 // ps) - len(self.pages)
        tail_copy = n0 % ps != 0 and not self._tail_private()
        acc = self.account
        if acc is not None and (need > 0 or tail_copy):  # most decode steps take no page
            acc.check(fresh=max(0, need) + int(tail_copy))
        with self.pool.lock:
            self.pool.ensure_available(need + int(tail_copy))
            if n0 % ps:
                tail = self.pages[-1]
                # A dropped tail (truncated into a dropped page) gets a fresh
                # page; its old tokens stay masked, so their slots are unused.
                new_tail = self.pool.allocate(1)[0] if tail is None else self.pool.make_private(tail, n0 % ps)
                if new_tail != tail and acc is not None:
                    if tail is not None:
                        acc.release(tail)
                    acc.hold(new_tail)
                self.pages[-1] = new_tail
            if need > 0:
                fresh = self.pool.allocate(need)
                if acc is not None:
                    for p in fresh:
                        acc.hold(p)
                self.pages.extend(fresh)
        if self.pure and (custom_attention or positions != list(range(n0, n1))):
            self.pure = False
        self._tag(n0, adapter)
        self.tokens.extend(tokens)
        self.positions.extend(positions)
        self.masked.extend(bytes(len(tokens)))
        return [self.pages[i // ps] * ps + i % ps for i in range(n0, n1)]  # type: ignore[operator]  # the chunk's pages are live

    def _tail_private(self) -> bool:
        p = self.pages[-1]
        return p is not None and self.pool.is_private(p)

    def commit_full_pages(self, end: int | None = None) -> None:
        """Register pages that became full (after a forward pass wrote them)
        in the prefix cache, adopting an identical page if one exists.
        ``end``: only pages within the first ``end`` tokens (those written;
        None: all), as a later pass may be reserved already."""
        if not self.pure:
            return
        ps = self.page_size
        full = (len(self.tokens) if end is None else min(end, len(self.tokens))) // ps
        while len(self.keys) < full:
            j = len(self.keys)
            prev = self.keys[-1] if self.keys else EMPTY_KEY
            key = page_key(prev, self.tokens[j * ps : (j + 1) * ps], self.page_adapters(j))
            old = self.pages[j]
            if old is None:  # released as out of the window (a snapshot read back): key it, nothing to commit
                self.keys.append(key)
                continue
            new = self.pool.commit(old, key)
            if new != old and self.account is not None:
                self.account.release(old)
                self.account.hold(new)
            self.pages[j] = new
            self.keys.append(key)

    # -- edits --------------------------------------------------------------
    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens; later pages are released. The new
        last page, if partly filled, is made private on the next write.

        With a sliding window (``PagePool.window``), tokens in released pages
        that the window of the next token (index ``n``) would reach are
        masked, and the sequence is no longer pure: their KV is gone, so
        attention skips them rather than read a page that now holds
        something else (see the module docstring).

        Raises:
            ValueError: ``n`` outside ``[0, len(self)]``.
        """
        if not 0 <= n <= len(self.tokens):
            raise ValueError(f"truncate to {n} outside [0, {len(self.tokens)}]")
        ps = self.page_size
        keep = -(-n // ps)
        for p in self.pages[keep:]:
            if p is not None:
                self._drop(p)
        del self.pages[keep:]
        del self.tokens[n:], self.positions[n:], self.masked[n:]
        del self.keys[n // ps :]
        while self.adapter_runs and self.adapter_runs[-1][0] >= n:
            self.adapter_runs.pop()
        self.window_dropped = min(self.window_dropped, n // ps)
        w = self.pool.window
        if w is not None:
            for j in range(max(0, n - w + 1) // ps, keep):
                lo, hi = max(j * ps, n - w + 1), min((j + 1) * ps, n)
                if self.pages[j] is None and self.masked.find(0, lo, hi) != -1:
                    self.masked[lo:hi] = b"\x01" * (hi - lo)
                    self.pure = False

    def mask_range(self, start: int, end: int, masked: bool) -> None:
        """Hide (or show again) tokens ``[start, end)`` from attention of all
        later forward passes."""
        if not 0 <= start <= end <= len(self.tokens):
            raise ValueError(f"mask range [{start}, {end}) outside [0, {len(self.tokens)}]")
        self.masked[start:end] = (b"\x01" if masked else b"\x00") * (end - start)
        if masked and end > start:
            self.pure = False

    def drop_masked_pages(self) -> int:
        """Release every full page whose tokens are all masked; returns how
        many pages were dropped. The partly filled last page is kept."""
        ps = self.page_size
        dropped = 0
        for j in range(len(self.tokens) // ps):
            p = self.pages[j]
            if p is not None and all(self.masked[j * ps : (j + 1) * ps]):
                self._drop(p)
                self.pages[j] = None
                dropped += 1
        return dropped

    def drop_out_of_window(self, end: int) -> int:
        """Release the pages wholly before the sliding window of a query at
        token index ``end``: page ``j`` when ``(j + 1) * page_size <= end -
        W + 1``, ``W`` = ``PagePool.window`` (tokens ``<= end - W`` are outside
        every later query's window). Only this sequence's reference goes
        (the pool keeps a page others hold, and a committed page stays in
        the prefix cache); its account is released too. No-op without a
        window. Returns how many pages were released. Called by
        :meth:`reserve` with ``end = len(self)``."""
        w = self.pool.window
        if w is None:
            return 0
        ps = self.page_size
        dead = min(max(0, end - w + 1) // ps, len(self.pages))
        dropped = 0
        for j in range(self.window_dropped, dead):
            p = self.pages[j]
            if p is not None:
                self._drop(p)
                self.pages[j] = None
                dropped += 1
        self.window_dropped = max(self.window_dropped, dead)
        return dropped

    def _drop(self, page: int) -> None:
        self.pool.release(page)
        if self.account is not None:
            self.account.release(page)

    def fork(self) -> "Sequence":
        """A new sequence with the same tokens, charged to the same account:
        full pages are shared (refcount + 1), the partly filled last page is
        copied.

        Raises:
            KvCacheFullError: no page is available for the copy.
            KvQuotaError: the account cannot take the pages.
        """
        child = Sequence(self.pool, self.account)
        self.fork_into(child)
        return child

    def fork_into(self, child: "Sequence") -> None:
        """Make the empty sequence ``child`` a fork of this one (see
        :meth:`fork`). Used when the child's handle must exist before the
        fork runs on the scheduler thread.

        Raises:
            KvCacheFullError: no page is available for the copy; ``child`` is
                left empty.
            KvQuotaError: ``child``'s account cannot take the pages; ``child``
                is left empty.
        """
        assert not child.tokens and not child.pages, "fork_into needs an empty sequence"
        ps = self.page_size
        n = len(self.tokens)
        last = len(self.pages) - 1
        with self.pool.lock:
            copy_tail = bool(n % ps) and self.pages[last] is not None
            if child.account is not None:
                shared = self.pages[:last] if copy_tail else self.pages
                child.account.check((p for p in shared if p is not None), fresh=int(copy_tail))
            self.pool.ensure_available(int(copy_tail))
            for j, p in enumerate(self.pages):
                if p is None:
                    child.pages.append(None)
                elif copy_tail and j == last:
                    (copy,) = self.pool.allocate(1)
                    self.pool.copy_tokens(p, copy, n % ps)
                    child.pages.append(copy)
                else:
                    self.pool.retain(p)
                    child.pages.append(p)
            if child.account is not None:
                for p in child.pages:
                    if p is not None:
                        child.account.hold(p)
        child.tokens = list(self.tokens)
        child.positions = list(self.positions)
        child.masked = bytearray(self.masked)
        child.pure = self.pure
        child.keys = list(self.keys)
        child.window_dropped = self.window_dropped
        child.adapter_runs = list(self.adapter_runs)

    def free(self, error: str | None = None) -> None:
        """Release every page. Idempotent. ``error`` records why, for later
        requests that still name this sequence."""
        if error and not self.error:
            self.error = error
        if self.freed:
            return
        for p in self.pages:
            if p is not None:
                self._drop(p)
        self.pages.clear()
        self.freed = True

    def transfer_into(self, child: "Sequence") -> None:
        """Hand every page, token and flag of this sequence to the empty
        sequence ``child`` (charged to ``child.account``) without copying;
        this sequence ends empty and freed. Used when an instance takes a
        snapshot over.

        Raises:
            KvQuotaError: ``child``'s account cannot take the pages; nothing
                changes.
        """
        assert not child.tokens and not child.pages, "transfer_into needs an empty sequence"
        live = [p for p in self.pages if p is not None]
        if child.account is not None:
            child.account.check(live)
        for p in live:
            if self.account is not None:
                self.account.release(p)
            if child.account is not None:
                child.account.hold(p)
        child.tokens, child.positions, child.pages = self.tokens, self.positions, self.pages
        child.masked, child.pure, child.keys = self.masked, self.pure, self.keys
        child.window_dropped = self.window_dropped
        child.adapter_runs, self.adapter_runs = self.adapter_runs, []
        self.tokens, self.positions, self.pages, self.masked, self.keys = [], [], [], bytearray(), []
        self.freed = True
        self.error = "its pages were handed to another context"
