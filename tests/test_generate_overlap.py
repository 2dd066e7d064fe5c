"""``ctx.generate(..., overlap=True)``: each next pass is queued before a step
is returned, so the caller's work overlaps the model. Same passes, same
tokens, same context afterwards as plain stepping; a generation left early
is closed with ``aclose`` and leaves a usable context."""

from __future__ import annotations

import pytest

from harness import inline_program, run, run_ok
from tartlet.host.api import HostApi
from tartlet.runtime.instance import Status

#: Each case generated twice (overlap off, then on), stepped with ``async
#: for``; the context then goes on with another turn. Returns both runs and,
#: per run, whether a pass was queued ahead when each step came back.
BOTH = """
from tartlet import Model, Sampler

CASES = [
    dict(max_tokens=12, eos=False),
    dict(max_tokens=40, eos=True),
    dict(max_tokens=24, eos=True, stop=[" and", "."]),
    dict(max_tokens=10, eos=True, sampler=dict(temperature=0.9, top_k=40, seed=5)),
]

async def one(model, case, overlap):
    kw = dict(case)
    s = kw.pop("sampler", None)
    ahead = []
    with model.new_context() as ctx:
        ctx.user("Count from one to twenty.")
        gen = ctx.generate(Sampler(**s) if s else None, overlap=overlap, **kw)
        steps = []
        async for step in gen:
            steps.append([step.tokens, step.text])
            ahead.append(gen._ahead is not None)
        ctx.user("And back?")
        more = await ctx.generate(max_tokens=4, eos=False).collect_text()
        return {"steps": steps, "tokens": gen.tokens, "text": gen.text, "finish": gen.finish_reason,
                "context": ctx.tokens, "kv_len": ctx.kv_len, "more": more}, ahead

async def main(args):
    model = Model.load()
    return [[await one(model, c, overlap) for overlap in (False, True)] for c in CASES]
"""


@pytest.mark.slow  # every step run with and without overlap
async def test_overlap_gives_the_same_steps(runtime, tmp_path):
    inst = await run(runtime, inline_program(tmp_path, BOTH))
    assert inst.status is Status.FINISHED, inst.error
    for (plain, plain_ahead), (over, over_ahead) in inst.result:
        assert over == plain
        assert not any(plain_ahead)
        # queued ahead after every step but the last (the generation ended there)
        assert over_ahead[:-1] == [True] * (len(over_ahead) - 1) and over_ahead[-1] is False
    assert {r[0][0]["finish"] for r in inst.result} >= {"length", "stop"}


async def test_overlap_queues_no_extra_pass(runtime, tmp_path, monkeypatch):
    calls = []
    orig = HostApi.forward
    monkeypatch.setattr(HostApi, "forward", lambda self, h, tokens, *a: calls.append(len(tokens)) or orig(self, h, tokens, *a))
    prog = inline_program(tmp_path, """
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("The capital of France is")
        gen = ctx.generate(max_tokens=9, eos=False, overlap=args["overlap"])
        async for _ in gen:
            pass
        return gen.tokens
""")
    counts = []
    for overlap in (False, True):
        calls.clear()
        toks = await run_ok(runtime, prog, {"overlap": overlap})
        counts.append(list(calls))
        assert len(toks) == 9
    assert counts[0] == counts[1]  # the prompt pass, then one single-token pass per later token


LEAVE_EARLY = """
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Once upon a time")
        gen = ctx.generate(max_tokens=50, eos=False, overlap=args["overlap"])
        got = []
        async for step in gen:
            got += step.tokens
            if len(got) == 5:
                break
        await gen.aclose()
        await gen.aclose()  # idempotent
        # the context goes on from the five tokens the caller saw
        ctx.fill(" and then")
        after = await ctx.generate(max_tokens=6, eos=False).collect_tokens()
        return {"got": got, "finish": gen.finish_reason, "context": ctx.tokens, "after": after}
"""


async def test_aclose_after_leaving_early(runtime, tmp_path):
    prog = inline_program(tmp_path, LEAVE_EARLY)
    plain = await run_ok(runtime, prog, {"overlap": False})
    over = await run_ok(runtime, prog, {"overlap": True})
    assert over == plain
    assert over["finish"] == "stop" and len(over["got"]) == 5


async def test_overlap_with_a_drafter_is_refused(runtime, tmp_path):
    prog = inline_program(tmp_path, """
from tartlet import Model

class Guess:
    def update(self, tokens):
        pass
    def draft(self):
        return []

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Hi")
        try:
            ctx.generate(drafter=Guess(), overlap=True)
        except ValueError as e:
            return str(e)
""")
    assert "drafter" in await run_ok(runtime, prog)


@pytest.mark.slow
@pytest.mark.wasm
async def test_component_overlap_matches_native(runtime, host_state, tmp_path):
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from tartlet.runtime.wasm import WasmRuntime

    prog = inline_program(tmp_path, LEAVE_EARLY)
    native = await run_ok(runtime, prog, {"overlap": True})
    sandboxed = await run(WasmRuntime(host_state), prog, {"overlap": True})
    assert sandboxed.status is Status.FINISHED, f"{sandboxed.error}\n{sandboxed.traceback}"
    assert sandboxed.result == native
