"""Named snapshots of one served model: save, open, take, delete, with quotas
and (when the server has a data dir) persistence.

The registry (:mod:`tartlet.host.snapshots`) maps names to snapshots per
user; each snapshot's pages are charged to its owner's snapshot account
(:mod:`tartlet.host.kv_quotas`). With a :class:`SnapshotStore`, every saved
snapshot is written to disk by a background writer after the scheduler has
forked it. The writer copies the KV out of the pool itself, one snapshot at
a time (a snapshot's pages are immutable while it holds them), so a storm of
saves queues references, not copies of the KV; a snapshot deleted or taken
before its turn is skipped,
and at start the files on disk are registered again *on disk only*: their
pages are loaded into the pool on first open or take. Page edits all run as
scheduler commands, ordered after the forward passes of the sequences they
touch.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..engine.engine import Engine
from ..engine.sequence import Sequence
from ..errors import SnapshotError
from .kv_quotas import KvAccounts
from .snapshot_store import SnapshotFile, SnapshotStore
from .snapshots import Snapshot, SnapshotRegistry, check_name

log = logging.getLogger(__name__)


class SnapshotManager:
    """Snapshots of ``engine``, charged to ``accounts``."""

    def __init__(self, engine: Engine, accounts: KvAccounts) -> None:
        self.engine = engine
        self.accounts = accounts
        self.registry = SnapshotRegistry(accounts.limits.max_snapshots_per_user)
        self.store: SnapshotStore | None = None
        self._writer: ThreadPoolExecutor | None = None
        self._io_lock = threading.Lock()

    # -- persistence -------------------------------------------------------------------
    def enable_persistence(self, root: Path, budget_bytes: int | None = None) -> int:
        """Persist snapshots under ``root`` and register the ones found
        there (on disk only); returns how many were restored."""
        self.store = SnapshotStore(root, self.engine, budget_bytes)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tartlet-snapshot-writer")
        n = 0
        for f, path, mtime in self.store.scan():
            try:
                self.registry.add(Snapshot(f.owner, f.name, f.tokens, None, path, mtime), enforce_limit=False)
                n += 1
            except SnapshotError as e:
                log.warning("skipping snapshot file %s: %s", path, e)
        return n

    def flush(self) -> None:
        """Wait until every queued snapshot write has finished."""
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish pending writes and stop the writer."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None

    # -- calls ---------------------------------------------------------------------------
    def names(self, owner: str | None = None) -> list[str]:
        """Names ``owner`` can open (its own and ``public/`` ones); all names
        when ``owner`` is None."""
        return self.registry.names(owner) if owner is not None else self.registry.all_names()

    def save(self, owner: str, src: Sequence, tokens: list[int], name: str) -> Snapshot:
        """Register snapshot ``name`` of ``owner`` as a fork of ``src`` (taken
        after ``src``'s queued passes) and queue its write to disk.

        Raises:
            SnapshotError: invalid or taken name.
            LimitError: the user has ``max_snapshots_per_user`` snapshots.
            KvQuotaError: the snapshot's pages would pass the user's quotas.
        """
        check_name(name)
        acc = self.accounts.snapshots(owner)
        pages = list(src.pages)
        tail = 1 if len(tokens) % self.engine.pool.page_size else 0
        acc.check((p for p in pages[: len(pages) - tail] if p is not None))
        acc.precheck(tail)
        snap = Snapshot(owner, name, list(tokens), Sequence(self.engine.pool, acc))
        self.registry.add(snap)
        assert snap.seq is not None
        dst = snap.seq

        def run() -> None:
            try:
                if src.freed:
                    raise SnapshotError(src.error or "saved from a destroyed context")
                src.fork_into(dst)
            except BaseException as e:
                self.registry.discard(snap)
                dst.free(f"snapshot failed: {e}")
                log.warning("snapshot %r of user %r failed: %s", name, owner, e)
                raise
            if self.store is not None and self._writer is not None:
                self._writer.submit(self._persist, snap, dst)

        acc.pend(tail)
        try:
            fut = self.engine.scheduler.command(run, src, dst)
        except BaseException:
            acc.pend(-tail)
            self.registry.discard(snap)
            raise
        fut.add_done_callback(lambda _: acc.pend(-tail))
        return snap

    def fork_source(self, owner: str, name: str) -> tuple[Snapshot, Sequence]:
        """The snapshot ``owner`` opens as ``name`` and its sequence, loaded
        from disk first if needed (the load is queued on the scheduler ahead
        of anything later that touches the sequence).

        Raises:
            SnapshotError: no such snapshot, or its file is corrupt or of
                another model.
            KvQuotaError, KvCacheFullError: no room to load it.
        """
        snap = self.registry.get(owner, name)
        seq = self._resident(snap)
        self._touch(snap)
        return snap, seq

    def take(self, owner: str, name: str, dst: Sequence) -> list[int]:
        """Hand snapshot ``name``'s pages to the empty sequence ``dst`` and
        remove the name (its file too); returns its tokens. If the hand-over
        fails on the scheduler (quota), the snapshot is registered again and
        ``dst`` is freed with the reason.

        Raises:
            SnapshotError: absent, another user's public snapshot, or its
                file cannot be loaded.
            KvQuotaError: ``dst``'s account cannot take the pages.
        """
        snap = self.registry.pop(owner, name)
        try:
            seq = self._resident(snap)
            if dst.account is not None:
                dst.account.check(p for p in list(seq.pages) if p is not None)
        except BaseException:
            self.registry.add(snap, enforce_limit=False)
            raise

        def run() -> None:
            try:
                if seq.freed:
                    raise SnapshotError(seq.error or f"snapshot {name!r} could not be loaded")
                seq.transfer_into(dst)
            except BaseException as e:
                dst.free(f"taking snapshot {name!r} failed: {e}")
                if not seq.freed:  # put it back, unless its name was saved again meanwhile
                    try:
                        self.registry.add(snap, enforce_limit=False)
                    except SnapshotError:
                        seq.free()
                        self._forget_file(snap)
                raise
            self._forget_file(snap)

        self.engine.scheduler.command(run, seq, dst)
        return snap.tokens

    def delete(self, owner: str, name: str) -> None:
        """Remove ``owner``'s snapshot ``name``, its pages (after queued
        passes) and its file.

        Raises:
            SnapshotError: absent, or another user's public snapshot.
        """
        snap = self.registry.pop(owner, name)
        seq = snap.seq
        if seq is not None:
            try:
                self.engine.scheduler.command(seq.free, seq)
            except RuntimeError:  # scheduler stopped
                seq.free()
        self._forget_file(snap)

    # -- internals -------------------------------------------------------------------
    def _resident(self, snap: Snapshot) -> Sequence:
        with snap.lock:
            if snap.seq is not None:
                return snap.seq
            if snap.path is None or self.store is None:
                raise SnapshotError(f"snapshot {snap.name!r} has no pages and no file to load them from")
            data = self.store.read(snap.path)
            acc = self.accounts.snapshots(snap.owner)
            n = sum(data.live)
            acc.check(fresh=n)
            self.engine.pool.ensure_available(n)
            seq = Sequence(self.engine.pool, acc)
            snap.seq = seq

        def install() -> None:
            try:
                _install(seq, data)
            except BaseException as e:
                seq.free(f"snapshot {snap.name!r} could not be loaded: {e}")
                with snap.lock:
                    if snap.seq is seq:
                        snap.seq = None  # stays on disk; a later open tries again
                raise

        self.engine.scheduler.command(install, seq)
        return seq

    def _gather(self, snap: Snapshot, seq: Sequence) -> SnapshotFile:
        """Copy the KV of ``seq``'s live pages out of the pool (writer
        thread: the pages are immutable while the snapshot holds them; if it
        is taken or deleted meanwhile, what was read is discarded)."""
        pool = seq.pool
        ps = pool.page_size
        pages = seq.pages  # transfer_into replaces the list, never edits it
        live = [p for p in pages if p is not None]
        rows = (torch.tensor(live, dtype=torch.long)[:, None] * ps + torch.arange(ps)).reshape(-1)
        return SnapshotFile(
            owner=snap.owner, name=snap.name, tokens=list(seq.tokens), positions=list(seq.positions),
            masked=bytes(seq.masked), live=[int(p is not None) for p in pages], pure=seq.pure,
            k=pool.k[:, rows].cpu(), v=pool.v[:, rows].cpu(),
        )  # fmt: skip

    def _persist(self, snap: Snapshot, seq: Sequence) -> None:
        assert self.store is not None
        if snap.deleted or seq.freed:
            return  # deleted or taken before its turn
        try:
            path = self.store.write(self._gather(snap, seq))
        except Exception as e:  # a full disk, or the snapshot taken while it was read
            if not (snap.deleted or seq.freed):
                log.error("could not write snapshot %r of user %r: %s", snap.name, snap.owner, e)
            return
        with self._io_lock:
            if snap.deleted:
                self.store.delete(path)
                return
            snap.path = path
        self._enforce_budget(snap.owner, keep=snap)

    def _forget_file(self, snap: Snapshot) -> None:
        with self._io_lock:
            snap.deleted = True
            path, snap.path = snap.path, None
        if self.store is not None and path is not None:
            self.store.delete(path)

    def _touch(self, snap: Snapshot) -> None:
        snap.last_used = time.time()
        if snap.path is not None:
            try:
                os.utime(snap.path)  # the LRU order survives a restart
            except OSError:
                pass

    def _enforce_budget(self, owner: str, keep: Snapshot) -> None:
        store = self.store
        if store is None or store.budget_bytes is None:
            return
        with self._io_lock:
            files = [(s, s.path) for s in self.registry.owned_by(owner) if s.path is not None]
            sizes = {id(s): _size(p) for s, p in files}
            total = sum(sizes.values())
            for s, p in sorted(files, key=lambda sp: sp[0].last_used):
                if total <= store.budget_bytes:
                    break
                if s is keep:
                    continue
                total -= sizes[id(s)]
                s.path = None
                store.delete(p)
                if s.seq is None:  # on disk only: nothing is left of it
                    self.registry.discard(s)
                log.info("snapshot %r of user %r dropped from disk (snapshot disk budget)", s.name, owner)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _install(seq: Sequence, data: SnapshotFile) -> None:
    """Allocate pages for a snapshot read from disk, copy its KV in and fill
    ``seq`` (scheduler thread). A pure snapshot's full pages also seed the
    prefix cache.

    Raises:
        KvQuotaError, KvCacheFullError: no room; nothing is taken.
    """
    pool = seq.pool
    ps = pool.page_size
    n = sum(data.live)
    if seq.account is not None:
        seq.account.check(fresh=n)
    pages = pool.allocate(n)
    assert data.k is not None and data.v is not None
    rows = (torch.tensor(pages, dtype=torch.long)[:, None] * ps + torch.arange(ps)).reshape(-1)
    pool.k[:, rows.to(pool.k.device)] = data.k.to(pool.k.device, pool.k.dtype)
    pool.v[:, rows.to(pool.v.device)] = data.v.to(pool.v.device, pool.v.dtype)
    if seq.account is not None:
        for p in pages:
            seq.account.hold(p)
    it = iter(pages)
    seq.pages = [next(it) if live else None for live in data.live]
    seq.tokens = list(data.tokens)
    seq.positions = list(data.positions)
    seq.masked = bytearray(data.masked)
    seq.pure = data.pure
    seq.keys = []
    seq.commit_full_pages()

