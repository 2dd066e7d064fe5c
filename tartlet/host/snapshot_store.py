"""Named KV snapshots on disk: they survive a restart or a crash.

One file per snapshot, in safetensors format (https://github.com/huggingface/safetensors):
tensors ``k`` and ``v`` of shape ``[num_layers, live_pages * page_size,
num_kv_heads, head_dim]`` in the pool's dtype (the KV of the snapshot's live
pages, in page-table order; an int8 pool's rows are ``head_dim + 4`` bytes,
each row's quants then its float32 scale, see :mod:`tartlet.engine.core.kv_quant`),
and string metadata:

=============  ===========================================================
``format``     ``tartlet-kv-snapshot/1``
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
               the bytes of ``k`` then ``v``
=============  ===========================================================

Layout: ``<root>/<model dir>/<sha256(owner)[:16]>/<sha256(name)[:40]>.safetensors``;
folders are created 0700 and files 0600, written to a temporary file and
renamed, so a crash leaves either the old state or the new one (stray
``.tmp`` files are removed at start).

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

log = logging.getLogger(__name__)

FORMAT = "tartlet-kv-snapshot/1"

#: ``(inode, size, mtime ns)`` of a file: changes whenever the file is
#: replaced (a rename brings a new inode) or touched
FileStamp = tuple[int, int, int]


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


def _digest(meta: dict[str, str], k: torch.Tensor, v: torch.Tensor) -> str:
    h = hashlib.sha256(json.dumps({a: b for a, b in meta.items() if a != "sha256"}, sort_keys=True).encode())
    for t in (k, v):
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def private_dir(path: Path) -> None:
    """Create ``path`` (and its parents) readable by the server's user only (mode 0700)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


class SnapshotStore:
    """The snapshot files of one served model.

    Args:
        root: the snapshots folder of the data dir.
        engine: the model (its name picks the subfolder, its identity is
            stamped on every file).
        budget_bytes: disk bytes one user's snapshot files may take; the
            least recently used are deleted past it (None: unlimited).
    """

    def __init__(self, root: Path, engine: Engine, budget_bytes: int | None = None) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine.name)[:80] or "model"
        self.dir = Path(root) / f"{safe}-{hashlib.sha256(engine.name.encode()).hexdigest()[:8]}"
        self.identity = model_identity(engine)
        self.budget_bytes = budget_bytes
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
        """Write ``snap`` (with ``k`` and ``v`` set) atomically; returns its path.

        Raises:
            OSError: the disk write failed (nothing is left behind).
        """
        from safetensors.torch import save_file

        assert snap.k is not None and snap.v is not None
        meta = {
            "format": FORMAT,
            "model": self.identity,
            "owner": snap.owner,
            "name": snap.name,
            "tokens": json.dumps(snap.tokens),
            "positions": json.dumps(snap.positions),
            "masked": bytes(snap.masked).hex(),
            "live": json.dumps(snap.live),
            "pure": "1" if snap.pure else "0",
        }
        meta["sha256"] = _digest(meta, snap.k, snap.v)
        snap.sha256 = meta["sha256"]
        path = self.path_for(snap.owner, snap.name)
        private_dir(path.parent)
        tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:16]}.tmp")  # unique: replicas may save one name at once
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.close(fd)
            save_file({"k": snap.k.contiguous(), "v": snap.v.contiguous()}, str(tmp), metadata=meta)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
                snap.stamp = file_stamp(os.fstat(f.fileno()))  # a rename keeps inode, size and mtime
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
                if meta.get("format") != FORMAT:
                    raise SnapshotError(f"snapshot file {path.name} is not a {FORMAT} file")
                out = SnapshotFile(
                    owner=meta["owner"], name=meta["name"], tokens=json.loads(meta["tokens"]),
                    positions=json.loads(meta["positions"]), masked=bytes.fromhex(meta["masked"]),
                    live=json.loads(meta["live"]), pure=meta["pure"] == "1",
                    sha256=meta.get("sha256", ""), stamp=stamp,
                )  # fmt: skip
                if tensors:
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
            assert out.k is not None and out.v is not None
            if _digest(meta, out.k, out.v) != meta.get("sha256"):
                raise SnapshotError(f"snapshot {out.name!r} is corrupt: its checksum does not match its contents")
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
            except (SnapshotError, OSError) as e:
                log.warning("skipping snapshot file %s: %s", path, e)
        return found


def _file_name(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:40] + ".safetensors"


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


def _diff(saved: str, here: str) -> str:
    a, b = json.loads(saved), json.loads(here)
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    return ", ".join(f"{k}: saved {a.get(k)!r}, here {b.get(k)!r}" for k in keys[:3]) or "identity differs"
