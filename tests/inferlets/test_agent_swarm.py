"""``agent-swarm`` on the real default model: a coordinator and worker
agents (child inferlets) exchange their instructions and replies over
messaging topics, the workers read each other's replies from a broadcast
board between rounds, and the coordinator combines the last replies into
one answer. The test checks that the messages flowed: what each worker
returned as its replies is what the coordinator received on the topic, the
board the test itself subscribed to carried the first round's replies, the
workers read it, and the last replies are in the coordinator's context."""

from __future__ import annotations

import json

import pytest

from harness import assert_no_leaks, run
from tartlet.runtime.instance import Status
from tartlet.runtime.program import find_program

ARGS = {"prompt": "What is the capital of France?", "rounds": 2, "worker_tokens": 16, "max_tokens": 32}


def check_swarm(r: dict, board: list) -> None:
    names = [w["name"] for w in r["workers"]]
    assert names == ["solver", "checker"] and all(w["status"] == "finished" for w in r["workers"])
    base = f"swarm/{r['swarm_id']}"
    got = [m for m in r["messages"] if m["topic"] == base + "/replies"]
    # every reply a worker wrote came to the coordinator over the replies topic
    for w in r["workers"]:
        assert len(w["replies"]) == 2 and all(w["replies"])
        assert [m["text"] for m in got if m["from"] == w["name"]] == w["replies"]
        assert [m["round"] for m in got if m["from"] == w["name"]] == [0, 1]
        assert w["boards_read"] == 1  # round 2 began with the others' replies
    sent = [m for m in r["messages"] if m["from"] == "coordinator" and m["topic"].startswith(base + "/to/")]
    assert sorted((m["to"], m["round"]) for m in sent) == sorted((n, k) for n in names for k in (0, 1))
    # the board (a broadcast topic) carried round 0's replies, as an outside subscriber saw
    assert len(board) == 1
    posted = json.loads(board[0])
    assert posted["round"] == 0 and [(x["from"], x["text"]) for x in posted["replies"]] == [(w["name"], w["replies"][0]) for w in r["workers"]]
    # the coordinator's context holds the last round's replies, then its answer
    for w in r["workers"]:
        assert f"[{w['name']}] {w['replies'][1]}" in r["transcript"]
    assert r["answer"] and r["answer"] in r["transcript"] and r["finish_reason"] in ("eos", "length")


async def swarm(runtime, host_state, swarm_id: str) -> dict:
    bus = host_state.bus
    sid = bus.subscribe("", f"swarm/{swarm_id}/board")  # the test listens on the board too
    try:
        inst = await run(runtime, find_program("agent-swarm"), {**ARGS, "swarm_id": swarm_id})
        assert inst.status is Status.FINISHED, f"{inst.error}\n{inst.traceback}"
        board = []
        while (f := bus.next(sid)).done():
            board.append(f.result())
        f.cancel()
    finally:
        bus.unsubscribe(sid)
    return inst.result, board


async def test_agent_swarm_workers_exchange_messages_and_answer(runtime, host_state):
    r, board = await swarm(runtime, host_state, "t1")
    check_swarm(r, board)
    assert_no_leaks(host_state)  # the shared preamble snapshot was deleted, every context freed


@pytest.mark.parametrize("args, msg", [
    ({}, "needs a non-empty string argument `prompt`"),
    ({"prompt": "x", "workers": []}, "`workers` must be a list of 1 to 16"),
    ({"prompt": "x", "workers": ["a", "a"]}, "two workers are named 'a'"),
    ({"prompt": "x", "workers": ["bad name"]}, "a worker's name must be"),
    ({"prompt": "x", "rounds": 0}, "`rounds` must be an int >= 1"),
    ({"prompt": "x", "role": "boss"}, "`role` must be 'coordinator' or 'worker'"),
    ({"role": "worker", "name": "w"}, "a worker needs `topics` and `snapshot`"),
])  # fmt: skip
async def test_bad_arguments_fail_clearly(runtime, args, msg):
    inst = await run(runtime, find_program("agent-swarm"), args)
    assert inst.status is Status.FAILED and msg in inst.error, inst.error


@pytest.mark.slow
@pytest.mark.wasm
async def test_agent_swarm_as_components(host_state):
    """Coordinator and workers all sandboxed: one component, three instances."""
    pytest.importorskip("componentize_py")
    from tartlet.runtime.wasm import WasmRuntime

    r, board = await swarm(WasmRuntime(host_state), host_state, "t2")
    check_swarm(r, board)
    assert_no_leaks(host_state)
