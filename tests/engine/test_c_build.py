"""The kernel build survives a hung compiler, a damaged cache file and
concurrent builders (tartlet/engine/kernels/c_build.py)."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import pytest

from tartlet.engine.kernels import c_build, cpu_kernels

SOURCE = "int answer(void) { return 42; }\n"


@pytest.fixture
def cc():
    found = c_build.find_compiler()
    if not found:
        pytest.skip("no C compiler on this machine")
    return found


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TARTLET_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kernels"


def build(tmp_path, **kw):
    src = tmp_path / "answer.c"
    if not src.exists():
        src.write_text(SOURCE)
    return c_build.compile_library("answer", src, ["-O1", "-shared", "-fPIC"], **kw)


def answer(lib) -> int:
    return ctypes.CDLL(str(lib)).answer()


def test_builds_once_with_a_verified_sidecar(cc, cache, tmp_path):
    lib = build(tmp_path)
    assert lib.parent == cache and answer(lib) == 42
    assert c_build.cached_ok(lib)
    mtime = lib.stat().st_mtime_ns
    assert build(tmp_path) == lib and lib.stat().st_mtime_ns == mtime, "rebuilt an intact cached file"
    assert not list(cache.glob(".build-*")), "temporary build folders left behind"


@pytest.mark.parametrize("damage", ["truncate", "garbage", "no-sidecar"])
def test_damaged_cache_file_is_rebuilt(cc, cache, tmp_path, damage, caplog):
    lib = build(tmp_path)
    size = lib.stat().st_size
    if damage == "truncate":
        lib.write_bytes(lib.read_bytes()[: size // 3])
    elif damage == "garbage":
        lib.write_bytes(b"\0" * size)
    else:
        (lib.parent / (lib.name + ".sha256")).unlink()
    assert not c_build.cached_ok(lib)
    with caplog.at_level(logging.WARNING, logger="tartlet.engine.kernels.c_build"):
        assert build(tmp_path) == lib
    assert "rebuilding" in caplog.text
    assert lib.stat().st_size == size and c_build.cached_ok(lib) and answer(lib) == 42


def test_truncated_kernel_library_is_rebuilt_on_load(cc, monkeypatch, cache):
    """The engine's own load path: a truncated cpu_kernels .so is noticed and rebuilt."""
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    assert cpu_kernels.load() is not None
    (lib,) = cache.glob("cpu_kernels-*.so")
    # a new file, not the mapped one cut in place (that would crash this process, as it would any user of it)
    cut = lib.with_suffix(".cut")
    cut.write_bytes(lib.read_bytes()[:4096])
    os.replace(cut, lib)
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    assert cpu_kernels.load() is not None
    assert c_build.cached_ok(lib)


def test_file_the_loader_refuses_is_rebuilt_once(cc, monkeypatch, cache, tmp_path, caplog):
    """Sidecar and file agree but dlopen fails (say, written by a broken
    toolchain): open_library rebuilds once before giving up."""
    calls = []

    def fake_build(rebuild=False):
        calls.append(rebuild)
        if not rebuild:
            bad = tmp_path / "bad.so"
            bad.write_bytes(b"not an ELF file")
            return bad
        return build(tmp_path, rebuild=True)

    with caplog.at_level(logging.WARNING, logger="tartlet.engine.kernels.c_build"):
        lib = c_build.open_library(fake_build, "TARTLET_TEST_KERNELS", "test kernels", "using nothing")
    assert lib is not None and lib.answer() == 42
    assert calls == [False, True] and "rebuilding it" in caplog.text


@pytest.fixture
def hanging_cc(tmp_path, monkeypatch):
    """A compiler that answers --version and then hangs on every compile."""
    script = tmp_path / "hang-cc"
    pid_file = tmp_path / "hang.pid"
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "--version" ]; then echo "hang-cc 1.0"; exit 0; fi\n'
        f"sleep 60 & echo $! > {pid_file}\nwait\n"
    )
    script.chmod(0o755)
    monkeypatch.setenv("CC", str(script))
    monkeypatch.setenv("TARTLET_CC_TIMEOUT", "0.5")
    return script, pid_file


def test_hung_compiler_times_out(cache, tmp_path, hanging_cc):
    script, pid_file = hanging_cc
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        build(tmp_path)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert str(script) in msg and "-O1 -shared -fPIC" in msg and "0.5 s" in msg and "TARTLET_CC_TIMEOUT" in msg
    # the whole process group is gone, the compiler's children included
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("the hung compiler's child process survived the timeout")
    assert not list(cache.glob("answer-*")), "a timed-out build left a library in the cache"


def test_hung_compiler_falls_back_to_pytorch(monkeypatch, cache, hanging_cc, caplog):
    monkeypatch.setattr(cpu_kernels, "_loaded", False)
    with caplog.at_level(logging.WARNING, logger="tartlet.engine.kernels.c_build"):
        assert cpu_kernels.load() is None
    assert "fused CPU kernels unavailable, using the PyTorch path" in caplog.text and "did not finish" in caplog.text


def test_bad_timeout_setting_is_named(monkeypatch, cache, tmp_path, cc):
    monkeypatch.setenv("TARTLET_CC_TIMEOUT", "soon")
    with pytest.raises(RuntimeError, match="TARTLET_CC_TIMEOUT.*'soon'"):
        build(tmp_path)


def test_cache_key_covers_source_flags_and_compiler(cc, cache, tmp_path, monkeypatch):
    lib = build(tmp_path)
    src = tmp_path / "answer.c"
    src.write_text(SOURCE + "/* edited */\n")
    edited = build(tmp_path)
    flagged = c_build.compile_library("answer", src, ["-O2", "-shared", "-fPIC"])
    monkeypatch.setattr(c_build, "_compiler_identity", lambda cc, timeout: "another compiler 99")
    other_cc = build(tmp_path)
    assert len({lib, edited, flagged, other_cc}) == 4


def test_concurrent_builders_do_not_corrupt_each_other(cc, cache, tmp_path):
    """Threads stand in for processes: each builds in its own temporary
    folder and moves the result into place, so every caller gets a whole
    library and the cache ends with one valid file."""
    src = tmp_path / "answer.c"
    src.write_text(SOURCE)
    results, errors = [], []

    def worker():
        try:
            results.append(c_build.compile_library("answer", src, ["-O1", "-shared", "-fPIC"], rebuild=True))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    (lib,) = results[:1]
    assert c_build.cached_ok(lib) and answer(lib) == 42
    assert sorted(p.name for p in cache.iterdir()) == [lib.name, lib.name + ".sha256"]
