"""Compile Tartlet's C kernels once per machine and cache the shared library.

Each kernel file (``cpu_kernels.c``, ``quant_kernels.c`` and the headers it
includes) is compiled with the system C compiler (``$CC``, else ``cc`` or
``gcc``) into ``$TARTLET_CACHE_DIR/kernels`` (else the user cache dir),
named by a hash of the sources, the flags and the compiler, so an edit or a
new compiler rebuilds and everything else reuses the file. OpenMP comes
from the ``libgomp`` PyTorch has already loaded, so kernels and torch share
one thread pool.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from ..paths import kernels_dir

log = logging.getLogger(__name__)


def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()



def find_compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compile_library(name: str, source: Path, flags: list[str], headers: tuple[Path, ...] = ()) -> Path:
    """Compile ``source`` (which may include ``headers``) into a cached shared library.

    Args:
        name: file name stem of the library (``NAME-HASH.so``).
        source: the C file.
        flags: compiler flags (``-shared -fPIC`` are the caller's to give).
        headers: files ``source`` includes; they are part of the cache key.

    Returns:
        The library's path (built now, or found in the cache).

    Raises:
        RuntimeError: no C compiler, or it failed (its stderr is included).
    """
    cc = find_compiler()
    if not cc:
        raise RuntimeError("no C compiler found (set CC)")
    text = b"".join(p.read_bytes() for p in (source, *headers))
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = kernels_dir() / f"{name}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        proc = subprocess.run([cc, *flags, str(source), "-o", str(tmp_out), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to compile {source.name}: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)  # atomic: concurrent builders race harmlessly
    return out


def open_library(build: Callable[[], Path], env_var: str, what: str, fallback: str) -> ctypes.CDLL | None:
    """Build (or find in the cache) and open one kernel library, or return
    ``None`` with the reason logged: when ``env_var`` is ``0`` (``what``
    disabled), or the compiler or the loader failed (then ``fallback`` says
    what runs instead). Loads torch's OpenMP runtime first, so the kernels
    share its thread pool."""
    if os.environ.get(env_var, "1") == "0":
        log.info("%s disabled by %s=0", what, env_var)
        return None
    import torch

    torch.zeros(2).sum()  # make sure torch's OpenMP runtime is loaded first
    try:
        return ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        log.warning("%s unavailable, %s: %s", what, fallback, e)
        return None
