"""Server paths out of the error messages that guests and clients see.

An error raised in the host (a file the server could not read, a build that
failed in its cache folder) may carry a path of the server's machine. Such
text goes to sandboxed inferlets (a host call's ``call-error``) and to
clients (launch errors, an instance's ``error``); neither should learn the
server's layout. :func:`redact` replaces every registered folder with a
placeholder such as ``<data>``; the temp folder, the Python installation and
Tartlet's own source folder are registered from the start, the server
registers its data, upload, program and cache folders when it starts
(``Service._register_paths``).
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from pathlib import Path

_lock = threading.Lock()
_places: dict[str, str] = {}  # path -> placeholder
_ordered: list[tuple[str, str]] = []  # longest path first


def register(path: str | Path, placeholder: str) -> None:
    """Replace ``path`` (and its resolved form) by ``placeholder`` in
    :func:`redact`'s output from now on; paths of one character (``/``) are
    ignored."""
    global _ordered
    with _lock:
        for p in {str(path), os.path.realpath(path)}:
            if len(p) > 1:
                _places[p.rstrip(os.sep) or p] = placeholder
        _ordered = sorted(_places.items(), key=lambda kv: len(kv[0]), reverse=True)


def redact(text: str) -> str:
    """``text`` with every registered folder replaced by its placeholder
    (the longest first, so a folder inside another keeps its own name)."""
    for path, placeholder in _ordered:
        if path in text:
            text = text.replace(path, placeholder)
    return text


def paths() -> list[str]:
    """The folders :func:`redact` replaces (for tests and diagnostics)."""
    return [p for p, _ in _ordered]


register(tempfile.gettempdir(), "<tmp>")
register(sys.prefix, "<python>")
register(sys.base_prefix, "<python>")
register(Path(__file__).resolve().parents[2], "<tartlet>")
