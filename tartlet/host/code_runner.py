"""The code sandbox's runner component: CPython (componentize-py's build, the
one inferlet components embed) with a small app that ``exec``\\ s a snippet.

Built from :data:`RUNNER_WIT` and :data:`RUNNER_APP` with componentize-py on
first use (tens of seconds, once per machine: cached by content hash under
``<cache>/builds``), compiled once for this wasmtime (``<cache>/compiled``),
and run by the sandbox's worker processes (:mod:`.code_worker`).

Output: the app writes the snippet's stdout and stderr in pieces of at most
:data:`WRITE_CHUNK` bytes (wasmtime's custom output callback delivers at
most 8 KiB of one larger write and drops the rest, while telling the guest
all of it was written) and counts what it wrote (export ``written``), so
the host can tell when output was lost.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..paths import cache_dir

#: Longest a componentize-py build of the runner may take, seconds.
BUILD_TIMEOUT_S = 600.0
#: Largest piece of output the guest writes at once, bytes.
WRITE_CHUNK = 4096

RUNNER_WIT = """\
package tartlet:code-runner@0.2.0;

world code-runner {
  /// Run `setup` (its output discarded), then `code` in the same namespace,
  /// printing the value of a final expression statement as a REPL does.
  /// The error is the traceback of the code's exception.
  export run: func(setup: string, code: string) -> result<_, string>;
  /// Bytes of output (stdout and stderr) the last run wrote.
  export written: func() -> u64;
}
"""

RUNNER_APP = '''\
"""The code runner inside the sandbox (world code-runner)."""
import ast
import io
import os
import sys
import traceback

import wit_world
from componentize_py_types import Err

_CHUNK = %(chunk)d
_os_write = os.write
_written = [0]


def _write_all(fd, data):
    view = memoryview(data).cast("B")
    n = 0
    while n < len(view):
        k = _os_write(fd, view[n:n + _CHUNK])
        if not k:
            break
        n += k
    _written[0] += n
    return n


def _write(fd, data):
    if fd in (1, 2):
        return _write_all(fd, data)
    return _os_write(fd, data)


class _Raw(io.RawIOBase):
    def __init__(self, fd):
        self._fd = fd

    def writable(self):
        return True

    def fileno(self):
        return self._fd

    def write(self, b):
        return _write_all(self._fd, b)


def _stream(fd):
    return io.TextIOWrapper(io.BufferedWriter(_Raw(fd)), encoding="utf-8", errors="backslashreplace", line_buffering=True)


def _install_output():
    _written[0] = 0
    os.write = _write
    try:
        import posix
        posix.write = _write
    except ImportError:
        pass
    sys.stdout = sys.__stdout__ = _stream(1)
    sys.stderr = sys.__stderr__ = _stream(2)


class _Discard(io.TextIOBase):
    def write(self, s):
        return len(s)


def _exec(source, ns, name):
    tree = ast.parse(source, name, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, name, "exec"), ns)
    if last is not None:
        value = eval(compile(last, name, "eval"), ns)
        if value is not None:
            print(repr(value))


def _user_traceback(e):
    """The traceback without this module's frames."""
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(e), e, tb)).strip()


class WitWorld(wit_world.WitWorld):
    def run(self, setup, code):
        _install_output()
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        try:
            if setup:
                out = sys.stdout
                sys.stdout = _Discard()
                try:
                    _exec(setup, ns, "<setup>")
                finally:
                    sys.stdout = out
            _exec(code, ns, "<code>")
        except BaseException as e:
            try:
                text = _user_traceback(e)
            except BaseException:
                text = type(e).__name__
            raise Err(text or type(e).__name__)
        finally:
            for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
                try:
                    stream.flush()
                except BaseException:
                    pass

    def written(self):
        return _written[0]
''' % {"chunk": WRITE_CHUNK}


class CodeSandboxError(RuntimeError):
    """The sandbox itself is unavailable (wasmtime or componentize-py
    missing, the runner component failed to build, or a worker process
    failed to start)."""


_BUILD_LOCK = threading.Lock()


def build_runner() -> Path:
    """The runner component's ``.wasm`` (built with componentize-py when not
    cached; the key covers the WIT, the app and componentize-py's version).

    Raises:
        CodeSandboxError: componentize-py is missing or failed.
    """
    try:
        cpy = importlib.metadata.version("componentize-py")
    except importlib.metadata.PackageNotFoundError:
        raise CodeSandboxError("running code needs componentize-py (pip install componentize-py)") from None
    key = hashlib.sha256(f"{cpy}\0{RUNNER_WIT}\0{RUNNER_APP}".encode()).hexdigest()[:32]
    dest = cache_dir() / "builds" / f"code-runner-{key}.wasm"
    with _BUILD_LOCK:
        if dest.is_file():
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="tartlet-code-runner-") as tmp:
            t = Path(tmp)
            (t / "wit").mkdir()
            (t / "wit" / "runner.wit").write_text(RUNNER_WIT)
            (t / "app").mkdir()
            (t / "app" / "code_runner_app.py").write_text(RUNNER_APP)
            cmd = [
                sys.executable, "-c",
                "import sys, componentize_py; sys.argv[0] = 'componentize-py'; componentize_py.script()",
                "-d", str(t / "wit"), "-w", "code-runner", "componentize", "code_runner_app",
                "-p", str(t / "app"), "-o", str(t / "out.wasm"),
            ]  # fmt: skip
            env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
            try:
                proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                raise CodeSandboxError(f"building the code runner took longer than {BUILD_TIMEOUT_S:g} s") from None
            if proc.returncode != 0 or not (t / "out.wasm").is_file():
                log = (proc.stderr or proc.stdout).strip().split("\nStack backtrace:")[0][-4000:]
                raise CodeSandboxError(f"building the code runner failed:\n{log}")
            tmp_dest = dest.with_suffix(f".tmp{os.getpid()}")
            shutil.move(str(t / "out.wasm"), tmp_dest)
            os.replace(tmp_dest, dest)
    return dest


_COMPILE_LOCK = threading.Lock()


def compiled_runner() -> tuple[Path, Path]:
    """The runner's ``.wasm`` and its compiled form for this wasmtime (a
    ``.cwasm`` the worker processes load in milliseconds), both built on
    first use.

    Raises:
        CodeSandboxError: wasmtime or componentize-py missing, or a build
            or compile failure.
    """
    try:
        from wasmtime import Config, Engine
        from wasmtime.component import Component
    except ImportError as e:  # pragma: no cover - wasmtime is a dependency
        raise CodeSandboxError(f"running code needs wasmtime: {e}") from None
    wasm = build_runner()
    cwasm = cache_dir() / "compiled" / f"{wasm.stem}-{importlib.metadata.version('wasmtime')}.cwasm"
    with _COMPILE_LOCK:
        if not cwasm.is_file():
            cfg = Config()
            cfg.epoch_interruption = True  # as the worker's engine: a compiled component needs the same settings
            try:
                component = Component(Engine(cfg), wasm.read_bytes())
            except Exception as e:
                raise CodeSandboxError(f"compiling the code runner failed: {e}") from None
            cwasm.parent.mkdir(parents=True, exist_ok=True)
            tmp = cwasm.with_suffix(f".tmp{os.getpid()}")
            tmp.write_bytes(component.serialize())
            os.replace(tmp, cwasm)
    return wasm, cwasm
