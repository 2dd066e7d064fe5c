"""Running untrusted Python code in a WebAssembly sandbox (``code-run``).

An agent that lets the model write code (``inferlets/codeact-agent``) needs
somewhere to run it that is not the server's own Python. This host service
runs each snippet in a fresh instance of one small WebAssembly component:
CPython (componentize-py's build, the one inferlet components embed) with a
runner that ``exec``\\ s the code inside the guest. Every call gets

- a new wasmtime ``Store`` and component instance (pre-initialised, ~10 ms):
  no state survives between calls, nothing is shared with other calls;
- WASI with no preopened directories, no sockets, no environment and no
  arguments: ``open()`` of any path and every socket fail inside the guest
  with ``OSError``/``PermissionError``, which the snippet sees as usual;
- a cap on its linear memory (``Store.set_limits``): an allocation past it
  raises ``MemoryError`` in the guest (or traps it when CPython cannot even
  raise);
- a wall-time limit counted in epoch ticks of this service's own wasmtime
  engine (one ticker thread, :data:`TICK_S`): an infinite loop is trapped
  at the deadline;
- stdout and stderr captured by the host up to ``max_output_bytes`` (more is
  dropped, ``truncated`` says so).

Calls run on a small thread pool (``workers``); wasmtime releases the GIL
while the guest runs, so a snippet never blocks the event loop or the
scheduler. A call the caller stops waiting for still runs to its own time
limit (bounded), then its store is dropped.

The runner component is built from :data:`RUNNER_WIT` and :data:`RUNNER_APP`
with componentize-py on first use (tens of seconds, once per machine: cached
by content hash under ``<cache>/builds``, its compiled form under
``<cache>/compiled``).

Why a host service and not a child inferlet: a child runs in its parent's
runtime (a native parent would run the code natively), gets the whole host
API, and has per-instance limits sized for inferlets (512 MiB, 60 s of CPU);
a snippet needs none of the host API, much tighter limits chosen per call,
and the same sandbox whether the agent runs natively or sandboxed.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypedDict

from ..sdk.errors import LimitError
from ..paths import cache_dir

#: Seconds per epoch tick of the sandbox engine (the resolution of time limits).
TICK_S = 0.01
#: Smallest memory cap a call may ask for, MiB (CPython starts at about 14 MiB).
MIN_MEMORY_MB = 24
#: Longest snippet (or setup code) accepted, characters.
MAX_CODE_CHARS = 1 << 20
#: Longest a componentize-py build of the runner may take, seconds.
BUILD_TIMEOUT_S = 600.0

RUNNER_WIT = """\
package tartlet:code-runner@0.1.0;

world code-runner {
  /// Run `setup` (its output discarded), then `code` in the same namespace,
  /// printing the value of a final expression statement as a REPL does.
  /// The error is the traceback of the code's exception.
  export run: func(setup: string, code: string) -> result<_, string>;
}
"""

RUNNER_APP = '''\
"""The code runner inside the sandbox (world code-runner)."""
import ast
import io
import sys
import traceback

import wit_world
from componentize_py_types import Err


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
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                pass
'''


class CodeSandboxError(RuntimeError):
    """The sandbox itself is unavailable (wasmtime or componentize-py
    missing, or the runner component failed to build)."""


class SandboxResult(TypedDict):
    """The result of :meth:`CodeSandbox.run` (see there)."""

    status: str  # ok | error | timeout | memory | crashed
    stdout: str
    error: str | None
    truncated: bool
    elapsed_ms: int


class CodeSandbox:
    """Runs Python snippets in fresh WebAssembly instances, with limits.

    Args:
        max_time_s: largest (and default) wall-time limit per call, seconds.
        max_memory_mb: largest memory cap per call, MiB.
        default_memory_mb: memory cap when the call names none, MiB.
        max_output_bytes: stdout + stderr kept per call, bytes.
        workers: calls running at once (more wait in a queue; the time
            limit starts when a call starts running).
        max_pending_per_user: calls of one user queued or running at once
            (more raise ``LimitError``), so one user cannot fill the queue.

    Raises:
        ValueError: a limit out of range.
    """

    def __init__(
        self, max_time_s: float = 10.0, max_memory_mb: int = 256, default_memory_mb: int = 64,
        max_output_bytes: int = 65536, workers: int = 2, max_pending_per_user: int = 8,
    ) -> None:  # fmt: skip
        if not (max_time_s > 0 and math.isfinite(max_time_s)):
            raise ValueError(f"max_time_s must be a positive number of seconds, got {max_time_s!r}")
        if not MIN_MEMORY_MB <= default_memory_mb <= max_memory_mb:
            raise ValueError(f"need {MIN_MEMORY_MB} <= default_memory_mb <= max_memory_mb, got {default_memory_mb}, {max_memory_mb}")
        if max_output_bytes < 1 or workers < 1 or max_pending_per_user < 1:
            raise ValueError("max_output_bytes, workers and max_pending_per_user must be >= 1")
        self.max_time_s, self.max_memory_mb, self.default_memory_mb = float(max_time_s), int(max_memory_mb), int(default_memory_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.max_pending_per_user = int(max_pending_per_user)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tartlet-code")
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}  # owner -> calls queued or running
        self._load_lock = threading.Lock()
        self._ready: tuple[Any, Any, Any] | None = None  # (engine, linker, component)

    # -- the runner component -----------------------------------------------------------
    def _load(self) -> tuple[Any, Any, Any]:
        """Engine, linker and compiled runner (built and compiled on first use)."""
        with self._load_lock:
            if self._ready is None:
                try:
                    from wasmtime import Config, Engine
                    from wasmtime.component import Component, Linker
                except ImportError as e:  # pragma: no cover - wasmtime is a dependency
                    raise CodeSandboxError(f"running code needs wasmtime: {e}") from None
                cfg = Config()
                cfg.epoch_interruption = True
                engine = Engine(cfg)
                wasm = build_runner()
                cwasm = cache_dir() / "compiled" / f"{wasm.stem}-{_wasmtime_version()}.cwasm"
                component = None
                if cwasm.is_file():
                    try:
                        component = Component.deserialize_file(engine, str(cwasm))
                    except Exception:
                        component = None  # stale: compile again
                if component is None:
                    component = Component(engine, wasm.read_bytes())
                    cwasm.parent.mkdir(parents=True, exist_ok=True)
                    tmp = cwasm.with_suffix(f".tmp{os.getpid()}")
                    tmp.write_bytes(component.serialize())
                    os.replace(tmp, cwasm)
                linker = Linker(engine)
                linker.add_wasip2()
                threading.Thread(target=_tick, args=(engine,), name="tartlet-code-epoch", daemon=True).start()
                self._ready = (engine, linker, component)
            return self._ready

    def prepare(self) -> None:
        """Build and compile the runner now (else the first call does).

        Raises:
            CodeSandboxError: componentize-py is missing or the build failed.
        """
        self._load()

    # -- calls ------------------------------------------------------------------------
    def check(self, code: Any, setup: Any = "", time_limit_s: Any = None, memory_mb: Any = None) -> tuple[str, str, float, int]:
        """Validate a call's arguments; returns them with defaults applied.

        Raises:
            ValueError: non-string or oversized code; a time limit outside
                ``(0, max_time_s]`` or a memory cap outside
                ``[MIN_MEMORY_MB, max_memory_mb]`` (the message names the bound).
        """
        for v, what in ((code, "code"), (setup, "setup")):
            if not isinstance(v, str):
                raise ValueError(f"{what} must be a string of Python source, got {type(v).__name__}")
            if len(v) > MAX_CODE_CHARS:
                raise ValueError(f"{what} is {len(v)} characters; at most {MAX_CODE_CHARS} are run")
        if time_limit_s is None:
            time_limit_s = self.max_time_s
        if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not 0 < time_limit_s <= self.max_time_s:
            raise ValueError(f"time_limit_s must be in (0, {self.max_time_s:g}] seconds (this host's limit), got {time_limit_s!r}")
        if memory_mb is None:
            memory_mb = self.default_memory_mb
        if isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or not MIN_MEMORY_MB <= memory_mb <= self.max_memory_mb:
            raise ValueError(f"memory_mb must be an int in [{MIN_MEMORY_MB}, {self.max_memory_mb}] MiB (this host's limit), got {memory_mb!r}")
        return code, setup, float(time_limit_s), memory_mb

    def run(
        self, code: str, setup: str = "", time_limit_s: float | None = None, memory_mb: int | None = None, owner: str = "",
    ) -> Future[SandboxResult]:  # fmt: skip
        """Run ``setup`` (output discarded) then ``code`` in a fresh sandbox,
        for user ``owner``. Cancelling the future before it starts drops it.

        Returns:
            A future of ``{"status", "stdout", "error", "truncated",
            "elapsed_ms"}``: ``status`` is ``ok``, ``error`` (the code
            raised; ``error`` holds its traceback), ``timeout`` (the time
            limit trapped it), ``memory`` (``MemoryError`` or a trap at the
            memory cap) or ``crashed`` (any other trap); ``stdout`` is
            stdout then stderr as text; ``elapsed_ms`` the wall time.
            The future fails with :class:`CodeSandboxError` only when the
            sandbox cannot be set up.

        Raises:
            ValueError: bad arguments (see :meth:`check`).
            LimitError: ``owner`` already has ``max_pending_per_user``
                calls queued or running.
        """
        args = self.check(code, setup, time_limit_s, memory_mb)
        with self._lock:
            n = self._pending.get(owner, 0)
            if n >= self.max_pending_per_user:
                raise LimitError(
                    f"user {owner or '(local)'!r} already has {n} code runs queued or running, "
                    f"the limit ([code] max_pending_per_user)"
                )
            self._pending[owner] = n + 1
        fut = self._pool.submit(self._run, *args)
        fut.add_done_callback(lambda _f: self._done(owner))
        return fut

    def _done(self, owner: str) -> None:
        with self._lock:
            n = self._pending.get(owner, 1) - 1
            if n > 0:
                self._pending[owner] = n
            else:
                self._pending.pop(owner, None)

    def _run(self, code: str, setup: str, time_limit_s: float, memory_mb: int) -> SandboxResult:
        from wasmtime import Store, WasiConfig, WasmtimeError
        from wasmtime.component import Variant

        engine, linker, component = self._load()
        out = bytearray()
        dropped = [False]
        lock = threading.Lock()
        cap = self.max_output_bytes

        def capture(data: bytes) -> None:  # called on wasmtime's threads
            with lock:
                room = cap - len(out)
                if len(data) > room:
                    dropped[0] = True
                if room > 0:
                    out.extend(data[:room])

        wasi = WasiConfig()  # no args, env, preopens or network
        wasi.stdout_custom = capture
        wasi.stderr_custom = capture
        store = Store(engine)
        store.set_wasi(wasi)
        store.set_limits(memory_size=memory_mb << 20)
        store.set_epoch_deadline(max(1, math.ceil(time_limit_s / TICK_S)))
        t0 = time.monotonic()
        status = "ok"
        error: str | None = None
        try:
            instance = linker.instantiate(store, component)
            run = instance.get_func(store, "run")
            r = run(store, setup, code)
            if isinstance(r, Variant) and r.tag == "err":
                status, error = "error", str(r.payload)
            elif r is not None and not (isinstance(r, Variant) and r.tag == "ok"):
                status, error = "error", str(r)
            if status == "error" and error is not None and error.rstrip().splitlines()[-1].startswith("MemoryError"):
                status, error = "memory", f"{error}\n(the sandbox's memory limit is {memory_mb} MiB)"
        except WasmtimeError as e:
            text = str(e)
            if "interrupt" in text:
                status, error = "timeout", f"TimeoutError: the code ran past its time limit of {time_limit_s:g} s and was stopped"
            elif "memory" in text or "unreachable" in text:  # CPython aborts when even MemoryError cannot be made
                status, error = "memory", f"MemoryError: the code ran out of memory (the sandbox's limit is {memory_mb} MiB) and was stopped"
            else:
                lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
                status, error = "crashed", f"the sandbox crashed: {lines[-1] if lines else 'wasm trap'}"
        finally:
            store.close()  # now, while its WASI callbacks live (see runtime/wasm.py _Run.release)
        elapsed = time.monotonic() - t0
        with lock:
            text = bytes(out).decode("utf-8", "replace")
        return {"status": status, "stdout": text, "error": error, "truncated": dropped[0], "elapsed_ms": int(elapsed * 1000)}

    def close(self) -> None:
        """Stop taking calls (running ones finish)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _tick(engine: Any) -> None:
    while True:
        time.sleep(TICK_S)
        engine.increment_epoch()


def _wasmtime_version() -> str:
    return importlib.metadata.version("wasmtime")


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
