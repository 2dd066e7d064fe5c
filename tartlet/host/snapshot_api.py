"""Snapshot host calls (named KV snapshots: save, open, take, delete,
list), per user (:class:`SnapshotHostMixin`)."""

from __future__ import annotations

from .context_api import ContextHostMixin, HostContext, _pending


class SnapshotHostMixin(ContextHostMixin):
    """The ``snapshot-*`` calls over the instance's contexts."""

    # Names are per user; ``public/...`` names are listed and opened by every
    # user, taken and deleted only by their creator (tartlet.host.snapshots).
    def snapshot_save(self, handle: int, name: str) -> None:
        """Save the context under ``name`` in the owner's namespace (it
        outlives this instance; persisted when the server has a data dir).

        Raises:
            SnapshotError: invalid name, or the name exists already.
            LimitError: the user has ``max_snapshots_per_user`` snapshots,
                or goes past ``[limits] max_allocs_per_s`` (a rate).
            KvQuotaError: the snapshot's pages would pass a page quota.
        """
        self._rate("alloc")
        ctx = self._ctx(handle)
        ctx.slot.snapshots.save(self.owner, ctx.seq, list(ctx.tokens), name)

    def snapshot_open(self, model: str | None, name: str) -> int:
        """A new context forked from snapshot ``name`` (which stays); a
        snapshot restored from disk is loaded into the pool first.

        Raises:
            SnapshotError: no such snapshot for this user, or its file is
                corrupt or of another model.
            KvQuotaError, KvCacheFullError: no room for its pages.
            LimitError: too many open contexts, or the user goes past
                ``[limits] max_allocs_per_s`` (a rate).
        """
        self._rate("alloc")
        slot = self.state.model(model)
        snap, src = slot.snapshots.fork_source(self.owner, name)
        seq = self._new_seq(slot)
        fresh = 1 if len(snap.tokens) % slot.engine.pool.page_size else 0
        child = HostContext(slot, seq, list(snap.tokens))
        _pending(seq.account, fresh, lambda: self._fork_later(slot.gate, src, child.seq))
        return self._add(child)

    def snapshot_take(self, model: str | None, name: str) -> int:
        """A context that takes over snapshot ``name``'s pages (no copy);
        the name and its file are removed.

        Raises:
            SnapshotError: absent, or a public snapshot of another user.
            KvQuotaError: the instance cannot hold its pages.
            LimitError: too many open contexts, or the user goes past
                ``[limits] max_allocs_per_s`` (a rate).
        """
        self._rate("alloc")
        slot = self.state.model(model)
        seq = self._new_seq(slot)
        tokens = slot.snapshots.take(self.owner, name, seq)
        return self._add(HostContext(slot, seq, list(tokens)))

    def snapshot_delete(self, model: str | None, name: str) -> None:
        """Remove snapshot ``name``, its pages and its file.

        Raises:
            SnapshotError: absent, or a public snapshot of another user.
        """
        self.state.model(model).snapshots.delete(self.owner, name)

    def snapshot_names(self, model: str | None) -> list[str]:
        """Snapshot names this instance's user can open (its own and the
        ``public/`` ones), sorted."""
        return self.state.model(model).snapshots.names(self.owner)


