"""Host grammars in host-side decoding: a generation constrained by a
built-in (host) grammar runs as a token stream with ``overlap=True``, in
host chunks with ``chunk=N`` and in one host call with ``collect_*``, like
a free one (``HostApi.generate`` masks each pass with its own copy of the
matcher and advances it). Same tokens, text, finish reason and context as
stepping token by token, the passes stepping runs, and the inferlet's
constraint left at the tokens it kept (a stop string that ends the
generation while the stream runs ahead included)."""

from __future__ import annotations

import json

import pytest

from harness import assert_no_leaks, inline_program, run, run_ok
from tartlet.host.api import HostApi
from tartlet.runtime.instance import Status
from tartlet.sdk.errors import GrammarError, InvalidHandleError
from tartlet.sdk.forward import OutputSlot

#: Each case generated in four modes; the context then goes on with another
#: turn. Returns, per case and mode, what the generation gave, the state of
#: its constraint afterwards and whether a stream or a queued pass was
#: running when each step came back.
MODES = """
from tartlet import JsonSchema, Model, Regex, Sampler

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name", "age"],
          "additionalProperties": False}
NUMBERS = "(one|two|three|four|five|six|seven|eight|nine|ten)(, (one|two|three|four|five|six|seven|eight|nine|ten))*"
CASES = [
    dict(c=("json", PERSON), prompt="Describe Ada Lovelace as JSON.", kw=dict(max_tokens=40, eos=True)),
    dict(c=("regex", NUMBERS), prompt="Count from one to ten.", kw=dict(max_tokens=30, eos=True, stop=[", five"])),
    dict(c=("regex", NUMBERS), prompt="Count from one to ten.", kw=dict(max_tokens=7, eos=False)),
    dict(c=("json", PERSON), prompt="Describe Alan Turing as JSON.",
         kw=dict(max_tokens=40, eos=True), sampler=dict(temperature=0.9, top_k=40, seed=5)),
]
MODES = ["step", "overlap", "chunk", "collect"]

async def one(model, case, mode):
    kind, spec = case["c"]
    c = JsonSchema(spec) if kind == "json" else Regex(spec)
    s = case.get("sampler")
    kw = dict(case["kw"])
    if mode == "overlap":
        kw["overlap"] = True
    elif mode == "chunk":
        kw["chunk"] = 4
    running = []
    with model.new_context() as ctx:
        ctx.user(case["prompt"])
        gen = ctx.generate(Sampler(**s) if s else Sampler.greedy(), constraint=c, **kw)
        steps = []
        if mode == "collect":
            await gen.collect_tokens()
        else:
            async for step in gen:
                steps.append(step.tokens)
                running.append(gen._ahead is not None or gen._stream is not None)
        ctx.user("Thanks.")
        more = await ctx.generate(max_tokens=3, eos=False).collect_tokens()
        out = {"tokens": gen.tokens, "text": gen.text, "finish": gen.finish_reason, "context": ctx.tokens,
               "kv_len": ctx.kv_len, "more": more, "accepting": c.is_accepting(), "finished": c.is_finished(),
               "mask": c.mask()}
        c.close()
        return out, steps, running

async def main(args):
    model = Model.load()
    return [{m: await one(model, case, m) for m in MODES} for case in CASES]
"""


def check_modes(result: list) -> None:
    for i, case in enumerate(result):
        step, step_steps, step_running = case["step"]
        assert all(len(t) == 1 for t in step_steps) and not any(step_running)
        for mode in ("overlap", "chunk", "collect"):
            out, steps, running = case[mode]
            assert out == step, mode
            assert [t for toks in steps for t in toks] == (step["tokens"] if mode != "collect" else [])
        # the stream ran beside every step but the last (the generation ended there)
        over_running = case["overlap"][2]
        assert over_running[:-1] == [True] * (len(over_running) - 1) and over_running[-1] is False
        if i != 1:  # chunks of several tokens (a stop string needs a check per token: it steps)
            assert max(len(t) for t in case["chunk"][1]) > 1
    finishes = [case["step"][0]["finish"] for case in result]
    assert finishes[:3] == ["constraint", "stop", "length"], finishes
    person = result[0]["step"][0]
    assert person["accepting"] and person["finished"] and person["text"].startswith("{\"name\":")
    stopped = result[1]["step"][0]
    # cut at the stop string: the constraint is where the kept tokens left it (mid-list)
    assert stopped["text"].startswith("one, two") and not stopped["finished"]


@pytest.mark.slow  # 16 constrained generations
async def test_a_constrained_generation_streams_like_stepping(runtime, tmp_path):
    inst = await run(runtime, inline_program(tmp_path, MODES))
    assert inst.status is Status.FINISHED, inst.error
    check_modes(inst.result)
    assert_no_leaks(runtime.state)


async def test_a_constrained_stream_runs_the_passes_stepping_runs(runtime, engine, tmp_path):
    """The stream queues no extra pass: the grammar completes on the host,
    which stops at that token as stepping does."""
    prog = inline_program(tmp_path, """
from tartlet import Model, Regex, Sampler

async def main(args):
    model = Model.load()
    with model.new_context() as ctx, Regex("(yes|no), because [a-z ]{5,20}[.]") as c:
        ctx.user("Is Paris in France? Answer yes or no and say why.")
        gen = ctx.generate(Sampler.greedy(), max_tokens=40, eos=True, constraint=c, overlap=args["overlap"])
        async for _ in gen:
            pass
        return gen.tokens, gen.text, gen.finish_reason
""")
    st = engine.scheduler.stats
    counts, outs = [], []
    for overlap in (False, True):
        before = (st.batched_requests, st.decode_steps)  # (tokens computed: the second run's prompt is cached)
        outs.append(await run_ok(runtime, prog, {"overlap": overlap}))
        counts.append([b - a for a, b in zip(before, (st.batched_requests, st.decode_steps))])
    assert outs[0] == outs[1] and outs[0][2] == "constraint" and outs[0][1].startswith("yes, because ")
    assert counts[0] == counts[1]
    assert counts[1][1] == len(outs[1][0]) - 1, counts  # one pass per token after the first, none past the last


def test_host_generate_with_a_grammar(host_state):
    """``HostApi.generate`` with a grammar: every token allowed, the chain
    stops at the token that completes the grammar, and the handle's matcher
    is left in its state; bad handles are refused before anything runs."""
    engine = host_state.model(None).engine
    tok = engine.tokenizer
    api = HostApi(host_state)
    try:
        ctx = api.context_new(None)
        prompt = tok.encode("Is the sky blue? Answer: ")
        g = api.grammar_new(None, "regex", "(yes|no)[.]")
        start = api.grammar_mask(g)
        toks = api.generate(ctx, prompt, OutputSlot(0, "sample"), g, 0, 20, []).result(timeout=120)
        assert tok.decode(toks) in ("yes.", "no.")
        assert len(toks) < 20  # stopped by the grammar, not max_steps
        assert api.grammar_mask(g) == start and not api.grammar_is_finished(g)  # not advanced
        for t in toks:  # the tokens are the grammar's
            api.grammar_advance(g, t)
        assert api.grammar_is_finished(g)
        kv = api.context_len(ctx)
        assert kv == len(prompt) + len(toks) - 1  # the last token is the caller's pending one
        with pytest.raises(InvalidHandleError, match="no grammar matcher"):
            api.generate(ctx, [toks[-1]], OutputSlot(0, "sample"), g + 1000, 0, 4, [])
        api.grammar_free(g)
        with pytest.raises(InvalidHandleError):
            api.generate_stream(ctx, [toks[-1]], OutputSlot(0, "sample"), g, 0, 4, [])
        assert api.context_len(ctx) == kv  # nothing ran
    finally:
        api.close()
    assert_no_leaks(host_state)


def test_a_grammar_of_another_model_is_refused(host_state):
    """A grammar compiled for another engine is refused by name, before any
    pass is queued."""
    api = HostApi(host_state)
    try:
        ctx = api.context_new(None)
        g = api.grammar_new(None, "regex", "(yes|no)")
        api._matchers[g].engine = object()  # as if compiled for another served model
        with pytest.raises(GrammarError, match="another model"):
            api.generate(ctx, [1, 2], OutputSlot(0, "sample"), g, 0, 4, [])
        with pytest.raises(ValueError, match="pass the matcher handle as `grammar`"):
            api.generate(ctx, [1, 2], OutputSlot(0, "sample", grammar=g), None, 0, 4, [])
        assert api.context_len(ctx) == 0
    finally:
        api.close()


@pytest.mark.slow
@pytest.mark.wasm
async def test_component_constrained_streams_match_native(runtime, host_state, tmp_path):
    """The same cases in a sandboxed component (the grammar handle crosses
    the WIT ``generate`` / ``generate-stream`` calls) give what they give
    natively."""
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from tartlet.runtime.wasm import WasmRuntime

    prog = inline_program(tmp_path, MODES)
    native = await run_ok(runtime, prog)
    component = await run_ok(WasmRuntime(host_state), prog)
    assert component == json.loads(json.dumps(native))  # (a component's result crosses as JSON: tuples are lists)
    check_modes(component)
