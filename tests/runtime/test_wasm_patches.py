"""The wasmtime-py patches (wasm_fastlist, wasm_fastcall) apply only on the
wasmtime-py version they were written against; on another they step aside
with a warning and wasmtime-py's own code runs."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

pytest.importorskip("wasmtime")

from wasmtime.component import _linker, _types  # noqa: E402

from tartlet.runtime import wasm_fastcall, wasm_fastlist  # noqa: E402


def test_installed_wasmtime_is_the_supported_one():
    """pyproject pins wasmtime; the patches are live on that pin."""
    assert importlib.metadata.version("wasmtime").split(".")[0] == str(wasm_fastlist.WASMTIME_MAJOR)
    assert wasm_fastlist.wasmtime_supported("x") and wasm_fastlist.install() and wasm_fastcall.install()
    assert _types.ListType.convert_to_c is wasm_fastlist._convert_to_c


@pytest.mark.parametrize("version", ["51.0.0", "49.0.1", "5.0.0", None])
def test_other_wasmtime_version_leaves_wasmtime_alone(monkeypatch, caplog, version):
    monkeypatch.setattr(wasm_fastlist, "_wasmtime_version", lambda: version)
    monkeypatch.setattr(wasm_fastlist, "_installed", None)
    monkeypatch.setattr(wasm_fastcall, "_installed", None)
    before = (_types.ListType.convert_to_c, _types.ListType.convert_from_c, _linker.func_impl,
              _types.VariantLikeType._tagged, _types.RecordType.fields)
    with caplog.at_level(logging.WARNING, logger="tartlet.runtime.wasm_fastlist"):
        assert wasm_fastlist.install() is False
        assert wasm_fastcall.install() is False
        assert wasm_fastlist.install() is False  # decided once: no second warning
    after = (_types.ListType.convert_to_c, _types.ListType.convert_from_c, _linker.func_impl,
             _types.VariantLikeType._tagged, _types.RecordType.fields)
    assert after == before, "patched a wasmtime-py it was not written for"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all(f"is not version {wasm_fastlist.WASMTIME_MAJOR}.x" in w for w in warnings)
    assert str(version or "(unknown)") in warnings[0]
    assert "wasm_fastlist" in warnings[0] and "wasm_fastcall" in warnings[1]
