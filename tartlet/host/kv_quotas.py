"""Per-user KV page accounts and the limits they enforce.

Each served model has one :class:`KvAccounts`: per user, an account of the
distinct pages the user's live contexts and snapshots hold
(``max_pages_per_user``) and, under it, an account of the user's snapshots
(``max_snapshot_pages_per_user``). Each instance charges its contexts to an
instance account (``max_pages_per_instance``) under its user's account. See
:mod:`tartlet.engine.core.kv_accounting` for how pages are counted.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..engine.core.kv_accounting import PageAccount


@dataclass
class KvLimits:
    """KV and snapshot limits (None: unlimited). Filled from ``[limits]``
    of the server config (``tartlet.server.config.LimitsConfig``).

    Attributes:
        max_pages_per_user: distinct KV pages one user's live contexts and
            snapshots may hold, per model.
        pool_fraction_per_user: the same bound as a fraction of each model's
            pool (the smaller of the two applies), so one user can never
            take the whole pool from the others.
        max_snapshot_pages_per_user: distinct pages one user's snapshots may
            hold, per model.
        max_snapshots_per_user: named snapshots one user may have, per model.
        max_contexts_per_instance: contexts one instance may have open (each
            costs host memory even when it shares all its pages).
        max_snapshot_disk_mb_per_user: disk MiB of one user's persisted
            snapshots (their files and page files, a shared page file
            counted once), per model; past it the least recently used
            snapshot files are deleted.
    """

    max_pages_per_user: int | None = None
    pool_fraction_per_user: float | None = None
    max_snapshot_pages_per_user: int | None = None
    max_snapshots_per_user: int | None = None
    max_contexts_per_instance: int | None = 4096
    max_snapshot_disk_mb_per_user: float | None = None


class KvAccounts:
    """The page accounts of one model's users (``num_pages``: its pool
    size, for ``pool_fraction_per_user``). Thread-safe creation."""

    def __init__(self, limits: KvLimits | None = None, num_pages: int = 0) -> None:
        self.limits = limits or KvLimits()
        self.num_pages = num_pages
        self._lock = threading.Lock()
        self._users: dict[str, PageAccount] = {}
        self._snapshots: dict[str, PageAccount] = {}

    def user(self, owner: str) -> PageAccount:
        """``owner``'s account (live contexts and snapshots)."""
        with self._lock:
            acc = self._users.get(owner)
            if acc is None:
                acc = PageAccount(f"user {owner or '(local)'!r}", self.user_limit(), None, self._user_setting())
                self._users[owner] = acc
            return acc

    def snapshots(self, owner: str) -> PageAccount:
        """``owner``'s snapshot account (a child of :meth:`user`)."""
        parent = self.user(owner)
        with self._lock:
            acc = self._snapshots.get(owner)
            if acc is None:
                acc = PageAccount(
                    f"the snapshots of user {owner or '(local)'!r}", self.limits.max_snapshot_pages_per_user, parent,
                    "limits.max_snapshot_pages_per_user",
                )  # fmt: skip
                self._snapshots[owner] = acc
            return acc

    def instance(self, owner: str, instance_id: str, limit: int | None) -> PageAccount:
        """A new account for one instance's contexts on this model."""
        return PageAccount(f"instance {instance_id or '(anonymous)'!r}", limit, self.user(owner), "limits.max_pages_per_instance")

    def user_limit(self) -> int | None:
        """Pages one user may hold on this model (None: unlimited)."""
        lim = self.limits
        caps = [] if lim.max_pages_per_user is None else [lim.max_pages_per_user]
        if lim.pool_fraction_per_user is not None:
            caps.append(max(1, int(lim.pool_fraction_per_user * self.num_pages)))
        return min(caps) if caps else None

    def _user_setting(self) -> str:
        lim = self.limits
        frac = lim.pool_fraction_per_user
        if frac is not None and (lim.max_pages_per_user is None or int(frac * self.num_pages) < lim.max_pages_per_user):
            return f"limits.pool_fraction_per_user = {frac} of {self.num_pages} pages"
        return "limits.max_pages_per_user"

    def set_limits(self, limits: KvLimits) -> None:
        """Apply new limits to existing and future accounts."""
        with self._lock:
            self.limits = limits
            for acc in self._users.values():
                acc.limit, acc.setting = self.user_limit(), self._user_setting()
            for acc in self._snapshots.values():
                acc.limit = limits.max_snapshot_pages_per_user
