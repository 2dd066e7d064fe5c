"""KV page accounting: which pages each instance and user holds, and quotas.

A :class:`PageAccount` counts the *distinct* pages referenced by the
sequences charged to it (a page shared by ten forks of one instance counts
once; a page shared by two users counts for each, since either keeps it out
of the free list). Accounts nest: an instance's account has its user's
account as parent, and so does the user's snapshot account, so one
allocation is checked against every level (instance, snapshots, user) and a
page enters a parent when the first child starts holding it.

:class:`tartlet.engine.core.sequence.Sequence` calls :meth:`PageAccount.check`
before it takes pages (forward, fork, prefix-cache attach) and
:meth:`PageAccount.hold` / :meth:`PageAccount.release` as its page table
changes, always on the scheduler thread. Host calls pre-check on their own
thread with :meth:`PageAccount.precheck`, counting the pages of calls
queued but not yet run (:meth:`PageAccount.pend`), so a storm of forks
fails at the call that passes the quota rather than later on the scheduler.

Cached prefix pages that no sequence holds belong to no account and stay
reclaimable by the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from ...sdk.errors import KvQuotaError


class PageAccount:
    """Distinct KV pages held by a group of sequences, with an optional limit.

    Args:
        label: who holds the pages, for error messages (``"instance 'ab12'"``).
        limit: most distinct pages the account may hold (None: unlimited).
        parent: the enclosing account, charged when this one first holds a page.
        setting: the configuration key of ``limit``, named in errors.
    """

    def __init__(self, label: str, limit: int | None = None, parent: PageAccount | None = None, setting: str = "") -> None:
        self.label = label
        self.limit = limit
        self.parent = parent
        self.setting = setting
        self._held: dict[int, int] = {}  # page -> references from this account's sequences (or children)
        self._pending = 0  # fresh pages of queued calls (host threads)
        self._pending_lock = threading.Lock()

    @property
    def pages(self) -> int:
        """Distinct pages held now."""
        return len(self._held)

    def holds(self, page: int) -> bool:
        return page in self._held

    def check(self, adding: Iterable[int] = (), fresh: int = 0) -> None:
        """Raise :class:`KvQuotaError` unless this account and every parent
        can also hold the existing pages ``adding`` plus ``fresh`` newly
        allocated ones. Changes nothing.

        Raises:
            KvQuotaError: naming the account, its count, the limit and its
                configuration key.
        """
        adding = set(adding)
        acc: PageAccount | None = self
        while acc is not None:
            if acc.limit is not None:
                new = fresh + sum(1 for p in adding if p not in acc._held)
                if new and acc.pages + new > acc.limit:
                    key = f" ({acc.setting})" if acc.setting else ""
                    raise KvQuotaError(
                        f"KV page quota exceeded: {acc.label} holds {acc.pages} page(s) and needs {new} more, "
                        f"over its page limit of {acc.limit}{key}"
                    )
            acc = acc.parent

    def room(self) -> int | None:
        """Fresh pages this account and its parents can still take (None: no limit)."""
        best: int | None = None
        acc: PageAccount | None = self
        while acc is not None:
            if acc.limit is not None:
                left = max(0, acc.limit - acc.pages)
                best = left if best is None else min(best, left)
            acc = acc.parent
        return best

    def precheck(self, fresh: int) -> None:
        """Host-side check before queuing a call that takes ``fresh`` new
        pages: counts held pages plus those of calls still queued.

        Raises:
            KvQuotaError: as :meth:`check`.
        """
        acc: PageAccount | None = self
        while acc is not None:
            if acc.limit is not None and fresh and acc.pages + acc._pending + fresh > acc.limit:
                key = f" ({acc.setting})" if acc.setting else ""
                raise KvQuotaError(
                    f"KV page quota exceeded: {acc.label} holds {acc.pages} page(s) ({acc._pending} more queued) "
                    f"and needs {fresh} more, over its page limit of {acc.limit}{key}"
                )
            acc = acc.parent

    def pend(self, n: int) -> None:
        """Count ``n`` fresh pages of a queued call (``-n`` once it ran) at
        every level."""
        acc: PageAccount | None = self
        while acc is not None:
            with acc._pending_lock:
                acc._pending += n
            acc = acc.parent

    def hold(self, page: int) -> None:
        """Count one more reference to ``page`` (no limit check: call
        :meth:`check` first)."""
        acc: PageAccount | None = self
        while acc is not None:
            n = acc._held.get(page, 0)
            acc._held[page] = n + 1
            if n:  # the parent already counts this page through us
                return
            acc = acc.parent

    def release(self, page: int) -> None:
        """Drop one reference to ``page``.

        Raises:
            KeyError: the account does not hold ``page`` (an accounting bug).
        """
        acc: PageAccount | None = self
        while acc is not None:
            n = acc._held[page]
            if n > 1:
                acc._held[page] = n - 1
                return
            del acc._held[page]
            acc = acc.parent

    def __repr__(self) -> str:
        return f"PageAccount({self.label!r}, pages={self.pages}, limit={self.limit})"
