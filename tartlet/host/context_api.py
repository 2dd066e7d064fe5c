"""Context host calls (WIT interface ``context``): create, fork, free,
truncate, mask and inspect an instance's contexts, and the per-instance
tables and page accounting the other host-call mixins build on
(:class:`ContextHostMixin`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from ..engine.core.engine import Engine
from ..engine.core.kv_accounting import PageAccount
from ..engine.core.sequence import Sequence
from ..sdk.errors import InvalidHandleError, KvCacheFullError, LimitError
from .fair_gate import FairGate
from .state import HostState, ModelSlot

T = TypeVar("T")


class HostContext:
    """Host-side record of one inferlet context."""

    def __init__(self, slot: ModelSlot, seq: Sequence, tokens: list[int]) -> None:
        self.slot = slot
        self.seq = seq
        self.tokens = tokens  # as submitted
        self.lock = threading.Lock()

    @property
    def engine(self) -> Engine:
        return self.slot.engine


class ContextHostMixin:
    """An instance's contexts: the handle table, its page accounts, and the
    ``context-*`` calls. :class:`~tartlet.host.api.HostApi` sets the
    attributes below in its ``__init__``."""

    state: HostState
    owner: str
    instance_id: str
    max_pages: int | None
    closed: bool
    _contexts: dict[int, HostContext]
    _accounts: dict[int, PageAccount]
    _ids: Iterator[int]

    if TYPE_CHECKING:
        def _rate(self, kind: str) -> None: ...  # IoHostMixin's

    def _ctx(self, handle: int) -> HostContext:
        c = self._contexts.get(handle)
        if c is None:
            raise InvalidHandleError(f"no context with handle {handle!r} (destroyed, or never created)")
        return c

    def _add(self, ctx: HostContext) -> int:
        h = next(self._ids)
        self._contexts[h] = ctx
        return h

    def _account(self, slot: ModelSlot) -> PageAccount:
        """This instance's page account on ``slot``'s model (made on first use)."""
        acc = self._accounts.get(id(slot))
        if acc is None:
            acc = slot.accounts.instance(self.owner, self.instance_id, self.max_pages)
            self._accounts[id(slot)] = acc
        return acc

    def _new_seq(self, slot: ModelSlot) -> Sequence:
        """An empty sequence on ``slot``'s pool, charged to this instance.

        Raises:
            LimitError: the instance has ``max_contexts_per_instance`` contexts open.
        """
        cap = slot.accounts.limits.max_contexts_per_instance
        if cap is not None and len(self._contexts) >= cap:
            raise LimitError(
                f"the instance has {len(self._contexts)} contexts open, the limit "
                "(limits.max_contexts_per_instance): free some first"
            )
        return Sequence(slot.engine.pool, self._account(slot))

    def context_new(self, model: str | None) -> int:
        """An empty context on ``model``; returns its handle.

        Raises:
            LimitError: too many open contexts.
        """
        slot = self.state.model(model)
        return self._add(HostContext(slot, self._new_seq(slot), []))

    def context_fork(self, handle: int) -> int:
        """A copy of a context sharing its full pages (copy-on-write); the
        copy happens after the parent's queued forward passes.

        Raises:
            KvQuotaError: the copied tail page would pass a page quota.
            LimitError: too many open contexts, or the user goes past
                ``[limits] max_allocs_per_s`` (a rate).
        """
        self._rate("alloc")
        parent = self._ctx(handle)
        seq = self._new_seq(parent.slot)
        fresh = 1 if len(parent.tokens) % parent.engine.pool.page_size else 0  # the copied tail page
        child = HostContext(parent.slot, seq, list(parent.tokens))
        _pending(seq.account, fresh, lambda: self._fork_later(parent.slot.gate, parent.seq, child.seq))
        return self._add(child)

    def _fork_later(self, gate: FairGate, src: Sequence, dst: Sequence) -> Future[None]:
        def run() -> None:
            if src.freed:
                dst.free(src.error or "forked from a destroyed context")
                return
            try:
                src.fork_into(dst)
            except KvCacheFullError as e:
                dst.free(f"fork failed: {e}")
                raise

        return gate.command(run, src, dst)

    def context_free(self, handle: int) -> None:
        """Destroy a context and release its pages (after its queued passes)."""
        ctx = self._contexts.pop(handle, None)
        if ctx is None:
            raise InvalidHandleError(f"no context with handle {handle!r}")
        self._free_later(ctx)

    def _free_later(self, ctx: HostContext) -> None:
        seq = ctx.seq
        try:
            ctx.slot.gate.command(seq.free, seq)
        except RuntimeError:  # scheduler stopped: nothing runs any more
            seq.free()

    def context_tokens(self, handle: int) -> list[int]:
        """Token ids of the context, as submitted so far."""
        return list(self._ctx(handle).tokens)

    def context_len(self, handle: int) -> int:
        return len(self._ctx(handle).tokens)

    def context_truncate(self, handle: int, n: int) -> None:
        """Keep the first ``n`` tokens.

        Raises:
            ValueError: ``n`` outside ``[0, len]``.
        """
        ctx = self._ctx(handle)
        with ctx.lock:
            if not isinstance(n, int) or not 0 <= n <= len(ctx.tokens):
                raise ValueError(f"truncate to {n!r} outside [0, {len(ctx.tokens)}]")
            del ctx.tokens[n:]
        ctx.slot.gate.command(lambda: ctx.seq.truncate(min(n, len(ctx.seq))), ctx.seq)

    def context_mask(self, handle: int, start: int, end: int, masked: bool) -> None:
        """Hide (``masked=True``) or show tokens ``[start, end)`` from all
        later forward passes.

        Raises:
            ValueError: the range is empty-reversed or outside the context.
        """
        ctx = self._ctx(handle)
        n = len(ctx.tokens)
        if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end <= n):
            raise ValueError(f"mask range [{start!r}, {end!r}) outside the context's [0, {n})")
        ctx.slot.gate.command(lambda: ctx.seq.mask_range(start, end, bool(masked)), ctx.seq)

    def context_drop_masked_pages(self, handle: int) -> Future[int]:
        """Release full pages whose tokens are all masked; future of the
        number of pages dropped."""
        ctx = self._ctx(handle)
        return ctx.slot.gate.command(ctx.seq.drop_masked_pages, ctx.seq)

    def context_stats(self, handle: int) -> Future[dict[str, int]]:
        """Future of ``{"tokens", "pages", "live_pages", "shared_pages"}``
        of a context, after its queued passes (``shared_pages``: pages also
        referenced by another context or snapshot)."""
        ctx = self._ctx(handle)
        seq = ctx.seq

        def stats() -> dict[str, int]:
            live = [p for p in seq.pages if p is not None]
            return {
                "tokens": len(seq),
                "pages": len(seq.pages),
                "live_pages": len(live),
                "shared_pages": sum(1 for p in live if seq.pool.refcount(p) > 1),
            }

        return ctx.slot.gate.command(stats, seq)


def _pending(acc: PageAccount | None, fresh: int, queue: Callable[[], Future[T]]) -> Future[T]:
    """Pre-check ``fresh`` new pages against ``acc`` (counting calls still
    queued), then call ``queue()`` and count the pages as pending until its
    future is done.

    Raises:
        KvQuotaError: the pages would pass a quota; nothing is queued.
    """
    if acc is None or not fresh:
        return queue()
    acc.precheck(fresh)
    acc.pend(fresh)
    try:
        fut = queue()
    except BaseException:
        acc.pend(-fresh)
        raise
    fut.add_done_callback(lambda _: acc.pend(-fresh))
    return fut


