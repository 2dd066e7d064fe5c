"""Programs uploaded by clients, content-hashed and cached on disk.

An upload is a dict ``{relative path: text}`` (an inferlet folder, or one
``main.py``). It is stored once under ``<upload_dir>/<hex digest>/`` and
launched by its hash (:func:`tartlet.protocol.program_hash`), so a
client sends a program's bytes only the first time. ``[programs]
uploaded_runtime`` says how they run: built into a WASM component and
sandboxed (the default), or natively.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib
import unicodedata
from pathlib import Path

from ..protocol import ProtocolError, program_hash
from ..runtime.program import Program, load_program
from ..sdk.errors import ProgramError

#: Most files in one upload.
MAX_FILES = 256
#: Longest path in an upload, characters.
MAX_PATH_CHARS = 512
#: Longest component of a path (a file or folder name), bytes of UTF-8.
MAX_NAME_BYTES = 255
#: Deepest folder nesting in an upload.
MAX_PATH_PARTS = 16


def _bad(message: str) -> ProtocolError:
    return ProtocolError("bad_request", message)


def check_upload(files: object, max_bytes: int) -> dict[str, str]:
    """Validate an upload before anything is written.

    Rules: a non-empty object of at most :data:`MAX_FILES` ``{path: text}``
    entries, UTF-8 encodable (no lone surrogates); each path relative,
    ``/``-separated, at most :data:`MAX_PATH_CHARS` characters and
    :data:`MAX_PATH_PARTS` parts, each part at most :data:`MAX_NAME_BYTES`
    bytes, with no empty, ``.`` or ``..`` part, no part starting with ``.``,
    no backslash, NUL or other control character; no two paths equal after
    Unicode normalisation and case folding, and no path both a file and a
    folder; a ``main.py`` or an ``inferlet.toml`` whose ``entry`` is one of
    the files. Messages quote at most 80 characters of a path.

    Returns:
        ``files`` itself.

    Raises:
        ProtocolError: ``bad_request`` naming the rule and the path,
            ``too_large`` (over ``max_bytes`` in all).
    """
    if not isinstance(files, dict) or not files or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise _bad("upload `files` must be a non-empty object of {relative path: text}")
    if len(files) > MAX_FILES:
        raise _bad(f"an upload has at most {MAX_FILES} files, got {len(files)}")
    size = 0
    for k, v in files.items():
        try:
            size += len(k.encode()) + len(v.encode())
        except UnicodeEncodeError:
            raise _bad(f"upload entry {k!r:.80} is not valid Unicode text (a lone surrogate)") from None
        if size > max_bytes:
            raise ProtocolError("too_large", f"upload is larger than the limit of {max_bytes} bytes")
    seen: dict[str, str] = {}
    folders: set[str] = set()
    for name in files:
        where = f"{name!r:.80}"
        if len(name) > MAX_PATH_CHARS:
            raise _bad(f"unsafe path in upload: {where}: longer than {MAX_PATH_CHARS} characters")
        if any(ord(c) < 32 or ord(c) == 127 for c in name):
            raise _bad(f"unsafe path in upload: {where}: it contains NUL or another control character")
        if "\\" in name or name.startswith("/"):
            raise _bad(f"unsafe path in upload: {where}: paths are relative and '/'-separated")
        parts = name.split("/")
        if len(parts) > MAX_PATH_PARTS:
            raise _bad(f"unsafe path in upload: {where}: nested deeper than {MAX_PATH_PARTS} parts")
        for part in parts:
            if not part or part in (".", "..") or part.startswith("."):
                raise _bad(f"unsafe path in upload: {where}: empty, '.', '..' or hidden part")
            if len(part.encode()) > MAX_NAME_BYTES:
                raise _bad(f"unsafe path in upload: {where}: a name longer than {MAX_NAME_BYTES} bytes")
        key = unicodedata.normalize("NFC", name).casefold()
        if key in seen:
            raise _bad(f"upload paths {seen[key]!r:.80} and {where} clash (same name up to case or Unicode form)")
        seen[key] = name
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    for folder in folders:
        key = unicodedata.normalize("NFC", folder).casefold()
        if key in seen:
            raise _bad(f"upload path {seen[key]!r:.80} is both a file and a folder")
    entry = "main.py"
    if "inferlet.toml" in files:
        try:
            manifest = tomllib.loads(files["inferlet.toml"])
        except tomllib.TOMLDecodeError as e:
            raise _bad(f"inferlet.toml: invalid TOML: {e}") from None
        entry = manifest.get("entry", "main.py")
        if not isinstance(entry, str) or entry not in files or not entry.endswith(".py"):
            raise _bad(f"inferlet.toml: `entry` must name an uploaded .py file, got {entry!r:.80}")
        if not isinstance(manifest.get("name", ""), str):
            raise _bad("inferlet.toml: `name` must be a string")
    elif "main.py" not in files:
        raise _bad("an upload needs a main.py (or an inferlet.toml naming its entry)")
    return files


class ProgramCache:
    """Uploaded programs by hash.

    Folders are created 0700 and files 0600 (only the server's user reads
    uploads). Each upload is written to a temporary folder and renamed into
    place, so a failed or concurrent write never leaves a partial program;
    temporary folders left by a crash are removed when the cache opens.

    Args:
        root: the cache folder.
        max_bytes: largest upload (all files), bytes.
    """

    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        if self.root.is_dir():
            for stale in self.root.glob(".tmp-*"):
                shutil.rmtree(stale, ignore_errors=True)

    def add(self, files: object) -> str:
        """Store an upload; returns its hash (the same files give the same hash).

        Raises:
            ProtocolError: ``bad_request`` (see :func:`check_upload`; or the
                server could not write it), ``too_large``.
        """
        check_upload(files, self.max_bytes)
        assert isinstance(files, dict)
        h = program_hash(files)
        dest = self.root / h.split(":", 1)[1]
        if dest.exists():
            return h
        tmp = None
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=self.root))  # 0700
            for name, text in files.items():
                f = tmp / name
                f.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with open(fd, "w", encoding="utf-8", newline="") as out:
                    out.write(text)
            try:
                tmp.replace(dest)
                tmp = None
            except OSError:
                if not dest.is_dir():  # not a concurrent upload of the same files that won
                    raise
        except OSError as e:
            raise _bad(f"the server could not store the upload ({e.strerror or type(e).__name__})") from None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        return h
    def get(self, h: str) -> Program:
        """The program stored under hash ``h``.

        Raises:
            ProtocolError: ``unknown_program`` (not uploaded yet: upload it),
                ``bad_request`` (it does not load).
        """
        if not isinstance(h, str) or not h.startswith("sha256:") or len(h) != 71 or not all(c in "0123456789abcdef" for c in h[7:]):
            raise ProtocolError("bad_request", f"a program hash looks like 'sha256:<hex>', got {h!r:.80}")
        dest = self.root / h[7:]
        if not dest.is_dir():
            raise ProtocolError("unknown_program", f"program {h} is not cached on this server; upload it first")
        try:
            return load_program(dest)
        except ProgramError as e:
            raise ProtocolError("bad_request", str(e).replace(str(dest), "<upload>")) from None
