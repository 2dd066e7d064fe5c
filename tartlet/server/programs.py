"""Programs uploaded by clients, content-hashed and cached on disk.

An upload is a dict ``{relative path: text}`` (an inferlet folder, or one
``main.py``). It is stored once under ``<upload_dir>/<hex digest>/`` and
launched by its hash (:func:`tartlet.server.protocol.program_hash`), so a
client sends a program's bytes only the first time. ``[programs]
uploaded_runtime`` says how they run: built into a WASM component and
sandboxed (the default), or natively.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..runtime.program import Program, ProgramError, load_program
from .protocol import ProtocolError, program_hash


class ProgramCache:
    """Uploaded programs by hash.

    Args:
        root: the cache folder.
        max_bytes: largest upload (all files), bytes.
    """

    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    def add(self, files: object) -> str:
        """Store an upload; returns its hash (the same files give the same hash).

        Raises:
            ProtocolError: ``bad_request`` (not a {path: text} dict, unsafe
                path, no entry file), ``too_large``.
        """
        if not isinstance(files, dict) or not files or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ProtocolError("bad_request", "upload `files` must be a non-empty object of {relative path: text}")
        size = sum(len(k.encode()) + len(v.encode()) for k, v in files.items())
        if size > self.max_bytes:
            raise ProtocolError("too_large", f"upload of {size} bytes is larger than the limit of {self.max_bytes}")
        for name in files:
            p = PurePosixPath(name)
            if p.is_absolute() or ".." in p.parts or not p.parts or "\\" in name or name.startswith("."):
                raise ProtocolError("bad_request", f"unsafe path in upload: {name!r}")
        if "inferlet.toml" not in files and "main.py" not in files:
            raise ProtocolError("bad_request", "an upload needs a main.py (or an inferlet.toml naming its entry)")
        h = program_hash(files)
        dest = self.root / h.split(":", 1)[1]
        if not dest.exists():
            tmp = dest.with_name(dest.name + ".tmp")
            for name, text in files.items():
                f = tmp / name
                f.parent.mkdir(parents=True, exist_ok=True)
                f.write_text(text)
            tmp.replace(dest)
        return h

    def get(self, h: str) -> Program:
        """The program stored under hash ``h``.

        Raises:
            ProtocolError: ``unknown_program`` (not uploaded yet: upload it),
                ``bad_request`` (it does not load).
        """
        if not isinstance(h, str) or not h.startswith("sha256:") or not h[7:].isalnum():
            raise ProtocolError("bad_request", f"a program hash looks like 'sha256:<hex>', got {h!r:.80}")
        dest = self.root / h[7:]
        if not dest.is_dir():
            raise ProtocolError("unknown_program", f"program {h} is not cached on this server; upload it first")
        try:
            return load_program(dest)
        except ProgramError as e:
            raise ProtocolError("bad_request", str(e)) from None
