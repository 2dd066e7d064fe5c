"""Compile Tartlet's C kernels once per machine and cache the shared library.

Each kernel file (``cpu_kernels.c``, ``quant_kernels.c`` and the headers it
includes) is compiled with the system C compiler (``$CC``, else ``cc`` or
``gcc``) into ``$TARTLET_CACHE_DIR/kernels`` (else the user cache dir),
named by a hash of the sources, the flags, the compiler's path and its
``--version`` output, so an edit or a new compiler rebuilds and everything
else reuses the file. OpenMP comes from the ``libgomp`` PyTorch has already
loaded, so kernels and torch share one thread pool.

The build is defensive, because a kernel that cannot be had only costs speed
(the callers fall back to PyTorch ops, or to dequantized weights):

* the compiler runs under a time limit (``$TARTLET_CC_TIMEOUT`` seconds,
  default :data:`DEFAULT_TIMEOUT_S`); past it the compiler's process group is
  killed and :class:`RuntimeError` names the command and the limit;
* each process compiles into its own temporary folder and moves the result
  into place with :func:`os.replace`, so concurrent builders never see each
  other's half-written file;
* next to ``NAME-KEY.so`` a ``NAME-KEY.so.sha256`` sidecar holds the
  library's size and SHA-256; a cached file that does not match it (truncated,
  overwritten, sidecar missing) is rebuilt, and a file the loader still
  refuses is rebuilt once (:func:`open_library`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Callable

from ...paths import kernels_dir

log = logging.getLogger(__name__)

#: Seconds one compiler run may take unless ``$TARTLET_CC_TIMEOUT`` says otherwise
#: (the quantized kernels take ~20 s at -O3 on a slow 2-core VM).
DEFAULT_TIMEOUT_S = 300.0


#: Compiler flags of every kernel library (each adds its ``-std`` and ISA
#: flags). ``-fno-trapping-math``: the kernels never read floating-point
#: exception flags, and without it GCC keeps a select between a division and
#: another value (SiLU's ``a >= 0 ? 1 / (1 + e) : e / (1 + e)``, the
#: exponential's ``-inf`` case) as a branch, so those loops did not
#: vectorise: SiLU * up took 5.5 ns a value instead of 1.1. It changes no
#: result (no reassociation, unlike ``-ffast-math``; checked bitwise over 1M
#: SiLU inputs).
BASE_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-fno-trapping-math")


def cpu_flags() -> set[str]:
    """The CPU feature flags of ``/proc/cpuinfo`` (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` from ``/proc/cpuinfo`` (``GenuineIntel``,
    ``AuthenticAMD``, ...; empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def find_compiler() -> str | None:
    """The C compiler to build with: ``$CC``, else ``cc`` or ``gcc`` on the PATH."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def compiler_timeout() -> float:
    """Seconds one compiler run may take: ``$TARTLET_CC_TIMEOUT``, else :data:`DEFAULT_TIMEOUT_S`."""
    value = os.environ.get("TARTLET_CC_TIMEOUT")
    try:
        return float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise RuntimeError(f"TARTLET_CC_TIMEOUT must be a number of seconds, got {value!r}") from None


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with output captured; past ``timeout`` seconds kill its whole
    process group (the driver and the cc1/ld it started) and raise."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    except OSError as e:
        raise RuntimeError(f"cannot run the C compiler {cmd[0]}: {e}") from None
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            proc.kill()
        proc.communicate()
        raise RuntimeError(
            f"the C compiler did not finish within {timeout:g} s (TARTLET_CC_TIMEOUT): {' '.join(cmd)}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@functools.lru_cache(maxsize=8)
def _compiler_identity(cc: str, timeout: float) -> str:
    """``cc``'s resolved path and ``--version`` output, for the cache key."""
    proc = _run([cc, "--version"], timeout)
    return f"{shutil.which(cc) or cc}\n{proc.stdout.strip()}"


def _digest(path: Path) -> str:
    data = path.read_bytes()
    return f"{len(data)} {hashlib.sha256(data).hexdigest()}"


def _sidecar(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def cached_ok(lib: Path) -> bool:
    """Whether ``lib`` exists and matches the size and SHA-256 its sidecar recorded."""
    try:
        return _sidecar(lib).read_text().strip() == _digest(lib)
    except OSError:
        return False


def compile_library(
    name: str, source: Path, flags: list[str], headers: tuple[Path, ...] = (), *, rebuild: bool = False
) -> Path:
    """Compile ``source`` (which may include ``headers``) into a cached shared library.

    Args:
        name: file name stem of the library (``NAME-HASH.so``).
        source: the C file.
        flags: compiler flags (``-shared -fPIC`` are the caller's to give).
        headers: files ``source`` includes; they are part of the cache key.
        rebuild: compile even when a cached file looks valid.

    Returns:
        The library's path (built now, or found in the cache and verified).

    Raises:
        RuntimeError: no C compiler, it failed (its stderr is included) or it
            ran past :func:`compiler_timeout`.
    """
    cc = find_compiler()
    if not cc:
        raise RuntimeError("no C compiler found (set CC)")
    timeout = compiler_timeout()
    text = b"".join(p.read_bytes() for p in (source, *headers))
    ident = _compiler_identity(cc, timeout)
    key = hashlib.sha256(text + "\0".join([ident, *flags]).encode()).hexdigest()[:16]
    out = kernels_dir() / f"{name}-{key}.so"
    if not rebuild and cached_ok(out):
        return out
    if out.exists():
        log.warning("rebuilding %s: the cached file does not match its recorded size and hash", out.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a folder of our own per build: concurrent builders (threads or processes) never share a temp file
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".build-{os.getpid()}-") as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [cc, *flags, str(source), "-o", str(tmp_out), "-lm"]
        proc = _run(cmd, timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to compile {source.name}: {proc.stderr.strip()[-2000:]}")
        digest = _digest(tmp_out)
        os.replace(tmp_out, out)  # atomic: a reader sees the old file or the whole new one
        side_tmp = Path(tmp) / "sidecar"
        side_tmp.write_text(digest + "\n")
        os.replace(side_tmp, _sidecar(out))
    return out


def open_library(build: Callable[..., Path], env_var: str, what: str, fallback: str) -> ctypes.CDLL | None:
    """Build (or find in the cache) and open one kernel library, or return
    ``None`` with the reason logged: when ``env_var`` is ``0`` (``what``
    disabled), or the compiler or the loader failed (then ``fallback`` says
    what runs instead). ``build(rebuild=True)`` must compile afresh: a cached
    file the loader refuses is rebuilt once. Loads torch's OpenMP runtime
    first, so the kernels share its thread pool."""
    if os.environ.get(env_var, "1") == "0":
        log.info("%s disabled by %s=0", what, env_var)
        return None
    import torch

    torch.zeros(2).sum()  # make sure torch's OpenMP runtime is loaded first
    try:
        path = build()
        try:
            return ctypes.CDLL(str(path))
        except OSError as e:
            log.warning("%s: the cached %s does not load (%s); rebuilding it", what, path.name, e)
            return ctypes.CDLL(str(build(rebuild=True)))
    except (RuntimeError, OSError) as e:
        log.warning("%s unavailable, %s: %s", what, fallback, e)
        return None
