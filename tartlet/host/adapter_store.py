"""Users' LoRA adapters on disk: they are served again after a restart.

One folder per adapter, in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, :mod:`tartlet.engine.loading.adapter_writer`:
``peft`` loads it as it is), plus ``tartlet_adapter.json`` naming its owner,
its name, the model (``format`` ``tartlet-adapter/1``) and its ``version``
(a random hex string, new at every save: replicas sharing the folder tell
one save of a name from the next by it). An adapter uploaded as a llama.cpp
GGUF LoRA is stored in that same form.

Layout: ``<root>/<model dir>/<sha256(owner)[:16]>/<sha256(name)[:40]>/``
(the model dir as the snapshot files', :mod:`.snapshot_store`); folders are
0700 and files 0600. A folder is written whole under a temporary name
(``.tmp-*``) and renamed into place, and removed by a rename to a temporary
name first, so a crash leaves the old state or the new one; temporary
folders are removed when the store opens (in a folder shared by replicas,
only old ones: a young one is another replica's write in progress). A
folder is never changed in place: a new version of a name is a new folder
renamed in, so a reader that finds the same ``version`` before and after
reading its files read one version.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..engine.core.engine import Engine
from ..engine.loading.adapter_writer import WEIGHTS_FILE, save_peft
from ..engine.models.lora import ModuleLora
from .snapshot_store import file_stamp, fsync_dir, private_dir

log = logging.getLogger(__name__)

FORMAT = "tartlet-adapter/1"
META_FILE = "tartlet_adapter.json"


@dataclass
class StoredAdapter:
    """A user's adapter folder found on disk (its matrices not read).

    Attributes:
        owner, name: whose and what.
        path: the folder.
        weight_bytes: float32 bytes of its ``A`` and ``B`` matrices (from
            the safetensors header).
        version: what tells this save of the name from another (the
            ``version`` of its ``tartlet_adapter.json``; for a folder written
            before versions, the stamp of that file).
    """

    owner: str
    name: str
    path: Path
    weight_bytes: int
    version: str


class AdapterStore:
    """The adapter folders of one served model.

    Args:
        root: the adapters folder of the data dir.
        engine: the model (its name picks the subfolder).

    Raises:
        OSError: the folders cannot be created.
    """

    def __init__(self, root: Path, engine: Engine) -> None:
        safe = re.sub(r"[^A-Za-z0-9._-]", "_", engine.name)[:80] or "model"
        self.dir = Path(root) / f"{safe}-{hashlib.sha256(engine.name.encode()).hexdigest()[:8]}"
        self.model = engine.name
        private_dir(Path(root))
        private_dir(self.dir)

    def user_dir(self, owner: str) -> Path:
        """The folder of ``owner``'s adapters (it may not exist yet)."""
        return self.dir / hashlib.sha256(owner.encode()).hexdigest()[:16]

    def path_for(self, owner: str, name: str) -> Path:
        """The folder of ``owner``'s adapter ``name``."""
        return self.user_dir(owner) / hashlib.sha256(name.encode()).hexdigest()[:40]

    def write(self, owner: str, name: str, parts: dict[tuple[int, str], ModuleLora]) -> StoredAdapter:
        """Write ``owner``'s adapter ``name`` (a folder that must not exist
        yet) atomically, with a new version; returns what was written.

        Raises:
            FileExistsError: the folder exists (the name is taken on disk,
                perhaps by another replica's save a moment ago: the rename
                into place refuses to replace a folder).
            OSError: a write failed (nothing is left behind).
        """
        dest = self.path_for(owner, name)
        private_dir(dest.parent)
        tmp = dest.parent / f".tmp-{uuid.uuid4().hex[:16]}"
        version = uuid.uuid4().hex
        try:
            private_dir(tmp)
            save_peft(parts, tmp, base_model=self.model)
            meta = {"format": FORMAT, "owner": owner, "name": name, "model": self.model, "version": version}
            (tmp / META_FILE).write_text(json.dumps(meta))
            for f in tmp.iterdir():
                os.chmod(f, 0o600)
            if dest.exists():
                raise FileExistsError(f"adapter folder for {name!r} exists")
            try:
                os.rename(tmp, dest)  # onto a folder with files: ENOTEMPTY (or EEXIST), never a replace
            except OSError as e:
                if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    raise FileExistsError(f"adapter folder for {name!r} exists") from None
                raise
            fsync_dir(dest.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        n = sum(m.a.numel() + m.b.numel() for m in parts.values())
        return StoredAdapter(owner, name, dest, 4 * n, version)

    def delete(self, path: Path) -> None:
        """Remove the adapter folder at ``path`` (renamed away first, so a
        crash never leaves half a folder under the adapter's name)."""
        gone = path.parent / f".tmp-{uuid.uuid4().hex[:16]}"
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def version(self, path: Path) -> str | None:
        """The version of the adapter folder at ``path`` now (see
        :class:`StoredAdapter`), or None when it is gone or unreadable."""
        try:
            return _version(_read_meta(path), path)
        except (OSError, ValueError):
            return None

    def read(self, path: Path, sizes: Mapping[str, int] | None = None) -> StoredAdapter:
        """The record of the adapter folder at ``path`` (its matrices not
        read; ``sizes``: weight bytes of versions already read, by version,
        whose safetensors header is not read again).

        Raises:
            OSError: the folder or a file of it is missing or unreadable.
            ValueError: its files are not an adapter record of this store.
        """
        from safetensors import safe_open

        meta = _read_meta(path)
        version = _version(meta, path)
        if sizes is not None and version in sizes:
            return StoredAdapter(meta["owner"], meta["name"], path, sizes[version], version)
        try:
            with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
                n = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
        except OSError:
            raise
        except Exception as e:  # safetensors' own errors: a damaged file
            raise ValueError(f"{WEIGHTS_FILE} is unreadable ({e})") from None
        return StoredAdapter(meta["owner"], meta["name"], path, 4 * n, version)

    def scan(self, tmp_age_s: float = 0.0, owner: str | None = None, sizes: Mapping[str, int] | None = None) -> list[StoredAdapter]:
        """Every adapter folder under this model's folder (``owner``: under
        that user's folder only; ``sizes`` as :meth:`read`); removes
        temporary folders older than ``tmp_age_s`` seconds (younger ones may
        be another replica's write in progress) and logs (and skips)
        unreadable ones."""
        found = []
        paths = self.user_dir(owner).glob("*") if owner is not None else self.dir.glob("*/*")
        for path in sorted(paths):
            if path.name.startswith(".tmp-"):
                try:
                    if time.time() - path.stat().st_mtime >= tmp_age_s:
                        shutil.rmtree(path, ignore_errors=True)
                except OSError:
                    pass
                continue
            try:
                found.append(self.read(path, sizes))
            except FileNotFoundError:
                continue  # deleted meanwhile (renamed away by a delete)
            except (OSError, ValueError) as e:  # a damaged folder
                log.warning("skipping adapter folder %s: %s", path, e)
        return found


def _read_meta(path: Path) -> dict[str, str]:
    """The ``tartlet_adapter.json`` of the folder at ``path``.

    Raises:
        OSError: missing or unreadable.
        ValueError: not a record of this format.
    """
    meta = json.loads((path / META_FILE).read_text())
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or not all(
            isinstance(meta.get(k), str) for k in ("owner", "name")):
        raise ValueError(f"{META_FILE} is not a {FORMAT} record")
    return meta


def _version(meta: dict[str, str], path: Path) -> str:
    v = meta.get("version")
    if isinstance(v, str) and v:
        return v
    return "stamp:%d-%d-%d" % file_stamp(os.stat(path / META_FILE))  # written before versions


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
