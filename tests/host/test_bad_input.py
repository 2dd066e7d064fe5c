"""Bad input (issue 2): each gets a clear error naming the problem, the engine
keeps serving other inferlets, and the failed inferlet's pages are freed
(the ``runtime`` fixture checks for leaks after every test)."""

from __future__ import annotations

import asyncio

import pytest

from harness import assert_no_leaks, inline_program, run, run_ok
from tartlet.engine.core.engine import Engine, EngineConfig
from tartlet.engine.loading.loader import ModelLoadError
from tartlet.engine.loading.model_store import DEFAULT_MODEL
from tartlet.host.api import HostApi
from tartlet.runtime.instance import Status
from tartlet.sdk.errors import InvalidHandleError
from tartlet.sdk.forward import OutputSlot


async def still_serving(runtime) -> None:
    """A normal inferlet still runs to the right answer."""
    res = await run_ok(runtime, "text-completion", {"prompt": "What is the capital of France?", "max_tokens": 8})
    assert res["text"].startswith("The capital of France")


async def run_failing(runtime, tmp_path, code: str, args: dict | None = None, **kw):
    inst = await run(runtime, inline_program(tmp_path, code, "bad"), args or {}, **kw)
    assert inst.status is Status.FAILED, f"expected a failure, got {inst.status.value}: {inst.result!r}"
    return inst


# -- model files -----------------------------------------------------------------


def test_unknown_model_name():
    with pytest.raises(ModelLoadError, match="unknown model 'nope'") as e:
        Engine.load(EngineConfig(model="nope"))
    assert DEFAULT_MODEL in str(e.value)  # the known names are listed


def test_missing_model_file(tmp_path):
    path = tmp_path / "missing.gguf"
    with pytest.raises(ModelLoadError) as e:
        Engine.load(EngineConfig(model=str(path)))
    assert str(path) in str(e.value) and "not a local .gguf file" in str(e.value)


def test_truncated_model_file(gguf_path, tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated") as e:
        Engine.load(EngineConfig(model=str(path)))
    assert str(path) in str(e.value)


def test_non_gguf_model_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip, not a model")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        Engine.load(EngineConfig(model=str(path)))
    assert str(path) in str(e.value)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match="neither a .gguf file nor a folder"):
        Engine.load(EngineConfig(model=str(other)))


# -- KV capacity and context length ----------------------------------------------------

LONG_PROMPT = """
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill_tokens([100 + i % 1000 for i in range(args["n"])])
    await ctx.flush()
"""


async def test_prompt_longer_than_the_page_pool(runtime, engine, tmp_path):
    pool = engine.pool
    n = (pool.num_pages + 74) * pool.page_size  # more than the whole pool, less than max_seq_len
    assert n < engine.scheduler.max_seq_len
    computed0 = engine.scheduler.stats.tokens_computed
    other = asyncio.ensure_future(still_serving(runtime))
    inst = await run_failing(runtime, tmp_path, LONG_PROMPT, {"n": n})
    assert inst.error.startswith("KvCacheFullError: ")
    assert (f"the context would hold {n} tokens in {pool.num_pages + 74} page(s) of {pool.page_size} tokens, "
            f"but the whole pool has {pool.num_pages} pages") in inst.error
    await other
    # it failed before any compute: only the other inferlet's ~50 tokens ran
    computed = engine.scheduler.stats.tokens_computed - computed0
    assert computed < 200, f"{computed} tokens computed: the prompt was prefilled before failing"
    assert_no_leaks(runtime.state)
    await still_serving(runtime)
    print(f"{n}-token prompt: {inst.error}")


async def test_prompt_longer_than_the_free_pages(runtime, engine, tmp_path):
    """Pages held elsewhere leave room for 40 pages: a 60-page prompt fails
    part-way through its chunked prefill (512 tokens = 32 pages per chunk),
    is rolled back, and frees its pages."""
    pool = engine.pool
    assert_no_leaks(runtime.state)
    held = pool.allocate(pool.available() - 40)  # as if other contexts held them
    computed0 = engine.scheduler.stats.tokens_computed
    engine.scheduler.kv_wait_s = 0.5  # nothing will free pages: wait briefly
    try:
        inst = await run_failing(runtime, tmp_path, LONG_PROMPT, {"n": 60 * pool.page_size})
        assert inst.error.startswith("KvCacheFullError: KV cache is full: need "), inst.error
        assert f"of {pool.num_pages}" in inst.error and "(waited 0.5 s for pages to be freed)" in inst.error
        assert engine.scheduler.stats.tokens_computed - computed0 == engine.scheduler.max_batch_tokens
        engine.scheduler.command(lambda: None).result(timeout=60)
        assert pool.stats().used == len(held), "the failed prefill kept pages"
        assert pool.available() == 40
    finally:
        engine.scheduler.kv_wait_s = 10.0
        for p in held:
            pool.release(p)
    await still_serving(runtime)


@pytest.mark.slow  # generations that fill the pool
async def test_a_request_waits_for_pages_others_free(runtime, engine):
    """With the pool full, a generation waits (it does not fail) and
    resumes once pages are freed; its output is the one of a quiet pool."""
    args = {"prompt": "Name three colours of the rainbow.", "max_tokens": 40}
    ref = await run_ok(runtime, "text-completion", args)
    pool = engine.pool
    assert_no_leaks(runtime.state)
    held = pool.allocate(pool.available() - 1)  # one page left: not enough for prompt + answer
    try:
        task = asyncio.ensure_future(run_ok(runtime, "text-completion", args))
        await asyncio.sleep(1.5)
        assert not task.done(), "the request should be waiting for pages"
    finally:
        for p in held:
            pool.release(p)
    assert (await asyncio.wait_for(task, 60)) == ref
    assert_no_leaks(runtime.state)


async def test_context_longer_than_max_seq_len(runtime, engine, tmp_path):
    limit = engine.scheduler.max_seq_len
    inst = await run_failing(runtime, tmp_path, LONG_PROMPT, {"n": limit + 1})
    assert inst.error.startswith("ValueError: ")
    assert f"{limit + 1} tokens" in inst.error and f"more than the model's {limit}" in inst.error
    await still_serving(runtime)


async def test_generation_stops_being_allowed_at_max_seq_len(runtime, engine, tmp_path):
    """A context filled to exactly max_seq_len cannot take one more token."""
    code = """
    from tartlet import Model
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill_tokens([5] * args["n"])
        try:
            await ctx.forward([7], outputs=[forward.logits(0)])
        except ValueError as e:
            return {"error": str(e), "kv_len": ctx.kv_len}
    """
    limit = engine.scheduler.max_seq_len
    res = await run_ok(runtime, inline_program(tmp_path, code, "maxlen"), {"n": limit})
    assert res["kv_len"] == 0
    assert f"{limit + 1} tokens" in res["error"] and f"more than the model's {limit}" in res["error"]


# -- samplers ------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "name"), [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                            ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k")])
async def test_sampler_parameters_out_of_range(runtime, args, name):
    inst = await run(runtime, "text-completion", {"prompt": "Hello", **args})
    assert inst.status is Status.FAILED
    assert inst.error.startswith("SamplingError: ") and name in inst.error


async def test_bad_sampler_slot_on_the_host_path(runtime, tmp_path):
    code = """
    from tartlet import Model
    from tartlet.sdk.forward import OutputSlot

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill("Hello there")
        n = ctx.seq_len
        errors = []
        for bad in ({"top_p": 0.0}, {"temperature": -2.0}, {"top_k": 0}, {"min_p": 2.0}):
            try:
                await ctx.forward(outputs=[OutputSlot(0, "sample", **bad)])
            except ValueError as e:
                errors.append(str(e))
        # the failed passes put nothing into the KV cache; the tokens are still pending
        assert ctx.kv_len == 0 and ctx.seq_len == n, (ctx.kv_len, ctx.seq_len)
        await ctx.flush()
        return errors
    """
    errors = await run_ok(runtime, inline_program(tmp_path, code, "badslot"))
    assert len(errors) == 4
    for e, name in zip(errors, ("top_p", "temperature", "top_k", "min_p")):
        assert name in e, e
    await still_serving(runtime)


# -- inferlets that fail or hang ----------------------------------------------------------------


async def test_inferlet_that_raises(runtime, engine, tmp_path):
    code = """
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill("some text to fill a page or two of the KV cache " * 4)
        await ctx.flush()
        forked = ctx.fork()
        await forked.generate(max_tokens=3).collect_tokens()
        raise RuntimeError("the inferlet gave up on purpose")
    """
    inst = await run_failing(runtime, tmp_path, code)
    assert inst.error == "RuntimeError: the inferlet gave up on purpose"
    assert "gave up on purpose" in inst.traceback
    assert_no_leaks(runtime.state)
    await still_serving(runtime)


NEVER_ENDS = {
    "sleep": """
    import asyncio
    from tartlet import Model

    async def main(args):
        ctx = Model.load().new_context()
        ctx.fill("hello " * 40)
        await ctx.flush()
        await asyncio.sleep(3600)
    """,
    "receive": """
    from tartlet import Model
    from tartlet.sdk import session

    async def main(args):
        ctx = Model.load().new_context()
        ctx.fill("hello " * 40)
        await ctx.flush()
        await session.receive()
    """,
    "generate": """
    from tartlet import Model

    async def main(args):
        ctx = Model.load().new_context()
        ctx.fill("Count forever:")
        async for _ in ctx.generate(max_tokens=None, eos=False):
            pass
    """,
}


@pytest.mark.parametrize("kind", list(NEVER_ENDS))
async def test_inferlet_that_never_finishes_hits_the_time_limit(runtime, tmp_path, kind):
    other = asyncio.ensure_future(still_serving(runtime))
    inst = await run_failing(runtime, tmp_path, NEVER_ENDS[kind], time_limit_s=1)
    assert inst.error == "time limit of 1 s exceeded"
    await other
    assert_no_leaks(runtime.state)
    await still_serving(runtime)


async def test_aborted_inferlet_frees_its_pages(runtime, tmp_path):
    prog = inline_program(tmp_path, NEVER_ENDS["generate"], "forever")
    from tartlet.host.session import Session

    inst = runtime.launch(prog, {}, Session())
    await asyncio.sleep(0.5)
    inst.abort("stopped by the test")
    await inst.wait()
    assert inst.status is Status.ABORTED and inst.error == "stopped by the test"
    assert_no_leaks(runtime.state)


async def test_an_abort_while_unwinding_lets_the_cleanup_finish(runtime, tmp_path):
    """A second abort (or the time limit) while the inferlet unwinds from the
    first must not free its contexts under it: its `with` block closes its
    context itself, nothing is left unretrieved on the loop (before: the
    second cancel cut the runtime's wait short, the contexts were freed,
    and the close raised InvalidHandleError into an orphaned task)."""
    prog = inline_program(tmp_path, """
    import asyncio
    from tartlet import Model

    async def main(args):
        model = Model.load()
        with model.new_context() as ctx:
            ctx.fill("Hello")
            await ctx.flush()
            try:
                await asyncio.sleep(3600)
            finally:
                await asyncio.shield(asyncio.sleep(0.3))  # unwinding takes a while
    """, "unwinds")
    from tartlet.host.session import Session

    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    try:
        for time_limit in (None, 1.0):
            inst = runtime.launch(prog, {}, Session(), time_limit_s=time_limit)
            await asyncio.sleep(0.6 if time_limit is None else 0.9)
            inst.abort("first")
            await asyncio.sleep(0.05 if time_limit is None else 0.2)
            inst.abort("second")
            await inst.wait()
            assert inst.status in (Status.ABORTED, Status.FAILED) and inst.error in ("first", "time limit of 1 s exceeded")
            import gc

            gc.collect()
            await asyncio.sleep(0)
            assert unretrieved == [], unretrieved
            assert_no_leaks(runtime.state)
    finally:
        loop.set_exception_handler(old)


# -- malformed calls ------------------------------------------------------------------------------


async def test_token_ids_outside_the_vocabulary(runtime, engine, tmp_path):
    code = """
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        errors = []
        for bad in ([model.vocab_size], [-1], [1, 2, "3"], [True]):
            try:
                ctx.fill_tokens(bad)
            except ValueError as e:
                errors.append(str(e))
        return {"errors": errors, "seq_len": ctx.seq_len}
    """
    res = await run_ok(runtime, inline_program(tmp_path, code, "vocab"))
    v = engine.config.vocab_size
    assert res["seq_len"] == 0
    assert res["errors"] == [f"token id {t} outside the vocabulary [0, {v})" for t in (v, -1, "'3'", True)]
    # the host checks too (a sandboxed inferlet may bypass the SDK)
    api = HostApi(runtime.state)
    h = api.context_new(None)
    for bad in ([v], [-5], [1.5]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            api.forward(h, bad)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        api.forward(h, [1], outputs=[OutputSlot(0, "logprobs", token_ids=[v + 3])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        api.detokenize(None, [v])
    with pytest.raises(ValueError, match="at most 4096 output slots, got 4097"):  # bounded before any work
        api.forward(h, [1], outputs=[OutputSlot(0, "sample")] * 4097)
    assert api.context_len(h) == 0
    api.close()
    await still_serving(runtime)


async def test_output_index_out_of_range(runtime, tmp_path):
    code = """
    from tartlet import Model
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        errors = []
        for slot in (forward.logits(5), forward.logits(-1), forward.entropy(2)):
            try:
                await ctx.forward([1, 2], outputs=[slot])
            except ValueError as e:
                errors.append(str(e))
        (ent,) = await ctx.forward([1, 2], outputs=[forward.entropy(1)])
        return {"errors": errors, "kv_len": ctx.kv_len, "entropy": ent}
    """
    res = await run_ok(runtime, inline_program(tmp_path, code, "outidx"))
    assert len(res["errors"]) == 3
    for i, e in zip((5, -1, 2), res["errors"]):
        assert e.startswith(f"output index {i} outside"), e
    assert res["kv_len"] == 2 and res["entropy"] > 0


async def test_context_used_after_close(runtime, tmp_path):
    code = """
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill("A context that will be closed.")
        await ctx.flush()
        ctx.close()
        ctx.close()  # idempotent
        caught = []
        for use in (lambda: ctx.kv_len, lambda: ctx.fork(), lambda: ctx.truncate(1), lambda: ctx.tokens):
            try:
                use()
            except ValueError as e:
                caught.append(f"{type(e).__name__}: {e}")
        try:
            await ctx.forward([1])
        except ValueError as e:
            caught.append(f"{type(e).__name__}: {e}")
        return caught
    """
    caught = await run_ok(runtime, inline_program(tmp_path, code, "closed"))
    assert len(caught) == 5, caught
    assert all("closed" in c or "no context with handle" in c for c in caught), caught
    # the host refuses a freed handle whatever the SDK does
    api = HostApi(runtime.state)
    h = api.context_new(None)
    await asyncio.wrap_future(api.forward(h, [1, 2, 3]))
    api.context_free(h)
    for call in (lambda: api.context_len(h), lambda: api.forward(h, [1]), lambda: api.context_fork(h),
                 lambda: api.context_truncate(h, 0), lambda: api.context_free(h)):
        with pytest.raises(InvalidHandleError, match=f"no context with handle {h}"):
            call()
    api.close()
    assert_no_leaks(runtime.state)
    await still_serving(runtime)


async def test_host_rejects_malformed_calls(runtime):
    """Arguments a sandboxed caller could send: each raises and queues nothing."""
    api = HostApi(runtime.state)
    h = api.context_new(None)
    cases = [
        (lambda: api.forward(h, []), "non-empty list"),
        (lambda: api.forward(h, [1, 2], positions=[0]), "positions must be 2"),
        (lambda: api.forward(h, [1, 2], positions=[0, -1]), "positions must be 2"),
        (lambda: api.forward(h, [1], attention=[[1], [1]]), "one mask per input token"),
        (lambda: api.forward(h, [1], attention=[[0, 5]]), "covers 5 positions"),
        (lambda: api.forward(h, [1], outputs=["sample"]), "output slot is a tartlet.sdk.forward.OutputSlot"),
        (lambda: api.forward(h, [1], outputs=[{"index": 0}]), "output slot is a tartlet.sdk.forward.OutputSlot, got dict"),
        (lambda: api.forward(h, [1], outputs=[OutputSlot(0, "magic")]), "unknown probe kind 'magic'"),
        (lambda: api.forward(h, [1], outputs=[OutputSlot(0, "distribution", k=0)]), "k >= 1"),
        (lambda: api.forward(h, [1], outputs=[OutputSlot(0, logit_mask=[-1])]), "logit mask"),
        (lambda: api.forward(h, [1], outputs=[OutputSlot("0")]), "output index"),
        (lambda: api.context_truncate(h, 3), "truncate to 3"),
        (lambda: api.context_mask(h, 0, 1, True), "mask range"),
        (lambda: api.forward(h + 100, [1]), "no context with handle"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()
    assert api.context_len(h) == 0
    res = await asyncio.wrap_future(api.forward(h, [1, 2, 3], outputs=[OutputSlot(2)]))
    assert len(res) == 1 and isinstance(res[0], int)
    with pytest.raises(InvalidHandleError):
        api.context_free(h + 100)
    api.close()
