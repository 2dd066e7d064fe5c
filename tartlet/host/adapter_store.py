"""Users' LoRA adapters on disk: they are served again after a restart.

One folder per adapter, in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``, :mod:`tartlet.engine.loading.adapter_writer`:
``peft`` loads it as it is), plus ``tartlet_adapter.json`` naming its owner,
its name and the model (``format`` ``tartlet-adapter/1``). An adapter
uploaded as a llama.cpp GGUF LoRA is stored in that same form.

Layout: ``<root>/<model dir>/<sha256(owner)[:16]>/<sha256(name)[:40]>/``
(the model dir as the snapshot files', :mod:`.snapshot_store`); folders are
0700 and files 0600. A folder is written whole under a temporary name
(``.tmp-*``) and renamed into place, and removed by a rename to a temporary
name first, so a crash leaves the old state or the new one; temporary
folders are removed when the store opens.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..engine.core.engine import Engine
from ..engine.loading.adapter_writer import WEIGHTS_FILE, save_peft
from ..engine.models.lora import ModuleLora
from .snapshot_store import fsync_dir, private_dir

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
    """

    owner: str
    name: str
    path: Path
    weight_bytes: int


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

    def path_for(self, owner: str, name: str) -> Path:
        """The folder of ``owner``'s adapter ``name``."""
        user = hashlib.sha256(owner.encode()).hexdigest()[:16]
        return self.dir / user / hashlib.sha256(name.encode()).hexdigest()[:40]

    def write(self, owner: str, name: str, parts: dict[tuple[int, str], ModuleLora]) -> Path:
        """Write ``owner``'s adapter ``name`` (a folder that must not exist
        yet) atomically; returns its folder.

        Raises:
            FileExistsError: the folder exists (the name is taken on disk).
            OSError: a write failed (nothing is left behind).
        """
        dest = self.path_for(owner, name)
        private_dir(dest.parent)
        tmp = dest.parent / f".tmp-{uuid.uuid4().hex[:16]}"
        try:
            private_dir(tmp)
            save_peft(parts, tmp, base_model=self.model)
            (tmp / META_FILE).write_text(json.dumps({"format": FORMAT, "owner": owner, "name": name, "model": self.model}))
            for f in tmp.iterdir():
                os.chmod(f, 0o600)
            if dest.exists():
                raise FileExistsError(f"adapter folder for {name!r} exists")
            os.rename(tmp, dest)
            fsync_dir(dest.parent)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return dest

    def delete(self, path: Path) -> None:
        """Remove the adapter folder at ``path`` (renamed away first, so a
        crash never leaves half a folder under the adapter's name)."""
        gone = path.parent / f".tmp-{uuid.uuid4().hex[:16]}"
        try:
            os.rename(path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)

    def scan(self) -> list[StoredAdapter]:
        """Every adapter folder under this model's folder; removes leftover
        temporary folders and logs (and skips) unreadable ones."""
        from safetensors import safe_open

        found = []
        for path in sorted(self.dir.glob("*/*")):
            if path.name.startswith(".tmp-"):
                shutil.rmtree(path, ignore_errors=True)
                continue
            try:
                meta = json.loads((path / META_FILE).read_text())
                if meta.get("format") != FORMAT or not isinstance(meta.get("owner"), str) or not isinstance(meta.get("name"), str):
                    raise ValueError(f"{META_FILE} is not a {FORMAT} record")
                with safe_open(str(path / WEIGHTS_FILE), framework="pt") as f:
                    n = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
                found.append(StoredAdapter(meta["owner"], meta["name"], path, 4 * n))
            except Exception as e:  # a damaged folder: JSON, safetensors or OS errors
                log.warning("skipping adapter folder %s: %s", path, e)
        return found


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
