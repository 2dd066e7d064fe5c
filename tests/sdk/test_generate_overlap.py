"""``ctx.generate(..., overlap=True)``: the next passes run while the
caller works on a step (queued ahead one at a time, or, with an
engine-side sampler and no drafter or constraint, as a host token stream
that hands over every token sampled since the last step). Same passes,
same tokens, same context afterwards as plain stepping; a generation left
early is closed with ``aclose`` and leaves a usable context."""

from __future__ import annotations

import pytest

from harness import inline_program, run, run_ok
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
            ahead.append(gen._ahead is not None or gen._stream is not None)
        ctx.user("And back?")
        more = await ctx.generate(max_tokens=4, eos=False).collect_text()
        return {"steps": steps, "tokens": gen.tokens, "text": gen.text, "finish": gen.finish_reason,
                "context": ctx.tokens, "kv_len": ctx.kv_len, "more": more}, ahead

async def main(args):
    model = Model.load()
    return [[await one(model, c, overlap) for overlap in (False, True)] for c in CASES]
"""


def flat(run: dict) -> dict:
    """A run with its steps joined (a token stream's step may carry
    several tokens where stepping gives one each)."""
    steps = run["steps"]
    return {**run, "steps": [[t for toks, _ in steps for t in toks], "".join(text for _, text in steps)]}


@pytest.mark.slow  # every step run with and without overlap
async def test_overlap_gives_the_same_steps(runtime, tmp_path):
    inst = await run(runtime, inline_program(tmp_path, BOTH))
    assert inst.status is Status.FINISHED, inst.error
    for (plain, plain_ahead), (over, over_ahead) in inst.result:
        assert flat(over) == flat(plain)
        assert all(len(toks) == 1 for toks, _ in plain["steps"])
        assert not any(plain_ahead)
        # passes running after every step but the last (the generation ended there)
        assert over_ahead[:-1] == [True] * (len(over_ahead) - 1) and over_ahead[-1] is False
    assert {r[0][0]["finish"] for r in inst.result} >= {"length", "stop"}


async def test_overlap_queues_no_extra_pass(runtime, engine, tmp_path):
    """A token stream runs the passes stepping runs: the prompt pass, then
    one single-token pass per later token (the last token sampled is not
    run), with max_tokens and EOS stopping it on the host."""
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
    st = engine.scheduler.stats
    counts = []
    for overlap in (False, True):
        before = (st.batched_requests, st.tokens_computed, st.decode_steps)
        toks = await run_ok(runtime, prog, {"overlap": overlap})
        counts.append([b - a for a, b in zip(before, (st.batched_requests, st.tokens_computed, st.decode_steps))])
        assert len(toks) == 9
    assert counts[0] == counts[1]
    assert counts[1][2] == 8, counts


async def test_a_slow_caller_takes_several_tokens_a_step(runtime, tmp_path):
    """While the caller is busy between steps, the stream's passes go on: a
    step then carries every token sampled meanwhile, and the tokens, text
    and context are those of plain stepping."""
    prog = inline_program(tmp_path, """
import asyncio
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.user("Name three rivers.")
        gen = ctx.generate(max_tokens=24, eos=False, overlap=args["overlap"])
        sizes = []
        async for step in gen:
            sizes.append(len(step.tokens))
            await asyncio.sleep(args["pause"])
        return {"sizes": sizes, "tokens": gen.tokens, "text": gen.text, "context": ctx.tokens, "kv_len": ctx.kv_len}
""")
    plain = await run_ok(runtime, prog, {"overlap": False, "pause": 0})
    slow = await run_ok(runtime, prog, {"overlap": True, "pause": 0.1})
    assert max(slow.pop("sizes")) > 1
    assert set(plain.pop("sizes")) == {1}
    assert slow == plain


async def test_chunked_stream_steps(runtime, tmp_path):
    """``overlap=True`` with ``chunk=4``: steps of the next 1, 2, 4, 4, ...
    tokens of the token stream (the inferlet wakes once a chunk while the
    passes go on, a stream open beside every step but the last), the
    tokens, text and context of stepping; a stop string is still checked
    token by token."""
    prog = inline_program(tmp_path, """
from tartlet import Model

async def main(args):
    model = Model.load()
    out = []
    for kw in (dict(max_tokens=13, eos=False), dict(max_tokens=30, eos=False, stop=[" is 1000"])):
        runs = []
        for mode in ("stream", "step"):
            with model.new_context() as ctx:
                ctx.user("Count from one to twenty in words.")
                gen = ctx.generate(chunk=4, overlap=True, **kw) if mode == "stream" else ctx.generate(**kw)
                sizes, running = [], []
                async for step in gen:
                    sizes.append(len(step.tokens))
                    running.append(gen._stream is not None)
                runs.append({"sizes": sizes, "running": running, "tokens": gen.tokens, "text": gen.text,
                             "finish": gen.finish_reason, "context": ctx.tokens, "kv_len": ctx.kv_len})
        out.append(runs)
    return out
""")
    (chunked, stepped), (cut, cut_stepped) = await run_ok(runtime, prog)
    assert chunked["sizes"] == [1, 2, 4, 4, 2] and chunked["finish"] == "length"
    assert chunked["running"] == [True] * 4 + [False]
    assert set(stepped["sizes"]) == {1}
    for a, b in ((chunked, stepped), (cut, cut_stepped)):
        assert {k: v for k, v in a.items() if k not in ("sizes", "running")} == \
            {k: v for k, v in b.items() if k not in ("sizes", "running")}
    assert cut["finish"] == "stop" and " is 1000" not in cut["text"] and max(cut["sizes"]) > 1


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
            if len(got) >= args["n"]:
                break
        await gen.aclose()
        await gen.aclose()  # idempotent
        # the context goes on from the tokens the caller saw
        ctx.fill(" and then")
        after = await ctx.generate(max_tokens=6, eos=False).collect_tokens()
        return {"got": got, "finish": gen.finish_reason, "context": ctx.tokens, "kv_len": ctx.kv_len, "after": after}
"""


async def left_early_like_stepping(runtime, over_runtime, tmp_path) -> dict:
    """LEAVE_EARLY with overlap on ``over_runtime`` (leaving once it saw 5
    tokens: 5 or more, a stream's step may carry several), then stepped on
    ``runtime`` to the same count: both must leave the same context."""
    prog = inline_program(tmp_path, LEAVE_EARLY)
    over = await run(over_runtime, prog, {"overlap": True, "n": 5})
    assert over.status is Status.FINISHED, f"{over.error}\n{over.traceback}"
    plain = await run_ok(runtime, prog, {"overlap": False, "n": len(over.result["got"])})
    assert over.result == plain
    assert plain["finish"] == "stop" and len(plain["got"]) >= 5
    return plain


async def test_aclose_after_leaving_early(runtime, tmp_path):
    await left_early_like_stepping(runtime, runtime, tmp_path)


async def test_a_stream_left_while_the_model_runs_ahead(runtime, tmp_path):
    """The caller leaves while passes it will not take have run (a pause
    lets the stream go on): they are dropped, the context is truncated to
    the tokens taken, the last one pending, and the next generation goes on
    from there as after stepping."""
    prog = inline_program(tmp_path, """
import asyncio
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Once upon a time")
        gen = ctx.generate(max_tokens=40, eos=False, overlap=args["overlap"])
        first = await gen.__anext__()
        await asyncio.sleep(args["pause"])  # passes go on meanwhile (stream)
        await gen.aclose()
        kv = ctx.kv_len
        after = await ctx.generate(max_tokens=5, eos=False).collect_tokens()
        return {"first": first.tokens, "kv_len": kv, "pending": len(ctx.pending), "after": after, "context": ctx.tokens}
""")
    plain = await run_ok(runtime, prog, {"overlap": False, "pause": 0})
    left = await run_ok(runtime, prog, {"overlap": True, "pause": 0.1})
    assert left == plain
    assert len(left["first"]) == 1


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

    await left_early_like_stepping(runtime, WasmRuntime(host_state), tmp_path)


async def test_a_stream_stopped_by_the_page_limit(host_state, tmp_path):
    """A pass of the stream fails (the instance's page limit): the tokens
    sampled before it are taken, then the error is raised, the context is
    left as stepping leaves it, and no page leaks."""
    from harness import assert_no_leaks
    from tartlet.runtime.native import NativeRuntime

    prog = inline_program(tmp_path, """
from tartlet import Model

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Once upon a time")
        gen = ctx.generate(max_tokens=100, eos=False, overlap=args["overlap"])
        got, err = [], None
        try:
            async for step in gen:
                got += step.tokens
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
        return {"got": got, "err": err, "kv_len": ctx.kv_len, "pending": ctx.pending, "finish": gen.finish_reason,
                "tokens": ctx.tokens}
""")
    runtime = NativeRuntime(host_state, max_pages=2)
    plain = await run_ok(runtime, prog, {"overlap": False})
    streamed = await run_ok(runtime, prog, {"overlap": True})
    errors = [r.pop("err") for r in (plain, streamed)]
    assert all(e.startswith("KvQuotaError: KV page quota exceeded") for e in errors), errors
    assert streamed == plain
    assert plain["finish"] == "error"
    assert plain["kv_len"] == 2 * 16 and len(plain["pending"]) == 1
    assert_no_leaks(host_state)


async def test_an_inferlet_that_ends_mid_stream_leaks_nothing(runtime, host_state, tmp_path):
    """Returning (or failing) with a stream still running: the instance's
    close stops the stream after its pass in flight and frees the context."""
    from harness import assert_no_leaks

    prog = inline_program(tmp_path, """
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill("Once upon a time")
    gen = ctx.generate(max_tokens=200, eos=False, overlap=True)
    step = await gen.__anext__()
    if args["fail"]:
        raise RuntimeError("boom")
    return step.tokens
""")
    assert len(await run_ok(runtime, prog, {"fail": False})) == 1
    inst = await run(runtime, prog, {"fail": True})
    assert inst.status is Status.FAILED and "boom" in inst.error
    assert_no_leaks(host_state)


async def test_a_sampler_subclass_is_stepped_not_streamed(runtime, tmp_path):
    """A Sampler subclass may override ``pick`` (or ``slot``): the engine
    cannot draw for it, so overlap queues one pass ahead and every token
    goes through its ``pick``."""
    prog = inline_program(tmp_path, """
from tartlet import Model, Sampler

class Counting(Sampler):
    picks = 0
    def pick(self, result):
        Counting.picks += 1
        return super().pick(result)

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Once upon a time")
        gen = ctx.generate(Counting(), max_tokens=6, eos=False, overlap=True)
        async for step in gen:
            assert gen._stream is None
        return {"picks": Counting.picks, "tokens": gen.tokens}
""")
    res = await run_ok(runtime, prog)
    assert res["picks"] == len(res["tokens"]) == 6


async def test_a_failing_stop_condition_closes_the_stream(runtime, host_state, tmp_path):
    """A stop condition that raises mid-stream: the error reaches the
    caller, the stream is closed (no pass of it goes on: the context takes
    a new generation at once) and no page leaks."""
    from harness import assert_no_leaks

    prog = inline_program(tmp_path, """
import asyncio
from tartlet import Model, StopCondition

class Boom(StopCondition):
    def should_stop(self, tokens, text):
        if len(tokens) == 3:
            raise RuntimeError("stop check failed")
        return False

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("Once upon a time")
        prompt = len(ctx.tokens)
        gen = ctx.generate(max_tokens=100, eos=False, stop=Boom(), overlap=True)
        try:
            async for _ in gen:
                pass
        except RuntimeError as e:
            err = str(e)
        await asyncio.sleep(0.1)  # an open stream's passes would go on meanwhile
        kv = ctx.kv_len
        more = await ctx.generate(max_tokens=3, eos=False).collect_tokens()
        return {"err": err, "tokens": gen.tokens, "kv_len": kv, "prompt": prompt, "more": len(more), "finish": gen.finish_reason}
""")
    res = await run_ok(runtime, prog)
    assert res["err"] == "stop check failed" and res["finish"] == "error"
    assert len(res["tokens"]) == 3 and res["more"] == 3
    # the passes past the third token were dropped: the KV cache holds the prompt and two tokens, the third pending
    assert res["kv_len"] == res["prompt"] + 2
    assert_no_leaks(host_state)
