"""``codeact-agent`` on the real default model: the model's (or the given)
Python runs in the host's WebAssembly sandbox, its output or error is in the
context before the next step, and the run ends with an answer. Malicious
snippets end with clear errors fed back to the model while the server and
other inferlets go on. Natively here; as a component in the ``wasm`` test.

The sandbox's runner component is built on first use (about a minute,
cached), so the module is marked ``wasm``; SmolLM2-135M writes poor code,
so most tests give the snippets (``code``) and assert the flow."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from harness import assert_no_leaks, run  # noqa: E402
from tartlet.runtime.instance import Status  # noqa: E402
from tartlet.runtime.program import find_program  # noqa: E402
from tartlet.sdk.sandbox import STATUSES  # noqa: E402

pytestmark = [pytest.mark.wasm]


async def run_ok(runtime, args):
    inst = await run(runtime, find_program("codeact-agent"), args)
    assert inst.status is Status.FINISHED, f"{inst.error}\n{inst.traceback}"
    return inst.result


def check_fed_back(r):
    """Each step's code and output are in the context, in order, before the answer."""
    pos = 0
    for s in r["steps"]:
        block = f"Code:\n```python\n{s['code']}\n```\nOutput:\n{s['output']}\n"
        at = r["transcript"].find(block, pos)
        assert at >= 0, (block, r["transcript"])
        pos = at + len(block)
    assert r["transcript"].find("Answer:", pos) > 0 and r["answer"]


async def test_given_code_runs_in_the_sandbox_and_its_output_reaches_the_answer(runtime, host_state):
    host_state.code_sandbox.prepare()
    r = await run_ok(runtime, {
        "prompt": "What is the sum of the integers from 1 to 100?",
        "code": ["import sys\nplatform = sys.platform\ntotal = sum(range(1, 101))", "print(platform, total)"],
        "max_steps": 2, "think_tokens": 16, "max_tokens": 32,
    })
    first, second = r["steps"]
    assert first["given"] and second["given"]
    assert (first["status"], first["stdout"], first["output"]) == ("ok", "", "(no output)")
    # the second snippet sees the first one's variables (rerun as setup), and ran on WASI
    assert (second["status"], second["stdout"], second["error"]) == ("ok", "wasi 5050\n", None)
    assert "Output:\nwasi 5050\nThought:" in r["transcript"]
    check_fed_back(r)
    assert r["finish_reason"] in ("eos", "length", "stop")


async def test_model_written_code_runs_and_is_fed_back(runtime):
    r = await run_ok(runtime, {"prompt": "What is 12 * 34?", "max_steps": 1, "think_tokens": 16, "code_tokens": 48, "max_tokens": 32})
    [step] = r["steps"]  # the first step always writes code
    assert not step["given"] and step["code"].strip() and step["status"] in STATUSES
    assert (step["status"] == "ok") == (step["error"] is None)
    check_fed_back(r)


MALICIOUS = [
    ("while True:\n    pass", "timeout", "TimeoutError: the code ran past its time limit of 1 s"),
    ("data = bytearray(10 ** 9)", "memory", "MemoryError"),
    ("print(open('/etc/passwd').read())", "error", "FileNotFoundError"),
    ("import socket\nsocket.create_connection(('127.0.0.1', 80))", "error", "ModuleNotFoundError: No module named 'socket'"),
    ("import os\nos.system('touch /tmp/pwned')", "error", "AttributeError"),
]


@pytest.mark.slow  # several agent runs
async def test_malicious_code_ends_with_clear_errors_fed_back_and_harms_nothing(runtime, host_state):
    host_state.code_sandbox.prepare()
    agent = asyncio.ensure_future(run_ok(runtime, {
        "prompt": "Try these snippets.", "code": [c for c, _, _ in MALICIOUS], "max_steps": len(MALICIOUS),
        "time_limit_s": 1, "memory_mb": 32, "think_tokens": 8, "max_tokens": 24,
    }))
    # another inferlet on the same server meanwhile
    other = await run(runtime, "text-completion", {"prompt": "Say hi.", "max_tokens": 8})
    r = await agent
    assert other.status is Status.FINISHED and other.result["text"]
    assert [s["status"] for s in r["steps"]] == [st for _, st, _ in MALICIOUS]
    for s, (_, _, err) in zip(r["steps"], MALICIOUS):
        assert err in s["error"] and s["error"] in s["output"], s
    check_fed_back(r)
    # and the sandbox still runs code
    ok = host_state.code_sandbox.run("print(6 * 7)").result(timeout=60)
    assert ok["stdout"] == "42\n"
    assert_no_leaks(host_state)


@pytest.mark.parametrize("args, msg", [
    ({}, "needs a non-empty string argument `prompt`"),
    ({"prompt": "x", "code": [""]}, "`code` must be a non-empty string"),
    ({"prompt": "x", "code": ["print(1)"] * 3, "max_steps": 2}, "3 snippets given in `code` but max_steps is 2"),
    ({"prompt": "x", "time_limit_s": 0}, "`time_limit_s` must be a positive number"),
    ({"prompt": "x", "code": "print(1)", "time_limit_s": 1000}, "time_limit_s must be in (0, 10]"),
])  # fmt: skip
async def test_bad_arguments_fail_clearly(runtime, args, msg):
    inst = await run(runtime, find_program("codeact-agent"), args)
    assert inst.status is Status.FAILED and msg in inst.error, inst.error


@pytest.mark.slow
async def test_codeact_agent_as_a_component(host_state):
    """The same flow sandboxed twice over: the agent is a WASM component,
    its snippets run in the code sandbox."""
    from tartlet.runtime.wasm import WasmRuntime

    rt = WasmRuntime(host_state)
    inst = await run(rt, find_program("codeact-agent"), {
        "prompt": "What is 2 to the power 10?", "code": ["print(2 ** 10)", "while True:\n    pass"],
        "max_steps": 2, "time_limit_s": 1, "think_tokens": 8, "max_tokens": 16,
    })
    assert inst.status is Status.FINISHED, f"{inst.error}\n{inst.traceback}"
    r = inst.result
    assert [(s["status"], s["stdout"]) for s in r["steps"]] == [("ok", "1024\n"), ("timeout", "")]
    check_fed_back(r)
    assert_no_leaks(host_state)
