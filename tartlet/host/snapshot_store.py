"""Named KV snapshots on disk: they survive a restart or a crash.

One file per snapshot, in safetensors format (https://github.com/huggingface/safetensors),
with string metadata:

=============  ===========================================================
``format``     ``tartlet-kv-snapshot/2`` (written now) or
               ``tartlet-kv-snapshot/1`` (still read)
``model``      the model identity (JSON, see :func:`model_identity`)
``owner``      the user that saved it
``name``       the snapshot name
``tokens``     JSON list of token ids
``positions``  JSON list of RoPE positions
``masked``     hex of one byte per token (1 = hidden from attention)
``live``       JSON list, per page table entry, 1 = has KV in the file,
               0 = dropped page
``pure``       ``1`` when the pages may seed the prefix cache
``sha256``     hex SHA-256 of the other metadata fields (sorted JSON) and
               the bytes of the file's tensors in the order below
=============  ===========================================================

``/2`` files hold one tensor, ``pages``: uint8 ``[live_pages, 32]``, per
live page in page-table order the SHA-256 (raw bytes) naming its page file
``<user folder>/pages/<hex>.kv``, which holds the page's KV and is shared by
every snapshot of that user holding the same page (layout, reuse without
re-reading, integrity and deletion: :mod:`tartlet.host.snapshot_pages`).
A save writes only the page files not on disk yet, then the snapshot file.

``/1`` files hold tensors ``k`` and ``v`` of shape ``[num_layers,
live_pages * page_size, num_kv_heads, head_dim]`` in the pool's dtype (the KV
of the snapshot's live pages, in page-table order; an int8 pool's rows are
``head_dim + 4`` bytes, each row's quants then its float32 scale, see
:mod:`tartlet.engine.core.kv_quant`).

Layout: ``<root>/<model dir>/<sha256(owner)[:16]>/<sha256(name)[:40]>.safetensors``;
folders are created 0700 and files 0600, written to a temporary file and
renamed (page files first), so a crash leaves either the old state or the
new one, plus at worst page files no snapshot names (stray ``.tmp`` files
and those are removed at start).

Several servers (replicas) may share one folder: a file is replaced only by
an atomic rename, so a reader sees a whole old file or a whole new one, and
its ``sha256`` tells one version of a name from another (see
:meth:`SnapshotStore.find` and :meth:`SnapshotStore.user_dirs`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from ..engine.core.engine import Engine
from ..sdk.errors import SnapshotError
from .snapshot_pages import PageFiles, fsync_dir, private_dir

log = logging.getLogger(__name__)

FORMAT = "tartlet-kv-snapshot/2"
#: the format before page files: the KV in the snapshot file itself (still read; written with ``version=1``)
FORMAT_V1 = "tartlet-kv-snapshot/1"

__all__ = ["FORMAT", "FORMAT_V1", "FileStamp", "SnapshotFile", "SnapshotStore", "file_stamp", "fsync_dir", "model_identity", "private_dir"]

#: ``(inode, size, mtime ns)`` of a file: changes whenever the file is
#: replaced (a rename brings a new inode) or touched
FileStamp = tuple[int, int, int]

#: shared folders (snapshots, adapters): a folder whose mtime is younger
#: than this, ns, is listed again next time (a file added in the same clock
#: tick would not change its mtime)
RACY_MTIME_NS = 2_000_000_000
#: shared folders: a temporary file this old, seconds, is a crashed write,
#: not another replica's write in progress
SHARED_TMP_AGE_S = 3600.0


def file_stamp(st: os.stat_result) -> FileStamp:
    """The :data:`FileStamp` of a ``stat`` result."""
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def model_identity(engine: Engine) -> str:
    """JSON naming everything the KV of a model depends on: its name,
    architecture, weight dtype and quantization, KV dtype and page size. A
    snapshot loads only into a model with the same identity."""
    cfg = engine.cfg
    ident = {
        "model": engine.name,
        "config": {k: v for k, v in dataclasses.asdict(engine.config).items() if k != "name"},
        "dtype": str(cfg.torch_dtype()),
        "quantized": cfg.keeps_quantized(),
        "quantize": cfg.quantize,
        "act_bits": cfg.act_bits if cfg.keeps_quantized() else None,
        "matmul_dtype": engine.model.matmul_dtype,  # as resolved on this CPU
        "kv_dtype": str(engine.pool.k.dtype),
        "page_size": engine.pool.page_size,
    }
    return json.dumps(ident, sort_keys=True, default=str)


@dataclass
class SnapshotFile:
    """What a snapshot file holds, read back.

    Attributes:
        owner, name, tokens, positions, masked, live, pure: as saved.
        k, v: KV tensors ``[layers, sum(live) * page_size, kv_heads, head_dim]``.
        blobs: ``/2`` files: the page file id (hex SHA-256) of each live
            page, in order (header reads too); None for a ``/1`` file.
        sha256: the file's checksum (set by :meth:`SnapshotStore.read` and
            :meth:`SnapshotStore.write`).
        stamp: the file's :data:`FileStamp` when it was read (taken before
            reading) or written.
    """

    owner: str
    name: str
    tokens: list[int]
    positions: list[int]
    masked: bytes
    live: list[int]
    pure: bool
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    sha256: str = ""
    stamp: FileStamp | None = None
    blobs: list[str] | None = None


def _digest(meta: dict[str, str], *tensors: torch.Tensor) -> str:
    h = hashlib.sha256(json.dumps({a: b for a, b in meta.items() if a != "sha256"}, sort_keys=True).encode())
    for t in tensors:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class SnapshotStore:
    """The snapshot files of one served model.

    Args:
        root: the snapshots folder of the data dir.
        engine: the model (its name picks the subfolder, its identity is
            stamped on every file).
        budget_bytes: disk bytes one user's snapshot files and page files
            may take; the least recently used snapshots are deleted past it
            (None: unlimited).

    Attributes:
        pages: the page files (:class:`PageFiles`; its ``stats`` count
            what was written).
        version: the format :meth:`write` writes: 2, or 1 (the KV inside
            the snapshot file, as before page files; for comparisons, also
            set by the environment variable ``TARTLET_SNAPSHOT_FORMAT=1``).
    """

    def __init__(self, root: Path, engine: Engine, budget_bytes: int | None = None) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine.name)[:80] or "model"
        self.dir = Path(root) / f"{safe}-{hashlib.sha256(engine.name.encode()).hexdigest()[:8]}"
        self.identity = model_identity(engine)
        self.budget_bytes = budget_bytes
        self.pages = PageFiles(engine.pool)
        self.version = 1 if os.environ.get("TARTLET_SNAPSHOT_FORMAT") == "1" else 2
        self._heads: dict[Path, tuple[FileStamp, frozenset[str]]] = {}  # snapshot file -> page files it names
        private_dir(Path(root))
        private_dir(self.dir)

    def path_for(self, owner: str, name: str) -> Path:
        """The file of ``owner``'s snapshot ``name`` (a ``public/`` one lives
        in its creator's folder)."""
        user = hashlib.sha256(owner.encode()).hexdigest()[:16]
        return self.dir / user / _file_name(name)

    def user_dirs(self) -> list[Path]:
        """Every user's folder under this model's folder, sorted."""
        try:
            return sorted(p for p in self.dir.iterdir() if p.is_dir())
        except OSError:
            return []

    def find(self, owner: str, name: str) -> tuple[SnapshotFile, Path] | None:
        """The header (no tensors) and path of the file of ``owner``'s
        snapshot ``name`` as it is on disk now, or None when there is none. A
        ``public/`` name is looked for in every user's folder (the newest
        file if two users raced to save it).

        Raises:
            SnapshotError: the file is there but its header is unreadable.
        """
        from .snapshots import PUBLIC_PREFIX

        public = name.startswith(PUBLIC_PREFIX)
        paths = sorted(self.dir.glob(f"*/{_file_name(name)}")) if public else [self.path_for(owner, name)]
        best: tuple[SnapshotFile, Path] | None = None
        for path in paths:
            try:
                head = self.read(path, tensors=False)
            except SnapshotError:
                if not path.exists():
                    continue  # deleted meanwhile
                raise
            if head.name != name or (not public and head.owner != owner):
                continue
            if best is None or (head.stamp or (0, 0, 0))[2] > (best[0].stamp or (0, 0, 0))[2]:
                best = (head, path)
        return best

    # -- write ---------------------------------------------------------------------
    def write(self, snap: SnapshotFile) -> Path:
        """Write ``snap`` atomically; returns its path. With ``blobs`` set
        (its page files already written, :meth:`PageFiles.store`), a ``/2``
        file; else (``k`` and ``v`` set) a ``/1`` file.

        Raises:
            OSError: the disk write failed (nothing is left behind).
        """
        from safetensors.torch import save_file

        meta = {
            "format": FORMAT if snap.blobs is not None else FORMAT_V1,
            "model": self.identity,
            "owner": snap.owner,
            "name": snap.name,
            "tokens": json.dumps(snap.tokens),
            "positions": json.dumps(snap.positions),
            "masked": bytes(snap.masked).hex(),
            "live": json.dumps(snap.live),
            "pure": "1" if snap.pure else "0",
        }
        if snap.blobs is not None:
            tensors = {"pages": torch.tensor([list(bytes.fromhex(b)) for b in snap.blobs], dtype=torch.uint8).reshape(-1, 32)}
        else:
            assert snap.k is not None and snap.v is not None
            tensors = {"k": snap.k.contiguous(), "v": snap.v.contiguous()}
        meta["sha256"] = _digest(meta, *tensors.values())
        snap.sha256 = meta["sha256"]
        path = self.path_for(snap.owner, snap.name)
        private_dir(path.parent)
        tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:16]}.tmp")  # unique: replicas may save one name at once
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
            save_file(tensors, str(tmp), metadata=meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
                snap.stamp = file_stamp(os.fstat(f.fileno()))  # a rename keeps inode, size and mtime
            self.pages.stats.bytes_written += snap.stamp[1]
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return path

    def delete(self, path: Path | None) -> None:
        """Remove the file at ``path`` if it is there (None: nothing)."""
        if path is not None:
            path.unlink(missing_ok=True)

    def referenced(self, user_dir: Path) -> set[str] | None:
        """The page files named by the snapshot files in ``user_dir`` now
        (headers are re-read only for files changed since the last call);
        None when a file there could not be read (a sweep must not run on a
        partial answer)."""
        out: set[str] = set()
        seen: set[Path] = set()
        try:
            paths = list(user_dir.glob("*.safetensors"))
        except OSError:
            return None
        for path in paths:
            try:
                stamp = file_stamp(path.stat())
            except FileNotFoundError:
                continue
            except OSError:
                return None
            seen.add(path)
            cached = self._heads.get(path)
            if cached is None or cached[0] != stamp:
                try:
                    head = self.read(path, tensors=False)
                except SnapshotError:
                    if not path.exists():
                        continue
                    log.warning("snapshot file %s is unreadable: its user's page files are not swept", path)
                    return None
                cached = (stamp, frozenset(head.blobs or ()))
                self._heads[path] = cached
            out |= cached[1]
        for path in [p for p in self._heads if p.parent == user_dir and p not in seen]:
            del self._heads[path]
        return out

    def sweep(self, user_dir: Path, grace_s: float = 0.0) -> int:
        """Remove the page files of ``user_dir`` that no snapshot file there
        names and older than ``grace_s`` seconds (see
        :mod:`tartlet.host.snapshot_pages`); returns how many went."""
        refs = self.referenced(user_dir)
        return 0 if refs is None else self.pages.sweep(user_dir, refs, grace_s)

    # -- read ----------------------------------------------------------------------
    def read(self, path: Path, tensors: bool = True) -> SnapshotFile:
        """Read a snapshot file (the header only when ``tensors`` is False).

        Raises:
            SnapshotError: the file is missing, unreadable, corrupt (checksum
                mismatch) or was saved with another model.
        """
        from safetensors import safe_open

        try:
            stamp = file_stamp(os.stat(path))  # before reading: a later replace shows as a changed stamp
        except FileNotFoundError:
            raise SnapshotError(f"snapshot file {path.name} is missing") from None
        except OSError as e:
            raise SnapshotError(f"snapshot file {path.name} is unreadable ({type(e).__name__})") from None
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                v2 = meta.get("format") == FORMAT
                if not v2 and meta.get("format") != FORMAT_V1:
                    raise SnapshotError(f"snapshot file {path.name} is not a {FORMAT} file")
                out = SnapshotFile(
                    owner=meta["owner"], name=meta["name"], tokens=json.loads(meta["tokens"]),
                    positions=json.loads(meta["positions"]), masked=bytes.fromhex(meta["masked"]),
                    live=json.loads(meta["live"]), pure=meta["pure"] == "1",
                    sha256=meta.get("sha256", ""), stamp=stamp,
                )  # fmt: skip
                if v2:
                    ids = f.get_tensor("pages")
                    out.blobs = [bytes(row).hex() for row in ids.tolist()]
                elif tensors:
                    out.k, out.v = f.get_tensor("k"), f.get_tensor("v")
        except SnapshotError:
            raise
        except Exception as e:  # safetensors, JSON or key errors: a damaged file
            raise SnapshotError(f"snapshot file {path.name} is unreadable or corrupt ({type(e).__name__})") from None
        if tensors:
            if meta["model"] != self.identity:
                raise SnapshotError(
                    f"snapshot {out.name!r} was saved with another model or settings "
                    f"({_diff(meta['model'], self.identity)}); it cannot be loaded into this one"
                )
            if out.blobs is not None:
                ok = _digest(meta, ids) == meta.get("sha256") and len(out.blobs) == sum(out.live)
            else:
                assert out.k is not None and out.v is not None
                ok = _digest(meta, out.k, out.v) == meta.get("sha256")
            if not ok:
                raise SnapshotError(f"snapshot {out.name!r} is corrupt: its checksum does not match its contents")
            if out.blobs is not None:
                out.k, out.v = self.pages.load(path.parent, out.blobs, out.name)
            assert out.k is not None
            n = len(out.tokens)
            if len(out.positions) != n or len(out.masked) != n or out.k.shape[1] != sum(out.live) * json.loads(self.identity)["page_size"]:
                raise SnapshotError(f"snapshot {out.name!r} is corrupt: its sizes disagree")
        return out

    def scan(self, tmp_age_s: float = 0.0) -> list[tuple[SnapshotFile, Path, float]]:
        """Every readable snapshot header under this model's folder, with its
        path and modification time; removes stray temporary files older than
        ``tmp_age_s`` seconds (when the folder is shared, younger ones may be
        another replica's write in progress) and logs (and skips)
        unreadable files."""
        found = []
        for path in sorted(self.dir.glob("*/*")):
            if path.suffix == ".tmp":
                try:
                    if time.time() - path.stat().st_mtime >= tmp_age_s:
                        path.unlink(missing_ok=True)
                except OSError:
                    pass
                continue
            if path.suffix != ".safetensors":
                continue
            try:
                found.append((self.read(path, tensors=False), path, path.stat().st_mtime))
                if found[-1][0].stamp is not None:  # the first sweep needs no second read
                    self._heads[path] = (found[-1][0].stamp, frozenset(found[-1][0].blobs or ()))
            except (SnapshotError, OSError) as e:
                log.warning("skipping snapshot file %s: %s", path, e)
        return found


def _file_name(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:40] + ".safetensors"


def _diff(saved: str, here: str) -> str:
    a, b = json.loads(saved), json.loads(here)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: saved {a.get(k)!r}, here {b.get(k)!r}" for k in keys[:3]) or "identity differs"
