"""What inferlets print (stdout/stderr) goes to the server log with user and
instance id, and to the client when the launch asks (``logs``), bounded per
instance: native instances (in-process) and sandboxed uploads (WASM) alike."""

from __future__ import annotations

import textwrap
import time

import pytest

from harness import inline_program, run_ok

PRINTS = """
import sys

async def main(args):
    print("hello from", args["who"])
    print("two", "lines\\nsecond line", end="")
    print(" (joined)")
    sys.stderr.write("to stderr\\n")
    sys.stdout.write("no newline at the end")
    return "done"
"""

EXPECTED = [("stdout", "hello from X"), ("stdout", "two lines"), ("stdout", "second line (joined)"),
            ("stderr", "to stderr"), ("stdout", "no newline at the end")]


@pytest.fixture
def runtime(runtime):
    runtime.capture_stdio = True  # as the server sets it
    yield runtime
    runtime.capture_stdio = False


async def test_native_print_goes_to_the_instance_log_and_sink(runtime, tmp_path, caplog):
    caplog.set_level("INFO", logger="tartlet.inferlet")
    lines: list[tuple[str, str]] = []
    inst = runtime.launch(inline_program(tmp_path, textwrap.dedent(PRINTS), "prints"), {"who": "X"}, owner="alice")
    inst.stdio.sink = lambda stream, line: lines.append((stream, line))
    assert await inst.wait() == "done"
    assert lines == EXPECTED
    logged = [r.getMessage() for r in caplog.records if r.name == "tartlet.inferlet"]
    assert f"user=alice instance={inst.id} stdout: hello from X" in logged
    assert f"user=alice instance={inst.id} stderr: to stderr" in logged


async def test_native_log_is_bounded_per_instance(runtime, tmp_path):
    from tartlet.runtime.stdio import MAX_LOG_BYTES

    code = "async def main(args):\n    for i in range(4000):\n        print('x' * 99)\n"
    lines: list[tuple[str, str]] = []
    inst = runtime.launch(inline_program(tmp_path, code, "chatty"), {})
    inst.stdio.sink = lambda stream, line: lines.append((stream, line))
    await inst.wait()
    assert len(lines) == MAX_LOG_BYTES // 100 + 1  # 100 bytes a line, then one note
    assert lines[-1][1].startswith("[output truncated")


async def test_print_outside_an_instance_is_untouched(runtime, tmp_path, capsys):
    await run_ok(runtime, inline_program(tmp_path, "async def main(args):\n    print('inside')\n", "quiet"))
    print("outside")
    out = capsys.readouterr().out
    assert "outside" in out and "inside" not in out


@pytest.mark.slow
@pytest.mark.wasm
async def test_sandboxed_print_reaches_the_server_log_and_the_client(tmp_path):
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from server_harness import ServerProcess, add_users, write_config, write_inferlet
    from tartlet.client import Client

    cfg = write_config(tmp_path / "config.toml", tmp_path / "data")
    keys = add_users(cfg, "alice")
    prog = write_inferlet(tmp_path / "progs", "prints", PRINTS)
    server = ServerProcess(cfg)
    try:
        async with await Client.connect(server.url, keys["alice"]) as c:
            inst = await c.launch(prog, {"who": "X"}, logs=True, time_limit_s=600)  # uploaded: built, run sandboxed
            ex = await inst.wait()
            assert ex.ok and ex.result == "done", ex
            assert inst.logs == EXPECTED
            assert {i["id"]: i["runtime"] for i in await c.list()}[inst.id] == "wasm"
            quiet = await c.launch(prog, {"who": "Y"})  # no logs asked: the client gets none, the server log does
            assert (await quiet.wait()).ok and quiet.logs == []
        deadline = time.time() + 10
        log = ""
        while time.time() < deadline and f"instance={quiet.id} stdout: hello from Y" not in log:
            time.sleep(0.1)
            log = open(server.log.name).read()
        assert f"user=alice instance={inst.id} stdout: hello from X" in log
        assert f"user=alice instance={inst.id} stderr: to stderr" in log
        assert f"user=alice instance={quiet.id} stdout: hello from Y" in log
    finally:
        server.stop()
