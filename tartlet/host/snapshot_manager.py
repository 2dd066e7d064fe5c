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
pages are loaded into the pool on first open or take. Files share page files
(:mod:`tartlet.host.snapshot_pages`): a write stores only pages not stored
yet, and the page files no file names any more are swept on the writer
thread. Page edits all run as scheduler commands, ordered after the forward
passes of the sequences they touch.

Replicas sharing one folder (``enable_persistence(..., shared=True)``):
several servers, each with its own engine and manager, persist to the same
folder, and the folder, not any one registry, says which names exist.

- A save returns only once its file is on disk (written by the writer
  thread, fsync'd and renamed into place), so another replica finds it as
  soon as the inferlet that saved it goes on; a failed write fails the save.
  The wait blocks the thread of the host call (for native inferlets, their
  event loop) for the fork and the write, as loading a snapshot from disk
  on open already does.
- A name this registry lacks (open, take, delete, save, listing) is looked
  up in the folder (:meth:`SnapshotStore.find`) and registered on disk only;
  the usual lazy load brings its pages in. Listing rescans the folders whose
  mtime changed since the last listing (headers only).
- Before a snapshot is opened, taken or deleted, its file is checked: gone
  (deleted or taken through another replica) drops this replica's copy and
  the name is looked up again (usually "no snapshot named ..."); replaced
  (saved again through another replica: another ``sha256`` in its header)
  drops this copy and loads the file. The check is one ``stat`` while the
  file is unchanged, a header read when it changed.
- Quotas are kept per replica: pages loaded here are charged to the owner's
  accounts here; ``max_snapshots_per_user`` counts the owner's names this
  replica knows of (its own and those it found in the folder) and the disk
  budget the files of those names, so a user may pass them by saving through
  several replicas at once. Two replicas saving or taking one name at the
  same moment are not serialized: the last rename wins.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..engine.core.engine import Engine
from ..engine.core.scheduler import Scheduler
from ..engine.core.sequence import Sequence
from ..sdk.errors import SnapshotError
from .fair_gate import FairGate
from .kv_quotas import KvAccounts
from .snapshot_pages import SHARED_GRACE_S, over_budget
from .snapshot_pages import file_size as _size
from .snapshot_pages import install as _install
from .snapshot_pages import partial_tail as _partial
from .snapshot_store import RACY_MTIME_NS, SHARED_TMP_AGE_S, FileStamp, SnapshotFile, SnapshotStore, file_stamp
from .snapshots import Snapshot, SnapshotRegistry, check_name

log = logging.getLogger(__name__)



class SnapshotManager:
    """Snapshots of ``engine``, charged to ``accounts``."""

    def __init__(self, engine: Engine, accounts: KvAccounts, gate: FairGate | None = None) -> None:
        self.engine = engine
        #: what queues the KV commands: the model slot's per-user gate, else the scheduler
        self.commands: FairGate | Scheduler = gate if gate is not None else engine.scheduler
        self.accounts = accounts
        self.registry = SnapshotRegistry(accounts.limits.max_snapshots_per_user)
        self.store: SnapshotStore | None = None
        #: the folder is shared with other replicas (see the module docstring)
        self.shared = False
        self._writer: ThreadPoolExecutor | None = None
        self._io_lock = threading.Lock()
        self._pending_lock = threading.Lock()
        #: saves whose fork (and so whose write's submission) has not run yet
        self._pending: set[Future[Future[None] | None]] = set()
        self._sync_lock = threading.Lock()
        #: shared mode: user folder -> (its mtime ns, {file: stamp}) at the last listing
        self._listed: dict[Path, tuple[int, dict[Path, FileStamp]]] = {}
        #: user folder -> ``time.monotonic()`` of its last page-file sweep
        self._swept: dict[Path, float] = {}

    # -- persistence -------------------------------------------------------------------
    def enable_persistence(self, root: Path, budget_bytes: int | None = None, shared: bool = False) -> int:
        """Persist snapshots under ``root`` and register the ones found
        there (on disk only); returns how many were restored.

        Args:
            root: the snapshot folder.
            budget_bytes: disk bytes of one user's files (None: unlimited).
            shared: other servers (replicas) use the same folder: every
                save waits until its file is on disk, and names are looked
                up in the folder and checked against it (module docstring).
                False (one server): saves are written in the background.

        Raises:
            OSError: the folder cannot be created.
        """
        self.close()  # a second call: finish the writes queued for the old folder
        self.store = SnapshotStore(root, self.engine, budget_bytes)
        self.shared = shared
        self._listed = {}
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tartlet-snapshot-writer")
        n = 0
        for f, path, mtime in self.store.scan(tmp_age_s=SHARED_TMP_AGE_S if shared else 0.0):
            try:
                snap = Snapshot(f.owner, f.name, f.tokens, None, path, mtime, sha256=f.sha256, stamp=f.stamp, blobs=tuple(f.blobs or ()))
                self.registry.add(snap, enforce_limit=False)
                n += 1
            except SnapshotError as e:
                log.warning("skipping snapshot file %s: %s", path, e)
        for d in self.store.user_dirs():  # page files of saves a crash cut short
            self.store.sweep(d, SHARED_GRACE_S if shared else 0.0)
            self._swept[d] = time.monotonic()
        return n

    def flush(self) -> None:
        """Wait until every snapshot saved so far is written (its fork on
        the scheduler first, then its write)."""
        self._wait_pending()
        if self._writer is not None:
            self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish pending writes (those of saves whose fork is still queued
        on the scheduler too) and stop the writer. Idempotent."""
        if self._writer is not None:
            self._wait_pending()
            self._writer.shutdown(wait=True)
            self._writer = None
        if self.store is not None:
            self.store.pages.close()

    def _wait_pending(self, timeout_s: float = 120.0) -> None:
        with self._pending_lock:
            pending = list(self._pending)
        if pending:
            _, late = concurrent.futures.wait(pending, timeout=timeout_s)
            if late:
                log.warning("%d snapshot saves still queued on the scheduler after %.0f s", len(late), timeout_s)

    # -- calls ---------------------------------------------------------------------------
    def names(self, owner: str | None = None) -> list[str]:
        """Names ``owner`` can open (its own and ``public/`` ones); all names
        when ``owner`` is None. In shared mode the folder is listed first, so
        names saved through other replicas are included and names deleted
        there are not."""
        if self.shared:
            self._sync_folder()
        return self.registry.names(owner) if owner is not None else self.registry.all_names()

    def save(self, owner: str, src: Sequence, tokens: list[int], name: str) -> Snapshot:
        """Register snapshot ``name`` of ``owner`` as a fork of ``src`` (taken
        after ``src``'s queued passes) and queue its write to disk; in shared
        mode, wait until the fork is done and the file is on disk.

        Raises:
            SnapshotError: invalid or taken name (in shared mode, taken
                through another replica too); shared mode: ``src`` was
                destroyed before the fork, or the file could not be written
                (nothing is saved then).
            LimitError: the user has ``max_snapshots_per_user`` snapshots.
            KvQuotaError: the snapshot's pages would pass the user's quotas
                (shared mode: also when found on the scheduler).
            KvCacheFullError: shared mode: no free page for the copied tail.
            RuntimeError: shared mode: the engine stopped.
        """
        check_name(name)
        if self.shared:
            try:
                self._current(owner, name)  # a name saved through another replica is taken
            except SnapshotError:
                pass  # no such file (or an unreadable one, which this save replaces)
        acc = self.accounts.snapshots(owner)
        pages = list(src.pages)
        tail = 1 if len(tokens) % self.engine.pool.page_size else 0
        acc.check((p for p in pages[: len(pages) - tail] if p is not None))
        acc.precheck(tail)
        snap = Snapshot(owner, name, list(tokens), Sequence(self.engine.pool, acc))
        self.registry.add(snap)
        assert snap.seq is not None
        dst = snap.seq

        shared = self.shared

        def run() -> Future[None] | None:
            try:
                if src.freed:
                    raise SnapshotError(src.error or "saved from a destroyed context")
                src.fork_into(dst)
            except BaseException as e:
                self.registry.discard(snap)
                dst.free(f"snapshot failed: {e}")
                log.warning("snapshot %r of user %r failed: %s", name, owner, e)
                raise
            writer = self._writer
            if self.store is not None and writer is not None:
                return writer.submit(self._persist, snap, dst, shared)
            return None

        acc.pend(tail)
        try:
            fut = self.commands.command(run, src, dst)
        except BaseException:
            acc.pend(-tail)
            self.registry.discard(snap)
            raise
        with self._pending_lock:
            self._pending.add(fut)

        def done(f: Future[Future[None] | None]) -> None:
            acc.pend(-tail)
            with self._pending_lock:
                self._pending.discard(f)

        fut.add_done_callback(done)
        if shared:
            self._wait_written(snap, fut)
        return snap

    def _wait_written(self, snap: Snapshot, fut: Future[Future[None] | None]) -> None:
        """Shared mode: wait for ``snap``'s fork (its errors are raised as
        they are, the snapshot already unregistered) and then its write (a
        failed write undoes the save)."""
        written = fut.result()
        if written is None:
            return
        try:
            written.result()
        except Exception as e:
            self.registry.discard(snap)
            self._forget_file(snap)
            self._free(snap)
            log.error("could not write snapshot %r of user %r: %s", snap.name, snap.owner, e)
            raise SnapshotError(f"snapshot {snap.name!r} could not be written to the snapshot folder ({type(e).__name__}); it was not saved") from None

    def fork_source(self, owner: str, name: str) -> tuple[Snapshot, Sequence]:
        """The snapshot ``owner`` opens as ``name`` and its sequence, loaded
        from disk first if needed (the load is queued on the scheduler ahead
        of anything later that touches the sequence).

        In shared mode the name is looked up in the folder if this replica
        does not know it, and a copy older than the file (saved again
        through another replica) is replaced by the file's.

        Raises:
            SnapshotError: no such snapshot (in shared mode: deleted or
                taken through another replica), or its file is corrupt or
                of another model.
            KvQuotaError, KvCacheFullError: no room to load it.
        """
        snap = self._current(owner, name) if self.shared else self.registry.get(owner, name)
        seq = self._resident(snap)
        self._touch(snap)
        return snap, seq

    def take(self, owner: str, name: str, dst: Sequence) -> list[int]:
        """Hand snapshot ``name``'s pages to the empty sequence ``dst`` and
        remove the name (its file too); returns its tokens. If the hand-over
        fails on the scheduler (quota), the snapshot is registered again and
        ``dst`` is freed with the reason.

        Raises:
            SnapshotError: absent (in shared mode: in the folder too),
                another user's public snapshot, or its file cannot be loaded.
            KvQuotaError: ``dst``'s account cannot take the pages.
        """
        if self.shared:
            self._current(owner, name)
        snap = self.registry.pop(owner, name)
        try:
            seq = self._resident(snap)
            if dst.account is not None:
                dst.account.check(p for p in list(seq.pages) if p is not None)
        except BaseException:
            if not snap.deleted:  # not dropped as deleted through another replica
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

        self.commands.command(run, seq, dst)
        return snap.tokens

    def delete(self, owner: str, name: str) -> None:
        """Remove ``owner``'s snapshot ``name``, its pages (after queued
        passes) and its file.

        Raises:
            SnapshotError: absent (in shared mode: in the folder too), or
                another user's public snapshot.
        """
        if self.shared:
            self._current(owner, name)
        snap = self.registry.pop(owner, name)
        self._free(snap)
        self._forget_file(snap)

    # -- shared folder ---------------------------------------------------------------
    def _current(self, owner: str, name: str) -> Snapshot:
        """Shared mode: the snapshot ``owner`` sees as ``name`` as the folder
        has it now: this replica's copy if its file is unchanged (or it has
        no file yet), else the file, registered on disk only.

        Raises:
            SnapshotError: invalid name, no such snapshot, or its file's
                header is unreadable.
        """
        check_name(name)
        try:
            snap = self.registry.get(owner, name)
        except SnapshotError:
            return self._adopt(owner, name)
        if self._still_on_disk(snap):
            return snap
        return self._adopt(owner, name)  # gone or replaced: whatever the folder holds now

    def _adopt(self, owner: str, name: str) -> Snapshot:
        """Register the file of ``owner``'s ``name`` on disk only.

        Raises:
            SnapshotError: no such file, or its header is unreadable.
        """
        assert self.store is not None
        found = self.store.find(owner, name)
        if found is None:
            raise SnapshotError(f"no snapshot named {name!r}")
        head, path = found
        mtime = head.stamp[2] / 1e9 if head.stamp is not None else time.time()
        snap = Snapshot(head.owner, head.name, head.tokens, None, path, mtime, sha256=head.sha256, stamp=head.stamp, blobs=tuple(head.blobs or ()))
        try:
            self.registry.add(snap, enforce_limit=False)
        except SnapshotError:  # registered meanwhile (another thread, or a save here)
            return self.registry.get(owner, name)
        return snap

    def _still_on_disk(self, snap: Snapshot) -> bool:
        """Whether ``snap`` is what the folder holds under its name; if its
        file is gone or holds another version, ``snap`` is dropped here
        (its pages freed after queued passes) and False is returned."""
        path = snap.path
        if path is None or self.store is None:
            return True  # not written (yet, or over the disk budget): this replica's own
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._drop(snap, "its file was deleted")
            return False
        except OSError:
            return True  # unreadable now: keep what we have
        stamp = file_stamp(st)
        if stamp == snap.stamp:
            return True
        try:
            head = self.store.read(path, tensors=False)
        except SnapshotError:
            head = None
        if head is not None and head.sha256 == snap.sha256 and head.owner == snap.owner and head.name == snap.name:
            snap.stamp = stamp  # touched (opened through another replica), not replaced
            return True
        self._drop(snap, "its file was saved again")
        return False

    def _drop(self, snap: Snapshot, why: str) -> None:
        """Forget this replica's copy of ``snap`` (its file stays)."""
        with self._io_lock:
            snap.deleted = True
            snap.path = None
        self.registry.discard(snap)
        self._free(snap)
        log.info("snapshot %r of user %r dropped from this replica: %s through another replica", snap.name, snap.owner, why)

    def _sync_folder(self) -> None:
        """Shared mode: register the files of the user folders changed since
        the last call (on disk only), and drop the copies whose file was
        deleted there."""
        assert self.store is not None
        with self._sync_lock:
            now = time.time_ns()
            changed: list[Path] = []
            dirs = self.store.user_dirs()
            for d in dirs:
                try:
                    mtime = d.stat().st_mtime_ns
                except OSError:
                    continue
                seen = self._listed.get(d)
                if seen is not None and seen[0] == mtime:
                    continue
                before = seen[1] if seen is not None else {}
                files: dict[Path, FileStamp] = {}
                for path in sorted(d.glob("*.safetensors")):
                    try:
                        files[path] = file_stamp(path.stat())
                    except OSError:
                        continue
                    if before.get(path) == files[path]:
                        continue
                    try:
                        head = self.store.read(path, tensors=False)
                    except SnapshotError as e:
                        log.warning("skipping snapshot file %s: %s", path, e)
                        continue
                    try:
                        self.registry.get(head.owner, head.name)
                    except SnapshotError:
                        mtime_s = head.stamp[2] / 1e9 if head.stamp is not None else time.time()
                        snap = Snapshot(head.owner, head.name, head.tokens, None, path, mtime_s, sha256=head.sha256, stamp=head.stamp,
                                        blobs=tuple(head.blobs or ()))
                        try:
                            self.registry.add(snap, enforce_limit=False)
                        except SnapshotError:
                            pass  # registered meanwhile
                if now - mtime > RACY_MTIME_NS:
                    self._listed[d] = (mtime, files)
                else:
                    self._listed.pop(d, None)
                changed.append(d)
            gone = set(self._listed) - set(dirs)
            for d in gone:
                del self._listed[d]
            check = set(changed) | gone
        for snap in self.registry.all():
            file = snap.path
            if file is not None and file.parent in check and not file.exists():
                self._drop(snap, "its file was deleted")

    # -- internals -------------------------------------------------------------------
    def _free(self, snap: Snapshot) -> None:
        """Free ``snap``'s pages, after the queued passes that touch them."""
        seq = snap.seq
        if seq is not None:
            try:
                self.commands.command(seq.free, seq)
            except RuntimeError:  # scheduler stopped
                seq.free()

    def _resident(self, snap: Snapshot) -> Sequence:
        with snap.lock:
            if snap.seq is not None:
                return snap.seq
            path = snap.path
            if path is None or self.store is None:
                raise SnapshotError(f"snapshot {snap.name!r} has no pages and no file to load them from")
            try:
                data = self.store.read(path)
            except SnapshotError:
                if self.shared and not path.exists():  # deleted through another replica meanwhile
                    self._drop(snap, "its file was deleted")
                    raise SnapshotError(f"no snapshot named {snap.name!r}") from None
                raise
            if data.sha256 != snap.sha256:  # saved again since its header was read: the file is whole, take all of it
                snap.tokens, snap.sha256 = list(data.tokens), data.sha256
            snap.stamp, snap.blobs = data.stamp, tuple(data.blobs or ())
            acc = self.accounts.snapshots(snap.owner)
            n = sum(data.live)
            acc.check(fresh=n)
            self.engine.pool.ensure_available(n)
            seq = Sequence(self.engine.pool, acc)
            snap.seq = seq

        def install() -> None:
            try:
                pages = _install(seq, data)
                if data.blobs is not None and self.store is not None:  # a later save holding these pages names their files
                    full, held = len(pages) - _partial(len(data.tokens), data.live, self.engine.pool.page_size), set(seq.pages)
                    kept = [(p, b) for j, (p, b) in enumerate(zip(pages, data.blobs)) if j < full and p in held]
                    self.store.pages.remember([p for p, _ in kept], self.engine.pool.generations([p for p, _ in kept]), [b for _, b in kept])
            except BaseException as e:
                seq.free(f"snapshot {snap.name!r} could not be loaded: {e}")
                with snap.lock:
                    if snap.seq is seq:
                        snap.seq = None  # stays on disk; a later open tries again
                raise

        self.commands.command(install, seq)
        return seq

    def _gather(self, snap: Snapshot, seq: Sequence) -> tuple[SnapshotFile, list[int], list[int]]:
        """Store the page files of ``seq``'s live pages (``/2``; ``/1``: copy
        their KV out of the pool) and describe ``snap``; returns it with the
        live pages and their generations (writer thread: the pages are
        immutable while the snapshot holds them; if it is taken or deleted
        meanwhile, what was read is discarded)."""
        assert self.store is not None
        pool = seq.pool
        ps = pool.page_size
        pages = seq.pages  # transfer_into replaces the list, never edits it
        live = [p for p in pages if p is not None]
        f = SnapshotFile(
            owner=snap.owner, name=snap.name, tokens=list(seq.tokens), positions=list(seq.positions),
            # a snapshot with tokens of a LoRA adapter is read back impure: its page keys name the adapter, which the file does not keep
            masked=bytes(seq.masked), live=[int(p is not None) for p in pages], pure=seq.pure and not seq.adapted,
        )  # fmt: skip
        if self.store.version == 1:
            rows = (torch.tensor(live, dtype=torch.long)[:, None] * ps + torch.arange(ps)).reshape(-1)
            f.k, f.v = pool.k[:, rows].cpu(), pool.v[:, rows].cpu()
            return f, [], []
        full = len(live) - _partial(len(f.tokens), f.live, ps)
        f.blobs, gens = self.store.pages.store(self.store.path_for(snap.owner, snap.name).parent, live, full, len(f.tokens) % ps, self.shared)
        return f, live[:full], gens[:full]

    def _persist(self, snap: Snapshot, seq: Sequence, strict: bool = False) -> None:
        """Write ``snap`` (writer thread). A failed write is logged, or with
        ``strict`` raised (the waiting save reports it)."""
        assert self.store is not None
        if snap.deleted or seq.freed:
            return  # deleted or taken before its turn
        store, t0, c0 = self.store, time.perf_counter(), time.thread_time()
        user_dir = store.path_for(snap.owner, snap.name).parent
        try:
            f, full, gens = self._gather(snap, seq)
            path = store.write(f)
            if self.shared and f.blobs:
                store.pages.check_present(user_dir, [p for p in seq.pages if p is not None], f.blobs, len(full), len(f.tokens) % self.engine.pool.page_size)
        except Exception as e:  # a full disk, or the snapshot taken while it was read
            self._sweep(user_dir)  # the page files it wrote, unless another snapshot names them
            if not (snap.deleted or seq.freed):
                if strict:
                    raise
                log.error("could not write snapshot %r of user %r: %s", snap.name, snap.owner, e)
            return
        finally:
            store.pages.stats.write_seconds += time.perf_counter() - t0
            store.pages.stats.write_cpu_seconds += time.thread_time() - c0
        with self._io_lock:
            if snap.deleted:
                store.delete(path)
                self._sweep(user_dir)
                return
            snap.path, snap.sha256, snap.stamp, snap.blobs = path, f.sha256, f.stamp, tuple(f.blobs or ())
        if not seq.freed:  # it held the pages all along: they hold what was hashed while their generation stays
            store.pages.remember(full, gens, list(f.blobs or ())[: len(full)])
        self._enforce_budget(snap.owner, keep=snap)
        if self.shared and time.monotonic() - self._swept.get(user_dir, 0.0) > SHARED_GRACE_S:
            self._sweep(user_dir)

    def _sweep(self, user_dir: Path) -> None:
        """Remove ``user_dir``'s page files no snapshot file names (writer
        thread; a shared folder's young ones stay, see
        :mod:`tartlet.host.snapshot_pages`)."""
        if self.store is not None:
            self._swept[user_dir] = time.monotonic()
            self.store.sweep(user_dir, SHARED_GRACE_S if self.shared else 0.0)

    def _forget_file(self, snap: Snapshot) -> None:
        with self._io_lock:
            snap.deleted = True
            path, snap.path = snap.path, None
        if self.store is not None and path is not None:
            self.store.delete(path)
            writer = self._writer
            if snap.blobs and writer is not None:  # after the writes queued before it: never under a save in progress
                try:
                    writer.submit(self._sweep, path.parent)
                except RuntimeError:  # closing
                    pass

    def _touch(self, snap: Snapshot) -> None:
        """Mark ``snap`` used now, its file too: the LRU order survives a
        restart and is seen by other replicas. The file's stamp is updated
        only if it is the file last checked (the same open file is stamped,
        touched and stamped again, so a replace in between is not hidden)."""
        snap.last_used = time.time()
        path = snap.path
        if path is None:
            return
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            before = file_stamp(os.fstat(fd))
            os.utime(fd if os.utime in os.supports_fd else path)
            if before == snap.stamp:
                snap.stamp = file_stamp(os.fstat(fd))
        except OSError:
            pass
        finally:
            os.close(fd)

    def _enforce_budget(self, owner: str, keep: Snapshot) -> None:
        """Delete ``owner``'s least recently used snapshot files (and the
        page files only they name) until its snapshot and page files fit
        the disk budget (writer thread)."""
        store = self.store
        if store is None or store.budget_bytes is None:
            return
        dirs = set()
        with self._io_lock:
            files = sorted(((s, s.path) for s in self.registry.owned_by(owner) if s.path is not None), key=lambda sp: sp[0].last_used)
            paths = {id(s): p for s, p in files}
            drop = over_budget([(s, _size(p), s.blobs) for s, p in files], store.pages.page_bytes, store.budget_bytes, keep)
            for s in drop:
                s.path = None
                store.delete(paths[id(s)])
                dirs.add(paths[id(s)].parent)
                if s.seq is None:  # on disk only: nothing is left of it
                    self.registry.discard(s)
                log.info("snapshot %r of user %r dropped from disk (snapshot disk budget)", s.name, owner)
        for d in dirs:
            self._sweep(d)
