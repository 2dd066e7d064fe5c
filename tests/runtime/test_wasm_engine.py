"""The compiled-component cache of the WASM engine (issue 40: memory that
comes back): a fresh compile is served from its ``.cwasm`` file, not kept on
the heap, and the in-memory map of components is bounded."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import wasmtime
from wasmtime.component import Component

from tartlet.runtime import wasm_engine
from tartlet.runtime.wasm_engine import WasmEngine, WasmLoadError


def tiny_component(tmp_path: Path, name: str) -> Path:
    """A minimal valid component (a core module exporting ``name``)."""
    path = tmp_path / f"{name}.wasm"
    path.write_bytes(bytes(wasmtime.wat2wasm(f'(component (core module (func (export "{name}"))))')))
    return path


@pytest.fixture()
def engine(tmp_path, monkeypatch) -> WasmEngine:
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path / "cache"))
    return WasmEngine()


def spy_deserialize(monkeypatch) -> list[str]:
    """Record the files ``Component.deserialize_file`` loads."""
    loaded: list[str] = []
    real = Component.deserialize_file

    def spy(engine: wasmtime.Engine, path: str) -> Component:
        loaded.append(path)
        return real(engine, path)

    monkeypatch.setattr(Component, "deserialize_file", staticmethod(spy))
    return loaded


def test_a_fresh_compile_is_loaded_back_from_its_cache_file(engine, tmp_path, monkeypatch):
    loaded = spy_deserialize(monkeypatch)
    path = tiny_component(tmp_path, "a")
    comp = engine.load(path)
    cwasm = WasmEngine.compiled_path(hashlib.sha256(path.read_bytes()).hexdigest())
    assert cwasm.is_file()
    # compiled, written, then served from the file (mmap), not from the heap
    assert loaded == [str(cwasm)]
    assert engine.load(path) is comp  # then from memory
    assert loaded == [str(cwasm)]
    # another engine (a restarted server) loads the file without compiling
    monkeypatch.setattr(Component, "__init__", lambda *a: pytest.fail("compiled again"))
    WasmEngine().load(path)
    assert loaded == [str(cwasm)] * 2


def test_loaded_components_are_bounded(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(wasm_engine, "MAX_COMPONENTS", 2)
    paths = [tiny_component(tmp_path, n) for n in "abc"]
    comps = [engine.load(p) for p in paths]
    assert len(engine._components) == 2
    assert len(engine._by_file) == 2
    assert engine.load(paths[2]) is comps[2]  # the newest stay
    assert engine.load(paths[0]) is not comps[0]  # the oldest was dropped: loaded again from its file
    assert len(engine._components) == 2


def test_an_invalid_component_is_refused(engine, tmp_path):
    bad = tmp_path / "bad.wasm"
    bad.write_bytes(b"\0asm\x0d\x00\x01\x00garbage")
    with pytest.raises(WasmLoadError, match="not a valid WebAssembly component"):
        engine.load(bad)
    (tmp_path / "text.wasm").write_text("hello")
    with pytest.raises(WasmLoadError, match="no .0asm header"):
        engine.load(tmp_path / "text.wasm")



def test_a_compile_runs_niced_on_one_thread(engine, monkeypatch):
    import os

    seen: list[int] = []
    monkeypatch.setattr(wasm_engine, "Component", lambda _engine, _data: seen.append(os.getpriority(os.PRIO_PROCESS, 0)) or "c")
    assert wasm_engine._compile(engine.engine, b"") == "c"
    assert seen == [min(19, os.getpriority(os.PRIO_PROCESS, 0) + wasm_engine.COMPILE_NICE)]
    assert os.getpriority(os.PRIO_PROCESS, 0) < seen[0] or seen[0] == 19  # the caller's priority is untouched
