"""The process-wide wasmtime engine of the WASM runtime, its epoch ticker,
and the on-disk cache of compiled components.

One :class:`wasmtime.Engine` with one fixed :class:`wasmtime.Config`
(epoch interruption on) serves every instance: a serialized component only
loads into an engine with the same settings, so the cache key includes the
wasmtime version and this configuration. Compiling an 18 MB Python
component takes seconds; loading its cached ``.cwasm`` (mmap) takes ms.

Memory. Compiling a componentize-py build takes ~300 MiB of Cranelift
scratch and leaves its machine code (~55 MiB) on the heap; in the server
process, malloc kept tens of MiB of it per compile however the heap was
trimmed (RSS grew ~15-25 MiB with each new upload over a soak, issue 40).
So a compile runs in a child process (:func:`_compile`): it writes the
``.cwasm`` and exits, and the server loads the component from that file
(mmap: file-backed pages, ~2 MiB of heap per component), which the kernel
may drop and reread. The in-memory map of loaded components keeps at most
the :data:`MAX_COMPONENTS` most recently used, and none unused for
:data:`IDLE_S` seconds: a mapped component's pages count in the server's
RSS (a soak's build phase, two new uploads run once, added 15 MiB of
``.cwasm`` pages), so components uploaded and run once would otherwise
stay until 32 of them pushed each other out.
Running instances keep their own reference; a dropped component loads
again from its ``.cwasm`` in milliseconds.

CPU. A compile (seconds, for one user's new upload) runs at a lower
priority (``nice`` +:data:`COMPILE_NICE`, wasmtime's parallel compilation
off: one core), so the model thread and the event loop, which serve every
user, go first; the calling thread waits for it without holding the GIL.

The epoch ticker is one daemon thread that calls
``engine.increment_epoch()`` every :data:`TICK_S` seconds; each store's CPU
deadline is counted in these ticks.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
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
#: Compiled components kept loaded (the least recently used dropped first).
MAX_COMPONENTS = 32
#: Seconds a loaded component stays in memory without a launch.
IDLE_S = 60.0
#: Epoch ticks between sweeps of idle components (10 s).
SWEEP_TICKS = 1000
#: Niceness of the process that compiles a component.
COMPILE_NICE = 10
#: Longest a compile may run, seconds (an 18 MB component: ~5-20 s).
COMPILE_TIMEOUT_S = 600.0
#: The engine's settings (``wasmtime.Config`` attributes): the server's
#: engine and the compiling child's must agree, or the ``.cwasm`` does not load.
ENGINE_SETTINGS = {"epoch_interruption": True, "parallel_compilation": False}


def make_engine() -> Engine:
    """A wasmtime engine with :data:`ENGINE_SETTINGS`."""
    cfg = Config()
    for key, value in ENGINE_SETTINGS.items():
        setattr(cfg, key, value)
    return Engine(cfg)


class WasmLoadError(ProgramError):
    """A file that is not a valid WebAssembly component (refused at launch)."""


class WasmEngine:
    """The shared engine plus the compiled-component cache (process singleton,
    see :func:`shared_engine`)."""

    def __init__(self) -> None:
        wasm_fastlist.install()
        wasm_fastcall.install()
        self.engine = make_engine()
        self._lock = threading.Lock()
        # digest -> component; digest -> when it was last launched
        # (time.monotonic()); the map of files (path, inode, size, mtime)
        # -> digest, a lookup that skips hashing
        self._components: dict[str, Component] = {}
        self._used: dict[str, float] = {}
        self._by_file: dict[tuple[str, int, int, int], str] = {}
        self._ticker = threading.Thread(target=self._tick, name="tartlet-wasm-epoch", daemon=True)
        self._ticker.start()

    def _tick(self) -> None:
        n = 0
        while True:
            time.sleep(TICK_S)
            self.engine.increment_epoch()
            n += 1
            if n % SWEEP_TICKS == 0 and self._components and self._lock.acquire(blocking=False):
                try:  # skipped while a compile holds the lock: the next sweep comes 10 s later
                    self.drop_idle(time.monotonic() - IDLE_S)
                finally:
                    self._lock.release()

    def drop_idle(self, before: float) -> int:
        """Drop from memory the components last launched before ``before``
        (a ``time.monotonic()`` value); returns how many (called with the lock)."""
        old = [d for d, t in list(self._used.items()) if t < before]  # a launch may add one meanwhile
        for d in old:
            self._drop(d)
        return len(old)

    def _drop(self, digest: str) -> None:
        self._components.pop(digest, None)
        self._used.pop(digest, None)
        for key in [k for k, d in self._by_file.items() if d == digest]:
            del self._by_file[key]

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
        digest = self._by_file.get(ident, "")
        comp = self._components.get(digest)
        if comp is not None:
            self._used[digest] = time.monotonic()
            return comp
        try:
            head, digest = _head_and_digest(path)
        except OSError as e:
            raise WasmLoadError(f"cannot read component {path}: {e}") from None
        with self._lock:
            comp = self._components.get(digest)
            if comp is None:
                if head != b"\0asm":
                    raise WasmLoadError(f"{path} is not a WebAssembly component (no \\0asm header)")
                comp = self._load_compiled(digest, path)
            self._components[digest] = comp
            self._used[digest] = time.monotonic()
            self._by_file[ident] = digest
            while len(self._components) > MAX_COMPONENTS:
                self._drop(min(self._used, key=self._used.__getitem__))
            return comp

    def _load_compiled(self, digest: str, path: Path) -> Component:
        """The component of the file at ``path`` (SHA-256 ``digest``) from its ``.cwasm`` (mmap), compiling
        and caching it first when missing or stale (called with the lock).

        Raises:
            WasmLoadError: the file is not a valid component, or changed
                since it was hashed.
        """
        cwasm = self.compiled_path(digest)
        if cwasm.is_file():
            try:
                return Component.deserialize_file(self.engine, str(cwasm))
            except WasmtimeError:
                pass  # stale or corrupt cache entry: recompile
        cwasm.parent.mkdir(parents=True, exist_ok=True)
        tmp = cwasm.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
        try:
            _compile(path, digest, tmp)
            os.replace(tmp, cwasm)
        except WasmtimeError as e:
            raise WasmLoadError(f"{path} is not a valid WebAssembly component: {str(e).strip().splitlines()[0]}") from None
        finally:
            tmp.unlink(missing_ok=True)
        try:
            return Component.deserialize_file(self.engine, str(cwasm))
        except WasmtimeError as e:  # the file we just wrote: only a full disk or a race with a cleaner
            raise WasmLoadError(f"cannot load the compiled component of {path}: {str(e).strip().splitlines()[0]}") from None


#: The compiling child: settings (JSON), niceness, the component file, its
#: expected SHA-256 and the output path in argv; a wasmtime error on
#: stderr, exit 2; the file changed since it was hashed: exit 3.
_CHILD = """
import hashlib, json, os, sys
from wasmtime import Config, Engine, WasmtimeError
from wasmtime.component import Component
settings, nice, src, digest, out = json.loads(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
with open(src, "rb") as f:
    data = f.read()
if hashlib.sha256(data).hexdigest() != digest:
    sys.exit(3)
try:
    os.nice(nice)
except OSError:
    pass
cfg = Config()
for key, value in settings.items():
    setattr(cfg, key, value)
try:
    compiled = Component(Engine(cfg), data)
except WasmtimeError as e:
    sys.stderr.write(str(e))
    sys.exit(2)
with open(out, "wb") as f:
    f.write(compiled.serialize())
"""


def _head_and_digest(path: Path) -> tuple[bytes, str]:
    """The first 4 bytes of the file at ``path`` and its hex SHA-256, read
    in 1 MiB pieces: a component (18-35 MB) is never whole in the server's
    heap, where glibc would keep the freed space (a freed block under its
    32 MiB mmap threshold goes back to the heap, not the OS).

    Raises:
        OSError: the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        head = f.read(4)
        h.update(head)
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return head, h.hexdigest()


def _compile(src: Path, digest: str, out: Path) -> None:
    """Compile the component file ``src`` (whose SHA-256 is ``digest``)
    into the serialized component file ``out``, in a child process at
    ``nice`` +:data:`COMPILE_NICE` (module docstring: its memory goes with
    it).

    Raises:
        WasmtimeError: not a valid component (wasmtime's message).
        WasmLoadError: the file changed since it was hashed, the compile
            crashed, or it ran past :data:`COMPILE_TIMEOUT_S`.
    """
    import json

    cmd = [sys.executable, "-I", "-c", _CHILD, json.dumps(ENGINE_SETTINGS), str(COMPILE_NICE), str(src), digest, str(out)]
    try:
        r = subprocess.run(cmd, capture_output=True, timeout=COMPILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise WasmLoadError(f"compiling the component took longer than {COMPILE_TIMEOUT_S:.0f} s") from None
    err = r.stderr.decode(errors="replace").strip()
    if r.returncode == 2:
        raise WasmtimeError(err or "invalid component")
    if r.returncode == 3:
        raise WasmLoadError(f"component {src.name} changed while it was being loaded")
    if r.returncode != 0:
        tail = err.splitlines()[-1] if err else f"exit status {r.returncode}"
        raise WasmLoadError(f"compiling the component failed ({tail})")


_shared: WasmEngine | None = None
_shared_lock = threading.Lock()


def shared_engine() -> WasmEngine:
    """The process's :class:`WasmEngine` (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WasmEngine()
        return _shared
