"""The process-wide wasmtime engine of the WASM runtime, its epoch ticker,
and the on-disk cache of compiled components.

One :class:`wasmtime.Engine` with one fixed :class:`wasmtime.Config`
(epoch interruption on) serves every instance: a serialized component only
loads into an engine with the same settings, so the cache key includes the
wasmtime version and this configuration. Compiling an 18 MB Python
component takes seconds; loading its cached ``.cwasm`` (mmap) takes ms.

The epoch ticker is one daemon thread that calls
``engine.increment_epoch()`` every :data:`TICK_S` seconds; each store's CPU
deadline is counted in these ticks.
"""

from __future__ import annotations

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
        self.engine = Engine(cfg)
        self._lock = threading.Lock()
        self._components: dict[str, Component] = {}
        self._by_file: dict[tuple[str, int, int, int], Component] = {}  # (path, inode, size, mtime) -> component
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
        comp = self._by_file.get(ident)
        if comp is not None:
            return comp
        try:
            data = path.read_bytes()
        except OSError as e:
            raise WasmLoadError(f"cannot read component {path}: {e}") from None
        digest = hashlib.sha256(data).hexdigest()
        with self._lock:
            comp = self._components.get(digest)
            if comp is not None:
                self._by_file[ident] = comp
                return comp
            if data[:4] != b"\0asm":
                raise WasmLoadError(f"{path} is not a WebAssembly component (no \\0asm header)")
            cwasm = self.compiled_path(digest)
            if cwasm.is_file():
                try:
                    comp = Component.deserialize_file(self.engine, str(cwasm))
                except WasmtimeError:
                    comp = None  # stale or corrupt cache entry: recompile
            if comp is None:
                try:
                    comp = Component(self.engine, data)
                except WasmtimeError as e:
                    msg = str(e).strip().splitlines()[0]
                    raise WasmLoadError(f"{path} is not a valid WebAssembly component: {msg}") from None
                cwasm.parent.mkdir(parents=True, exist_ok=True)
                tmp = cwasm.with_suffix(f".tmp{os.getpid()}")
                tmp.write_bytes(comp.serialize())
                os.replace(tmp, cwasm)
            self._components[digest] = comp
            self._by_file[ident] = comp
            return comp


_shared: WasmEngine | None = None
_shared_lock = threading.Lock()


def shared_engine() -> WasmEngine:
    """The process's :class:`WasmEngine` (created on first use)."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = WasmEngine()
        return _shared
