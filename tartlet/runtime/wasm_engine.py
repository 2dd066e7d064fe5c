"""The process-wide wasmtime engine of the WASM runtime, its epoch ticker,
and the on-disk cache of compiled components.

One :class:`wasmtime.Engine` with one fixed :class:`wasmtime.Config`
(epoch interruption on) serves every instance: a serialized component only
loads into an engine with the same settings, so the cache key includes the
wasmtime version and this configuration. Compiling an 18 MB Python
component takes seconds; loading its cached ``.cwasm`` (mmap) takes ms.

Memory. A component compiled in this process leaves its machine code
(~55 MiB for a componentize-py build) on the heap, and Cranelift's freed
scratch (~250 MiB more) in malloc's arenas until they are trimmed. So a
fresh compile is written to the cache, dropped, the heap trimmed
(``malloc_trim``), and the component loaded back from its ``.cwasm``
file: file-backed pages (~4 MiB touched), which the kernel may drop and
reread. The in-memory map of loaded components keeps the
:data:`MAX_COMPONENTS` most recently loaded from disk (running instances
keep their own reference; a dropped one loads again from its ``.cwasm``).

CPU. A compile (seconds, for one user's new upload) runs on one thread of
its own at a lower priority (``nice`` +:data:`COMPILE_NICE`; wasmtime's
parallel compilation off), so the model thread and the event loop, which
serve every user, go first.

The epoch ticker is one daemon thread that calls
``engine.increment_epoch()`` every :data:`TICK_S` seconds; each store's CPU
deadline is counted in these ticks.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import hashlib
import importlib.metadata
import os
import threading
import time
from pathlib import Path

from wasmtime import Config, Engine, WasmtimeError
from wasmtime.component import Component

from ..paths import cache_dir
from ..sdk.errors import ProgramError
from . import wasm_fastcall, wasm_fastlist

#: Seconds per epoch tick (the resolution of the CPU-time limit).
TICK_S = 0.01
_CONFIG_ID = "epoch_interruption=1;cranelift"
#: Compiled components kept loaded (the least recently loaded dropped first).
MAX_COMPONENTS = 64
#: Niceness of the thread that compiles a component.
COMPILE_NICE = 10


def trim_heap() -> bool:
    """Give the heap's free memory back to the OS (glibc ``malloc_trim(0)``);
    returns whether it ran (False where the C library has no such call)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


class WasmLoadError(ProgramError):
    """A file that is not a valid WebAssembly component (refused at launch)."""


class WasmEngine:
    """The shared engine plus the compiled-component cache (process singleton,
    see :func:`shared_engine`)."""

    def __init__(self) -> None:
        wasm_fastlist.install()
        wasm_fastcall.install()
        cfg = Config()
        cfg.epoch_interruption = True
        cfg.parallel_compilation = False  # one (lower-priority) thread per compile: see _compile
        self.engine = Engine(cfg)
        self._lock = threading.Lock()
        # digest -> component, least recently loaded first; the map of files
        # (path, inode, size, mtime) -> digest, a lookup that skips hashing
        self._components: collections.OrderedDict[str, Component] = collections.OrderedDict()
        self._by_file: dict[tuple[str, int, int, int], str] = {}
        self._ticker = threading.Thread(target=self._tick, name="tartlet-wasm-epoch", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        while True:
            time.sleep(TICK_S)
            self.engine.increment_epoch()

    @staticmethod
    def compiled_path(digest: str) -> Path:
        ver = importlib.metadata.version("wasmtime")
        key = hashlib.sha256(f"{digest}|wasmtime {ver}|{_CONFIG_ID}".encode()).hexdigest()[:32]
        return cache_dir() / "compiled" / f"{key}.cwasm"

    def load(self, path: Path | str) -> Component:
        """The compiled component of the ``.wasm`` file at ``path``: from
        memory, else from the on-disk cache, else compiled (and cached).

        Raises:
            WasmLoadError: the file is missing or not a valid component.
        """
        path = Path(path)
        try:
            st = path.stat()
        except OSError as e:
            raise WasmLoadError(f"cannot read component {path}: {e}") from None
        # a launch of a component loaded before skips reading and hashing
        # its file (18 MB for a componentize-py build: ~18 ms on the event
        # loop per launch); a rewritten file has a new inode, size or mtime.
        # Read without the lock, which a compile of another component holds
        # for seconds (a dict lookup is atomic)
        ident = (str(path), st.st_ino, st.st_size, st.st_mtime_ns)
        comp = self._components.get(self._by_file.get(ident, ""))
        if comp is not None:
            return comp
        try:
            data = path.read_bytes()
        except OSError as e:
            raise WasmLoadError(f"cannot read component {path}: {e}") from None
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            comp = self._components.get(digest)
            if comp is None:
                if data[:4] != b"\0asm":
                    raise WasmLoadError(f"{path} is not a WebAssembly component (no \\0asm header)")
                comp = self._load_compiled(digest, data, path)
            self._components[digest] = comp
            self._components.move_to_end(digest)
            self._by_file[ident] = digest
            while len(self._components) > MAX_COMPONENTS:
                old, _ = self._components.popitem(last=False)
                for key in [k for k, d in self._by_file.items() if d == old]:
                    del self._by_file[key]
            return comp

    def _load_compiled(self, digest: str, data: bytes, path: Path) -> Component:
        """The component of ``data`` from its ``.cwasm`` (mmap), compiling
        and caching it first when missing or stale (called with the lock).

        Raises:
            WasmLoadError: ``data`` is not a valid component.
        """
        cwasm = self.compiled_path(digest)
        if cwasm.is_file():
            try:
                return Component.deserialize_file(self.engine, str(cwasm))
            except WasmtimeError:
                pass  # stale or corrupt cache entry: recompile
        try:
            compiled = _compile(self.engine, data)
        except WasmtimeError as e:
            msg = str(e).strip().splitlines()[0]
            raise WasmLoadError(f"{path} is not a valid WebAssembly component: {msg}") from None
        cwasm.parent.mkdir(parents=True, exist_ok=True)
        tmp = cwasm.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        tmp.write_bytes(compiled.serialize())
        os.replace(tmp, cwasm)
        del compiled  # its code and Cranelift's scratch: hundreds of MiB of heap
        trim_heap()
        try:
            return Component.deserialize_file(self.engine, str(cwasm))
        except WasmtimeError as e:  # the file we just wrote: only a full disk or a race with a cleaner
            raise WasmLoadError(f"cannot load the compiled component of {path}: {str(e).strip().splitlines()[0]}") from None

def _compile(engine: Engine, data: bytes) -> Component:
    """``Component(engine, data)`` on a thread of its own at ``nice``
    +:data:`COMPILE_NICE` (a thread's niceness cannot be lowered back
    without privileges, so the thread is used once).

    Raises:
        WasmtimeError: ``data`` is not a valid component.
    """
    out: list[Component | BaseException] = []

    def run() -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, os.getpriority(os.PRIO_PROCESS, 0) + COMPILE_NICE))
        except (OSError, AttributeError):  # not Linux: a per-thread priority is not available
            pass
        try:
            out.append(Component(engine, data))
        except BaseException as e:
            out.append(e)

    t = threading.Thread(target=run, name="tartlet-wasm-compile", daemon=True)
    t.start()
    t.join()
    result = out[0]
    if isinstance(result, BaseException):
        raise result
    return result


_shared: WasmEngine | None = None
_shared_lock = threading.Lock()


def shared_engine() -> WasmEngine:
    """The process's :class:`WasmEngine` (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WasmEngine()
        return _shared
