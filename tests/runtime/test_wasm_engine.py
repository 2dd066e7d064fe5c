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
    monkeypatch.setattr(wasm_engine, "_compile", lambda *a: pytest.fail("compiled again"))
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



def test_a_compile_runs_in_a_niced_child_process(engine, tmp_path, monkeypatch):
    # Cranelift's scratch and the compiled code stay out of the server's heap
    # (issue 40: RSS grew with every new upload while compiles ran in-process)
    import subprocess
    import sys

    calls: list[list[str]] = []
    real = subprocess.run

    def spy(cmd, **kw):
        calls.append(cmd)
        return real(cmd, **kw)

    monkeypatch.setattr(subprocess, "run", spy)
    path = tiny_component(tmp_path, "child")
    comp = engine.load(path)
    assert len(calls) == 1 and calls[0][0] == sys.executable and str(wasm_engine.COMPILE_NICE) in calls[0]
    assert isinstance(comp, Component)
    assert not list(WasmEngine.compiled_path("x").parent.glob("*.tmp*"))  # the child's output was renamed into place


def test_the_compiling_child_uses_the_servers_engine_settings(tmp_path):
    # a .cwasm made by the child loads into the server's engine only if
    # their settings agree: a mismatch (say, epoch interruption off) fails
    src = tiny_component(tmp_path, "s")
    out = tmp_path / "s.cwasm"
    wasm_engine._compile(src, hashlib.sha256(src.read_bytes()).hexdigest(), out)
    Component.deserialize_file(wasm_engine.make_engine(), str(out))
    other = wasmtime.Config()
    other.epoch_interruption = False
    with pytest.raises(wasmtime.WasmtimeError):
        Component.deserialize_file(wasmtime.Engine(other), str(out))
    # a file that changed after it was hashed is refused, not compiled as another
    with pytest.raises(WasmLoadError, match="changed while"):
        wasm_engine._compile(src, "0" * 64, tmp_path / "t.cwasm")


def test_idle_components_leave_memory(engine, tmp_path, monkeypatch):
    # a component uploaded and run once must not stay mapped (its pages count
    # in the server's RSS) until MAX_COMPONENTS newer ones push it out
    import time

    a, b = tiny_component(tmp_path, "a"), tiny_component(tmp_path, "b")
    comp_a = engine.load(a)
    t = time.monotonic()
    comp_b = engine.load(b)
    with engine._lock:
        assert engine.drop_idle(t) == 1  # a, launched before t
    assert set(engine._components) == {hashlib.sha256(b.read_bytes()).hexdigest()}
    assert len(engine._by_file) == 1
    assert engine.load(b) is comp_b
    loaded = spy_deserialize(monkeypatch)
    assert engine.load(a) is not comp_a  # loaded again from its .cwasm, not compiled
    assert len(loaded) == 1 and loaded[0].endswith(".cwasm")
    with engine._lock:
        assert engine.drop_idle(time.monotonic() + 1) == 2
    assert not engine._components and not engine._by_file


def test_the_epoch_ticker_sweeps_idle_components(engine, tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(wasm_engine, "IDLE_S", 0.0)
    monkeypatch.setattr(wasm_engine, "SWEEP_TICKS", 5)
    engine.load(tiny_component(tmp_path, "a"))
    deadline = time.monotonic() + 10
    while engine._components and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine._components
