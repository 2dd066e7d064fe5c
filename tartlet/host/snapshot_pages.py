"""Page files of ``tartlet-kv-snapshot/2`` snapshots: the KV of one page, stored
once per user and shared by every snapshot of that user that holds it.

Layout: ``<user dir>/pages/<id>.kv`` where ``<id>`` is the hex SHA-256 of the
file's bytes: the page's ``k`` rows then its ``v`` rows, each a C-order array
``[num_layers, page_size, num_kv_heads, row width]`` in the pool's dtype
(``row width`` is ``head_dim``, or ``head_dim + 4`` bytes for an int8 pool,
see :mod:`tartlet.engine.core.kv_quant`; a partly filled page's unused rows
are zeros); no header. Every page file of one
model has the same size (:attr:`PageFiles.page_bytes`). A page file is
written to ``<id>.<random>.tmp``, fsync'd and renamed; a reader checks the
hash of what it read against the name, so a damaged or truncated file is an
error, never wrong KV.

Reuse without reading. Full pages are immutable while a snapshot holds them
(copy-on-write), and a page's rows change only after the pool bumps its
generation (:meth:`PagePool.generations
<tartlet.engine.core.kv_cache.PagePool.generations>`: on allocation, or when
its only holder writes it in place). So after a page is written (or loaded
from a page file), :class:`PageFiles` remembers ``page -> (generation, id)``;
a later save holding the same page at the same generation (the next
Responses turn forks from the previous turn's snapshot) names the file
without reading or hashing the page. The map holds at most one entry per
pool page, and an entry whose generation moved on is ignored and replaced.
A partly filled last page is always read and hashed (its file is written
unless one with the same bytes exists).

Deleting. A page file no snapshot file of its user folder names is removed
by :meth:`PageFiles.sweep`: at start, after a snapshot file is deleted (its
own delete, take, expiry or the disk budget) or a write failed, and, in a
shared folder, after a save into a user folder not swept for
:data:`SHARED_GRACE_S` seconds (page files that were too young at one
sweep go at a later one). One server runs its sweeps on
its single writer thread, between its writes, so a sweep never races its own
save. Replicas sharing the folder (``shared=True``) may race each other's
saves, so there a sweep removes only page files whose mtime is older than
:data:`SHARED_GRACE_S` (checked again just before the unlink), and a save
touches (``utime``) each existing page file it names before renaming its
snapshot file in, then checks they are all still there (rewriting from the
pool any that vanished): a page file is lost only if another replica's
sweep stalls between its last age check and the unlink for longer than the
whole of this save's touch, rename and check.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import torch

from ..engine.core.kv_cache import PagePool
from ..engine.core.sequence import Sequence
from ..sdk.errors import SnapshotError

if TYPE_CHECKING:
    from .snapshot_store import SnapshotFile

log = logging.getLogger(__name__)
T = TypeVar("T")

#: folder of a user's page files, inside the user's snapshot folder
PAGES_DIR = "pages"
#: ``fill`` of a full page (every row used)
PS_FULL = -1
#: shared folder: a page file (or its temporary file) younger than this,
#: seconds, is never swept (another replica's save may be about to name it)
SHARED_GRACE_S = 600.0


@dataclass
class PageWriteStats:
    """Counters of one store's page files (monotonic; read without a lock).

    Attributes:
        pages_written: page files written.
        bytes_written: bytes of snapshot and page files written.
        pages_hashed: pages read from the pool and hashed at a save.
        pages_reused: pages named by a save without being read (known
            ``(page, generation)``).
        write_seconds: wall time of snapshot writes (reading the pool,
            hashing, writing, fsync), seconds.
        write_cpu_seconds: CPU time of the writer thread in them, seconds.
        pages_swept: page files removed as unreferenced.
    """

    pages_written: int = 0
    bytes_written: int = 0
    pages_hashed: int = 0
    pages_reused: int = 0
    write_seconds: float = 0.0
    write_cpu_seconds: float = 0.0
    pages_swept: int = 0


class PageFiles:
    """The page files of one model's snapshot folder, and the map of pool
    pages already stored.

    Args:
        pool: the model's page pool (its geometry and dtype fix the file size).
    """

    def __init__(self, pool: PagePool) -> None:
        self.pool = pool
        layers, _, heads, width = pool.k.shape
        #: shape of one page's ``k`` (or ``v``) in a page file
        self.page_shape = (layers, pool.page_size, heads, width)
        self.page_bytes = 2 * layers * pool.page_size * heads * width * pool.k.element_size()
        self.stats = PageWriteStats()
        self._lock = threading.Lock()
        self._known: dict[int, tuple[int, str]] = {}  # pool page -> (generation, page file id)
        self._sync_pool: ThreadPoolExecutor | None = None

    def _syncer(self) -> ThreadPoolExecutor:
        """Threads that fsync a save's page files together (started on first use)."""
        if self._sync_pool is None:
            self._sync_pool = ThreadPoolExecutor(4, thread_name_prefix="tartlet-snapshot-fsync")
        return self._sync_pool

    def close(self) -> None:
        """Stop the fsync threads (idempotent; a later save starts them again)."""
        pool, self._sync_pool = self._sync_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    @staticmethod
    def folder(user_dir: Path) -> Path:
        return user_dir / PAGES_DIR

    def path(self, user_dir: Path, blob: str) -> Path:
        return user_dir / PAGES_DIR / f"{blob}.kv"

    # -- the pool-page map --------------------------------------------------------
    def remember(self, pages: list[int], gens: list[int], blobs: list[str]) -> None:
        """Record that pool page ``pages[i]`` at generation ``gens[i]`` is stored as ``blobs[i]``."""
        with self._lock:
            for p, g, b in zip(pages, gens, blobs):
                self._known[p] = (g, b)

    def forget(self, blobs: set[str]) -> None:
        """Drop the map entries naming these (deleted) page files."""
        if not blobs:
            return
        with self._lock:
            for p in [p for p, (_, b) in self._known.items() if b in blobs]:
                del self._known[p]

    def _lookup(self, pages: list[int], gens: list[int]) -> list[str | None]:
        with self._lock:
            out: list[str | None] = []
            for p, g in zip(pages, gens):
                hit = self._known.get(p)
                out.append(hit[1] if hit is not None and hit[0] == g else None)
            return out

    # -- save ---------------------------------------------------------------------
    def store(self, user_dir: Path, pages: list[int], full: int, tail: int, shared: bool) -> tuple[list[str], list[int]]:
        """Make sure a page file exists for each pool page in ``pages`` (the
        snapshot's live pages in order; the first ``full`` of them are full
        and immutable while the caller holds them; a last, partly filled one
        holding ``tail`` tokens is always read, its unused rows stored as
        zeros). Returns the page file ids and the pages' generations (for
        :meth:`remember` once the snapshot file is in).

        Raises:
            OSError: a page file could not be written.
        """
        gens = self.pool.generations(pages)
        ids = self._lookup(pages[:full], gens[:full]) + [None] * (len(pages) - full)
        miss = [i for i, b in enumerate(ids) if b is None]
        self.stats.pages_reused += len(pages) - len(miss)
        private_dir(self.folder(user_dir))
        if shared:  # keep what is reused young for other replicas' sweeps; re-store what vanished
            gone = [i for i, b in enumerate(ids) if b is not None and not _touch(self.path(user_dir, b))]
            miss = sorted(miss + gone)
        if miss:
            fill = [PS_FULL if i < full else tail for i in miss]
            for i, blob in zip(miss, self._write(user_dir, [pages[i] for i in miss], fill, shared)):
                ids[i] = blob
        return [b for b in ids if b is not None], gens

    def check_present(self, user_dir: Path, pages: list[int], ids: list[str], full: int, tail: int) -> None:
        """Shared folder, after the snapshot file is in: rewrite (from the
        pool) any page file another replica's sweep removed meanwhile.

        Raises:
            OSError: it could not be rewritten; SnapshotError: the page no
                longer holds those bytes.
        """
        gone = [i for i, b in enumerate(ids) if not self.path(user_dir, b).exists()]
        fill = [PS_FULL if i < full else tail for i in gone]
        if gone and self._write(user_dir, [pages[i] for i in gone], fill, True) != [ids[i] for i in gone]:
            raise SnapshotError("a page changed while its snapshot was written")

    def _write(self, user_dir: Path, pages: list[int], fill: list[int], shared: bool) -> list[str]:
        """Read ``pages`` from the pool (of page ``i``, the first ``fill[i]``
        rows; :data:`PS_FULL`: all), hash them and write the page files not
        on disk yet; returns their ids."""
        pool, ps = self.pool, self.pool.page_size
        rows = (torch.tensor(pages, dtype=torch.long)[:, None] * ps + torch.arange(ps)).reshape(-1)
        n = len(pages)
        # [pages, 2, layers, ps, heads, width] as bytes: one page's file is one contiguous slice
        kv = torch.stack([pool.k[:, rows.to(pool.k.device)], pool.v[:, rows.to(pool.v.device)]])
        kv = kv.view(2, kv.shape[1], n, ps, *kv.shape[3:]).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        for i, rows_used in enumerate(fill):
            if 0 <= rows_used < ps:
                kv[i, :, :, rows_used:] = 0  # a partly filled page: its unused rows hold whatever the page held before
        raw = kv.view(torch.uint8).reshape(n, -1).numpy()
        self.stats.pages_hashed += n
        ids = [hashlib.sha256(raw[i]).hexdigest() for i in range(n)]
        written: list[Path] = []
        tmps: list[tuple[Path, Path]] = []
        fds: list[int] = []
        try:
            for i, blob in enumerate(ids):
                path = self.path(user_dir, blob)
                if (_touch(path) if shared else path.exists()) or any(p == path for _, p in tmps):
                    continue
                tmp = path.with_name(f"{blob}.{uuid.uuid4().hex[:16]}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                fds.append(fd)
                tmps.append((tmp, path))
                view = memoryview(raw[i])
                while view:
                    view = view[os.write(fd, view) :]
            if len(fds) > 1:  # concurrent fsyncs share the file system's journal commits
                list(self._syncer().map(os.fsync, fds))
            elif fds:
                os.fsync(fds[0])
            for tmp, path in tmps:
                os.replace(tmp, path)
                written.append(tmp)
        finally:
            for fd in fds:
                os.close(fd)
            for tmp, _ in tmps:
                if tmp not in written:
                    tmp.unlink(missing_ok=True)
        if tmps:
            fsync_dir(self.folder(user_dir))
            self.stats.pages_written += len(tmps)
            self.stats.bytes_written += len(tmps) * self.page_bytes
        return ids

    # -- load ---------------------------------------------------------------------
    def load(self, user_dir: Path, ids: list[str], name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The KV of the page files ``ids`` of snapshot ``name``, as
        ``k, v`` tensors ``[layers, len(ids) * page_size, kv_heads, width]``
        in the pool's dtype (on the CPU).

        Raises:
            SnapshotError: a page file is missing, unreadable, of the wrong
                size or its bytes do not match its name.
        """
        n = len(ids)
        buf = torch.empty((n, self.page_bytes), dtype=torch.uint8)
        view = buf.numpy()
        for i, blob in enumerate(ids):
            try:
                with open(self.path(user_dir, blob), "rb") as f:
                    got = f.readinto(memoryview(view[i]))
                    extra = f.read(1)
            except FileNotFoundError:
                raise SnapshotError(f"snapshot {name!r} is corrupt: its page file {blob[:16]}... is missing") from None
            except OSError as e:
                raise SnapshotError(f"snapshot {name!r} is corrupt: its page file {blob[:16]}... is unreadable ({type(e).__name__})") from None
            if got != self.page_bytes or extra or hashlib.sha256(view[i]).hexdigest() != blob:
                raise SnapshotError(f"snapshot {name!r} is corrupt: its page file {blob[:16]}... does not match its checksum")
        layers, ps, heads, width = self.page_shape
        kv = buf.view(self.pool.k.dtype).view(n, 2, layers, ps, heads, width)
        k = kv[:, 0].permute(1, 0, 2, 3, 4).reshape(layers, n * ps, heads, width)
        v = kv[:, 1].permute(1, 0, 2, 3, 4).reshape(layers, n * ps, heads, width)
        return k, v

    # -- delete -------------------------------------------------------------------
    def sweep(self, user_dir: Path, referenced: set[str], grace_s: float = 0.0) -> int:
        """Remove the page files of ``user_dir`` not in ``referenced`` (and
        stray temporary files) whose mtime is at least ``grace_s`` seconds
        old; returns how many page files went."""
        folder = self.folder(user_dir)
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return 0
        gone: set[str] = set()
        for e in entries:
            blob, _, ext = e.name.partition(".")
            if ext == "kv" and blob in referenced:
                continue
            if ext != "kv" and not e.name.endswith(".tmp"):
                continue
            try:
                if grace_s > 0 and time.time() - os.stat(e.path).st_mtime < grace_s:  # stat now, not scandir's cached one
                    continue
                os.unlink(e.path)
            except OSError as err:
                if err.errno != errno.ENOENT:
                    log.warning("could not remove page file %s: %s", e.path, err)
                continue
            if ext == "kv":
                gone.add(blob)
        self.forget(gone)
        self.stats.pages_swept += len(gone)
        return len(gone)


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) readable by the server's user only (mode 0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (best effort: not every file system
    lets a folder be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _touch(path: Path) -> bool:
    """Set ``path``'s mtime to now; False if it is not there."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


def file_size(path: Path) -> int:
    """``path``'s size in bytes (0 when it is gone)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def partial_tail(n_tokens: int, live: list[int], page_size: int) -> int:
    """1 when the last live page of a page table (``live``: 1 per live
    entry) holding ``n_tokens`` is partly filled (always read afresh), else 0."""
    return 1 if n_tokens % page_size and live and live[-1] else 0


def over_budget(files: list[tuple[T, int, tuple[str, ...]]], page_bytes: int, budget: int, keep: T) -> list[T]:
    """Which snapshots to delete, least recently used first, until one
    user's disk use is within ``budget`` bytes: ``files`` are ``(snapshot,
    its file's size, its page file ids)`` oldest first; a page file shared by
    several snapshots counts once and is freed with the last of them;
    ``keep`` is never chosen."""
    counts: dict[str, int] = {}
    for _, _, blobs in files:
        for b in set(blobs):
            counts[b] = counts.get(b, 0) + 1
    total = sum(size for _, size, _ in files) + len(counts) * page_bytes
    out = []
    for snap, size, blobs in files:
        if total <= budget:
            break
        if snap is keep:
            continue
        out.append(snap)
        total -= size
        for b in set(blobs):
            counts[b] -= 1
            if counts[b] == 0:
                total -= page_bytes
    return out


def install(seq: Sequence, data: "SnapshotFile") -> list[int]:
    """Allocate pages for a snapshot read from disk (a
    :class:`~tartlet.host.snapshot_store.SnapshotFile` with ``k`` and
    ``v``), copy its KV in and fill ``seq`` (scheduler thread). A pure
    snapshot's full pages also seed the prefix cache. Returns the pages
    allocated, in order (a page the prefix cache had already is released
    and replaced in ``seq.pages``).

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
    return pages
