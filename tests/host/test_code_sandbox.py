"""The host's code sandbox (``code-run``, ``tartlet.sdk.sandbox``): Python run
in a fresh WebAssembly instance with a time limit and a memory cap. Snippets
that loop, allocate without end, or reach for files, sockets or processes
end with a clear error in the result; the server and other inferlets go on.

The first run builds the runner component with componentize-py (about a
minute, cached on disk afterwards), so the module is marked ``wasm``."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from harness import inline_program, run  # noqa: E402
from tartlet.host.code_sandbox import MIN_MEMORY_MB, CodeSandbox  # noqa: E402
from tartlet.runtime.instance import Status  # noqa: E402

pytestmark = [pytest.mark.wasm]


@pytest.fixture(scope="module")
def sandbox():
    sb = CodeSandbox(max_time_s=5, max_memory_mb=128)
    sb.prepare()
    yield sb
    sb.close()


def go(sb: CodeSandbox, code: str, **kw) -> dict:
    return sb.run(code, **kw).result(timeout=60)


def test_code_runs_in_wasm_and_its_output_comes_back(sandbox):
    r = go(sandbox, "import sys\nprint(sys.platform)\nx = sum(range(101))\nx")
    assert r["status"] == "ok" and r["error"] is None
    assert r["stdout"] == "wasi\n5050\n"  # the guest is CPython on WASI; a final expression is echoed


def test_setup_runs_first_in_the_same_namespace_with_its_output_discarded(sandbox):
    r = go(sandbox, "print(total * 2)", setup="total = 21\nprint('not shown')")
    assert (r["status"], r["stdout"]) == ("ok", "42\n")
    # and nothing survives between calls
    r = go(sandbox, "print(total)")
    assert r["status"] == "error" and r["error"].endswith("NameError: name 'total' is not defined")


def test_an_exception_comes_back_as_the_user_code_traceback(sandbox):
    r = go(sandbox, "x = 1\n1 / 0")
    assert r["status"] == "error"
    assert r["error"].startswith("Traceback") and 'File "<code>", line 2' in r["error"]
    assert r["error"].endswith("ZeroDivisionError: division by zero") and "code_runner_app" not in r["error"]


def test_an_infinite_loop_is_stopped_at_the_time_limit(sandbox):
    t0 = time.monotonic()
    r = go(sandbox, "while True:\n    pass", time_limit_s=0.5)
    assert r["status"] == "timeout" and "time limit of 0.5 s" in r["error"]
    assert 0.4 <= r["elapsed_ms"] / 1000 < 5 and time.monotonic() - t0 < 10


@pytest.mark.parametrize("code", [
    "x = bytearray(10**9)",  # one huge allocation
    "chunks = []\nwhile True:\n    chunks.append('x' * 10**6)",  # growth until the cap
])  # fmt: skip
def test_a_huge_allocation_ends_with_memory_error(sandbox, code):
    r = go(sandbox, code, memory_mb=32)
    assert r["status"] == "memory" and "MemoryError" in r["error"] and "32 MiB" in r["error"]
    assert go(sandbox, "print('still fine')")["stdout"] == "still fine\n"


def test_host_files_cannot_be_read_or_written(sandbox, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host data")
    r = go(sandbox, f"print(open({str(secret)!r}).read())")
    assert r["status"] == "error" and "FileNotFoundError" in r["error"] and "host data" not in r["stdout"]
    r = go(sandbox, f"open({str(tmp_path / 'new.txt')!r}, 'w').write('x')")
    assert r["status"] == "error" and not (tmp_path / "new.txt").exists()
    r = go(sandbox, "import os\nprint(os.listdir('/'))")
    assert r["status"] == "error" and "FileNotFoundError" in r["error"]


@pytest.mark.parametrize("code", [
    "import socket\nsocket.create_connection(('127.0.0.1', 80))",
    "import urllib.request\nurllib.request.urlopen('http://127.0.0.1/')",
    "import subprocess\nsubprocess.run(['ls'])",
    "import os\nos.system('ls')",
])  # fmt: skip
def test_no_network_and_no_processes(sandbox, code):
    r = go(sandbox, code)
    assert r["status"] == "error" and r["error"].splitlines()[-1].split(":")[0].endswith(("Error", "Exception")), r


def test_output_past_the_cap_is_dropped(tmp_path):
    sb = CodeSandbox(max_time_s=5, max_output_bytes=100)
    try:
        r = sb.run("for i in range(1000):\n    print(i)").result(timeout=60)
    finally:
        sb.close()
    assert r["status"] == "ok" and r["truncated"] and len(r["stdout"]) == 100 and r["stdout"].startswith("0\n1\n2\n")


@pytest.mark.parametrize("kw, msg", [
    ({"time_limit_s": 0}, "time_limit_s must be in (0, 5]"),
    ({"time_limit_s": 60}, "time_limit_s must be in (0, 5]"),
    ({"memory_mb": 1}, f"memory_mb must be an int in [{MIN_MEMORY_MB}, 128]"),
    ({"memory_mb": 4096}, "memory_mb must be an int in"),
    ({"code": b"print(1)"}, "code must be a string"),
    ({"setup": 3}, "setup must be a string"),
])  # fmt: skip
def test_bad_arguments_are_refused_with_the_bound(sandbox, kw, msg):
    args = {"code": "print(1)", **kw}
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        sandbox.run(**args)


@pytest.mark.slow  # code runs beside a generation
async def test_inferlet_runs_code_while_another_inferlet_generates(runtime, host_state, tmp_path):
    """Through the SDK: a snippet looping in the sandbox blocks neither the
    event loop nor the engine: a second inferlet generates meanwhile."""
    looper = inline_program(tmp_path, """
        from tartlet.sdk import sandbox

        async def main(args):
            r = await sandbox.run_python("while True:\\n    pass", time_limit_s=args["t"])
            ok = await sandbox.run_python("import sys; sys.platform")
            return {"loop": [r.status, r.error, r.elapsed_ms], "after": ok.stdout, "feedback": r.feedback()}
    """, name="looper")
    host_state.code_sandbox.prepare()
    t0 = time.monotonic()
    loop_task = asyncio.ensure_future(run(runtime, looper, {"t": 8}))
    await asyncio.sleep(0.2)
    gen = await run(runtime, "text-completion", {"prompt": "Say hi.", "max_tokens": 4})
    gen_done = time.monotonic() - t0
    looped = await loop_task
    assert gen.status is Status.FINISHED and looped.status is Status.FINISHED, (gen.error, looped.error)
    status, error, elapsed_ms = looped.result["loop"]
    assert status == "timeout" and elapsed_ms >= 7900
    assert gen_done < elapsed_ms / 1000  # generation finished while the loop was still running
    assert looped.result["after"] == "'wasi'\n"
    assert looped.result["feedback"] == error and error.startswith("TimeoutError")


async def test_bad_limits_raise_in_the_inferlet(runtime, tmp_path):
    prog = inline_program(tmp_path, """
        from tartlet.sdk import sandbox

        async def main(args):
            await sandbox.run_python("print(1)", time_limit_s=1e9)
    """, name="badlimit")
    inst = await run(runtime, prog)
    assert inst.status is Status.FAILED and "time_limit_s must be in (0, 10]" in inst.error


def test_one_user_cannot_fill_the_queue():
    from tartlet.host.code_sandbox import LimitError

    sb = CodeSandbox(max_time_s=5, workers=1, max_pending_per_user=2)
    try:
        loops = [sb.run("while True:\n    pass", time_limit_s=0.5, owner="alice") for _ in range(2)]
        with pytest.raises(LimitError, match=r"user 'alice' already has 2 code runs queued or running"):
            sb.run("print(1)", owner="alice")
        other = sb.run("print('bob ran')", owner="bob")  # another user is not refused
        assert [f.result(timeout=60)["status"] for f in loops] == ["timeout", "timeout"]
        assert other.result(timeout=60)["stdout"] == "bob ran\n"
        assert sb.run("print(2)", owner="alice").result(timeout=60)["stdout"] == "2\n"  # slots given back
    finally:
        sb.close()


def test_code_config_table_is_checked_and_applied(host_state):
    from tartlet.server.app import configure_code
    from tartlet.server.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"\[code\] max_memory_mb"):
        config_from_dict({"code": {"max_memory_mb": 16}})
    with pytest.raises(ConfigError, match="default_memory_mb .128. is larger than max_memory_mb .64."):
        config_from_dict({"code": {"max_memory_mb": 64, "default_memory_mb": 128}})
    saved, host_state.code_sandbox = host_state.code_sandbox, None  # configure_code closes the one it replaces
    try:
        configure_code(host_state, config_from_dict({"code": {"max_time_s": 2.5, "max_memory_mb": 100, "workers": 1}}))
        sb = host_state.code_sandbox
        assert (sb.max_time_s, sb.max_memory_mb, sb.default_memory_mb) == (2.5, 100, 64)
        with pytest.raises(ValueError, match=r"time_limit_s must be in \(0, 2.5\]"):
            sb.run("print(1)", time_limit_s=3)
        configure_code(host_state, config_from_dict({"code": {"enabled": False}}))
        assert host_state.code_sandbox is None
        from tartlet.host.api import HostApi

        with pytest.raises(RuntimeError, match=r"running code is disabled on this host \(\[code\] enabled = false\)"):
            HostApi(host_state).code_run("print(1)")
    finally:
        if host_state.code_sandbox is not None:
            host_state.code_sandbox.close()
        host_state.code_sandbox = saved


@pytest.mark.parametrize("code", [
    "import time\ntime.sleep(60)",  # blocked in the host's WASI sleep: no epoch deadline fires there
    "import select\nselect.select([], [], [], 60)",
])  # fmt: skip
def test_the_time_limit_holds_while_the_guest_is_blocked(sandbox, code):
    t0 = time.monotonic()
    r = go(sandbox, "print('before')\n" + code, time_limit_s=1)
    assert r["status"] == "timeout" and "time limit of 1 s" in r["error"]
    assert r["stdout"] == "before\n"  # the output so far comes back
    assert time.monotonic() - t0 < 10 and r["elapsed_ms"] < 10_000  # not 60 s
    assert go(sandbox, "print('next')")["stdout"] == "next\n"  # a new worker took over


def _wait_running(sb: CodeSandbox, owner: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while sb.running(owner) != n:
        assert time.monotonic() < deadline, f"{owner} has {sb.running(owner)} runs executing, expected {n}"
        time.sleep(0.02)


def test_cancelling_a_running_call_frees_its_worker_at_once():
    sb = CodeSandbox(max_time_s=30, workers=1)
    try:
        blocked = sb.run("import time\ntime.sleep(60)", owner="alice")
        _wait_running(sb, "alice", 1)
        t0 = time.monotonic()
        assert blocked.cancel()
        after = sb.run("print('free again')", owner="bob").result(timeout=60)
        assert after["stdout"] == "free again\n" and time.monotonic() - t0 < 10  # not the 30 s limit
        assert sb.running("alice") == 0
    finally:
        sb.close()


def test_each_user_gets_a_share_of_the_workers():
    """Alice's two blocked runs hold one of the two workers (her share);
    Bob's run takes the other at once instead of waiting for hers."""
    sb = CodeSandbox(max_time_s=20, workers=2, max_running_per_user=1)
    try:
        slow = [sb.run("import time\ntime.sleep(60)", time_limit_s=4, owner="alice") for _ in range(2)]
        _wait_running(sb, "alice", 1)
        bob = sb.run("print('bob ran')", owner="bob").result(timeout=60)
        assert bob["stdout"] == "bob ran\n"
        assert not slow[0].done() and not slow[1].done()  # bob did not wait for alice's runs
        assert sb.running("alice") == 1  # her second run waits for her first
        assert [f.result(timeout=60)["status"] for f in slow] == ["timeout", "timeout"]
    finally:
        sb.close()


@pytest.mark.parametrize("code, size", [
    ("print('x' * 20000)", 20001),  # one large print
    ("import os\nn = os.write(1, b'y' * 30000)", 30000),  # one large low-level write
    ("import sys\nn = sys.stderr.write('z' * 12000)", 12000),
])  # fmt: skip
def test_large_writes_come_back_whole(sandbox, code, size):
    r = go(sandbox, code)
    assert r["status"] == "ok" and len(r["stdout"]) == size and not r["truncated"], (len(r["stdout"]), r["truncated"])


def test_a_large_write_past_the_cap_says_truncated():
    sb = CodeSandbox(max_time_s=5, max_output_bytes=1000)
    try:
        r = sb.run("print('x' * 20000)").result(timeout=60)
    finally:
        sb.close()
    assert r["status"] == "ok" and r["truncated"] and r["stdout"] == "x" * 1000


async def test_a_run_is_stopped_when_its_instance_ends(runtime, host_state, tmp_path):
    """Aborting an inferlet that waits on a blocked snippet kills the
    snippet's worker: the user has no run executing right after."""
    prog = inline_program(tmp_path, """
        from tartlet import sandbox

        async def main(args):
            await sandbox.run_python("import time\\ntime.sleep(60)", time_limit_s=10)
    """, name="sleeper")
    sb = host_state.code_sandbox
    sb.prepare()
    inst = runtime.launch(prog, {}, owner="carol")
    await asyncio.to_thread(_wait_running, sb, "carol", 1)
    inst.abort("test")
    await inst.wait()
    t0 = time.monotonic()
    while sb.running("carol"):
        assert time.monotonic() - t0 < 5, "the run still holds a worker after its instance ended"
        await asyncio.sleep(0.02)
    assert inst.status is Status.ABORTED
