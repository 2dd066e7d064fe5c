"""Host-side decoding (``HostApi.generate``, used by ``collect_text`` /
``collect_tokens``): the same tokens, text, finish reason and context as
stepping token by token, one host call per generation instead of one per
token, and the steps of concurrent generations kept in one batch."""

from __future__ import annotations

import asyncio

import pytest

from harness import inline_program, run
from tartlet.host.api import HostApi
from tartlet.runtime.instance import Status

#: Generates from one prompt twice per case, once drained with collect_*
#: (host-side) and once stepped with ``async for`` (per token); returns both.
BOTH = """
from tartlet import Model, Sampler

CASES = [
    dict(max_tokens=12, eos=False),
    dict(max_tokens=40, eos=True),
    dict(max_tokens=10, eos=True, sampler=dict(temperature=0.9, top_k=40, seed=5)),
]

async def one(model, case, stepped):
    kw = dict(case)
    s = kw.pop("sampler", None)
    with model.new_context() as ctx:
        ctx.user("Count from one to twenty.")
        gen = ctx.generate(Sampler(**s) if s else None, **kw)
        if stepped:
            async for _ in gen:
                pass
        else:
            await gen.collect_tokens()
        ctx.user("And back?")  # the context goes on from where the generation left it
        more = await ctx.generate(max_tokens=4, eos=False).collect_text()
        return {"tokens": gen.tokens, "text": gen.text, "finish": gen.finish_reason,
                "context": ctx.tokens, "kv_len": ctx.kv_len, "more": more}

async def main(args):
    model = Model.load()
    return [[await one(model, c, stepped) for stepped in (False, True)] for c in CASES]
"""


async def run_counting_generate(runtime, tmp_path, monkeypatch, source: str):
    """Run ``source`` to the end; returns the instance and the
    ``(first_step, max_steps)`` of each ``HostApi.generate`` call it made."""
    calls = []
    orig = HostApi.generate
    monkeypatch.setattr(HostApi, "generate", lambda self, *a: calls.append(a[4:6]) or orig(self, *a))
    inst = await run(runtime, inline_program(tmp_path, source))
    assert inst.status is Status.FINISHED, inst.error
    return inst, calls


@pytest.mark.slow  # every generation run twice
async def test_collect_matches_stepping(runtime, tmp_path, monkeypatch):
    inst, calls = await run_counting_generate(runtime, tmp_path, monkeypatch, BOTH)
    for host_side, stepped in inst.result:
        assert host_side == stepped
    assert inst.result[0][0]["finish"] == "length" and len(inst.result[0][0]["tokens"]) == 12
    assert inst.result[2][0]["finish"] in ("length", "eos")
    # one host call per collected generation (3 cases + their follow-ups, x2), none for stepped ones
    assert len(calls) == 9
    assert (0, 12) in calls


#: Steps one generation per case with ``chunk=4`` and token by token; returns
#: both with the tokens of each step.
CHUNKED = """
from tartlet import Model, Sampler

CASES = [
    dict(max_tokens=13, eos=False),
    dict(max_tokens=40, eos=True),
    dict(max_tokens=10, eos=True, sampler=dict(temperature=0.9, top_k=40, seed=5)),
    dict(max_tokens=9, eos=False, stop=["zzz"]),  # a stop string: token by token
]

async def one(model, case, chunk):
    kw = dict(case)
    s = kw.pop("sampler", None)
    with model.new_context() as ctx:
        ctx.user("Count from one to twenty.")
        gen = ctx.generate(Sampler(**s) if s else None, chunk=chunk, **kw)
        steps, texts = [], []
        async for step in gen:
            steps.append(len(step.tokens))
            texts.append(step.text)
        ctx.user("And back?")
        more = await ctx.generate(max_tokens=4, eos=False).collect_text()
        return {"tokens": gen.tokens, "text": gen.text, "streamed": "".join(texts), "finish": gen.finish_reason,
                "context": ctx.tokens, "kv_len": ctx.kv_len, "more": more, "steps": steps}

async def main(args):
    model = Model.load()
    return [[await one(model, c, chunk) for chunk in (4, None)] for c in CASES]
"""


async def test_chunked_steps_match_token_by_token(runtime, tmp_path, monkeypatch):
    """``generate(chunk=4)``: steps of 1, 2, 4, 4, ... tokens decoded
    host-side (one ``generate`` host call a step), the same tokens, text,
    streamed text, finish reason and context as one token a step; with a
    stop string it steps token by token."""
    inst, calls = await run_counting_generate(runtime, tmp_path, monkeypatch, CHUNKED)
    for chunked, stepped in inst.result:
        assert {k: v for k, v in chunked.items() if k != "steps"} == {k: v for k, v in stepped.items() if k != "steps"}
        assert chunked["text"] == chunked["streamed"]
        assert set(stepped["steps"]) == {1}
    assert inst.result[0][0]["steps"] == [1, 2, 4, 4, 2] and inst.result[0][0]["finish"] == "length"
    assert inst.result[3][0]["steps"] == [1] * 9
    # (first step, tokens) of each host call of case 0's chunked generation
    assert calls[:5] == [(0, 1), (1, 2), (3, 4), (7, 4), (11, 2)]


CONCURRENT = """
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.user(f"Say something about the number {args['i']}.")
        return await ctx.generate(max_tokens=args["n"], eos=False).collect_tokens()
"""


async def test_concurrent_generations_share_batches(runtime, host_state, tmp_path):
    """Each next pass is queued before the scheduler builds its next batch,
    so once all have started, one model call carries every generation."""
    prog = inline_program(tmp_path, CONCURRENT)
    sched = next(iter(host_state.models.values())).engine.scheduler
    n, k = 16, 4
    before = sched.stats.model_calls
    insts = await asyncio.gather(*(run(runtime, prog, {"i": i, "n": n}) for i in range(k)))
    assert all(i.status is Status.FINISHED and len(i.result) == n for i in insts)
    # n passes each (the prompt, then n - 1 tokens); starting apart costs at most k - 1 extra calls
    assert sched.stats.model_calls - before <= n + k - 1


STREAMING = """
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.user(f"Say something about the number {args['i']}.")
        gen = ctx.generate(max_tokens=args["n"], eos=False, chunk=1, overlap=True)  # a host token stream
        return [t for step in [s async for s in gen] for t in step.tokens]
"""


async def test_a_step_of_token_streams_wakes_the_loop_once(runtime, host_state, tmp_path):
    """The scheduler hands a step's tokens to its streams inside
    ``hold_wakeups`` (set by ``HostState.add_engine``): the inferlets'
    loop is woken about once a step, not once a stream (8 streams of 24
    tokens: 24 wake-ups where 112 were seen without it); the tokens are
    the same with it and without."""
    prog = inline_program(tmp_path, STREAMING)
    sched = next(iter(host_state.models.values())).engine.scheduler
    hold = sched.hold_wakeups
    assert hold is not None
    loop = asyncio.get_running_loop()
    original = loop.call_soon_threadsafe
    n, k = 24, 8

    async def streams(held: bool) -> tuple[list[list[int]], int, int]:
        wakeups = [0]

        def counting(*args, **kwargs):
            wakeups[0] += 1
            return original(*args, **kwargs)

        sched.hold_wakeups = hold if held else None
        before = sched.stats.model_calls
        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        try:
            insts = await asyncio.gather(*(run(runtime, prog, {"i": i, "n": n}) for i in range(k)))
        finally:
            del loop.call_soon_threadsafe
            sched.hold_wakeups = hold
        assert all(i.status is Status.FINISHED and len(i.result) == n for i in insts), [i.error for i in insts]
        return [i.result for i in insts], wakeups[0], sched.stats.model_calls - before

    tokens, wakeups, steps = await streams(held=True)
    assert wakeups <= steps + k  # about one a step (+ instances starting apart)
    assert (await streams(held=False))[0] == tokens


async def test_bad_arguments_queue_nothing(runtime, tmp_path):
    prog = inline_program(tmp_path, """
from tartlet import Model
from tartlet.sdk import _binding

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Hello")
        errors = []
        for steps in (0, -1, True):
            try:
                _binding.host().generate(ctx._h, ctx.pending, {"temperature": 0.0}, None, 0, steps, [])
            except ValueError as e:
                errors.append(str(e))
        return errors, ctx.kv_len
""")
    inst = await run(runtime, prog)
    assert inst.status is Status.FINISHED, inst.error
    errors, kv_len = inst.result
    assert len(errors) == 3 and all("max_steps" in e for e in errors)
    assert kv_len == 0


@pytest.mark.slow
@pytest.mark.wasm
async def test_component_collect_matches_native(runtime, host_state, tmp_path):
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from tartlet.runtime.wasm import WasmRuntime

    for i, source in enumerate((BOTH, CHUNKED)):
        prog = inline_program(tmp_path, source, f"inline{i}")
        native = await run(runtime, prog)
        sandboxed = await run(WasmRuntime(host_state), prog)
        assert sandboxed.status is Status.FINISHED, f"{sandboxed.error}\n{sandboxed.traceback}"
        assert sandboxed.result == native.result
