"""Batching and page sharing on the real model.

Concurrent inferlets must produce exactly what each produces alone while the
scheduler packs their passes into shared model calls; forks and identical
prefixes must share physical KV pages.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest

from harness import inline_program, run, run_ok
from tartlet.runtime.instance import Status

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a neural network is.",
    "List three fruits and their colours.",
    "Describe a sunset in the mountains.",
    "What is the best way to learn to cook?",
    "Tell me a fun fact about octopuses.",
    "Why is the sky blue?",
    "Give me advice for a job interview.",
]
MAX_TOKENS = 24


async def run_all(runtime, args_list: list[dict]) -> list:
    insts = await asyncio.gather(*(run(runtime, "text-completion", a) for a in args_list))
    for inst in insts:
        assert inst.status is Status.FINISHED, f"{inst.status.value}: {inst.error}"
    return [inst.result for inst in insts]


async def solo_then_together(runtime, engine) -> tuple[list[dict], list[dict]]:
    """``text-completion`` of each of :data:`PROMPTS` alone, then all at
    once (asserted batched: fewer model calls than tokens); both results."""
    args = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
    solo = [await run_ok(runtime, "text-completion", a) for a in args]
    calls0 = engine.scheduler.stats.model_calls
    together = await run_all(runtime, args)
    total = sum(len(r["tokens"]) for r in together)
    assert engine.scheduler.stats.model_calls - calls0 < total, "not batched"
    return solo, together


async def test_concurrent_inferlets_match_solo_runs_and_are_batched(runtime, engine):
    args = [{"prompt": p, "max_tokens": MAX_TOKENS} for p in PROMPTS]
    solo = [await run_ok(runtime, "text-completion", a) for a in args]
    st = engine.scheduler.stats
    calls0, sizes0 = st.model_calls, st.batch_sizes.copy()
    together = await run_all(runtime, args)
    calls = st.model_calls - calls0
    sizes = st.batch_sizes - sizes0
    total = sum(len(r["tokens"]) for r in together)
    for p, a, b in zip(PROMPTS, solo, together):
        assert b["tokens"] == a["tokens"], f"{p!r}: concurrent run differs from the solo run"
        assert b["text"] == a["text"]
    assert total >= 4 * MAX_TOKENS
    print(f"8 concurrent inferlets: {total} tokens in {calls} model calls, batch sizes {dict(sorted(sizes.items()))}")
    assert calls < total, f"{calls} model calls for {total} generated tokens: not batched"
    assert max(sizes) >= 4, f"no batch held 4 or more requests: {dict(sizes)}"


FORK = """
import asyncio
from tartlet import Model

async def main(args):
    model = Model.load()
    ps = model.page_size
    used0 = model.kv_stats()["used"]
    prefix = model.new_context()
    prefix.system(args["system"])
    await prefix.flush()
    prefix_len = prefix.kv_len
    a, b = prefix.fork(), prefix.fork()
    sa, sb, sp = await a.stats(), await b.stats(), await prefix.stats()
    used_forked = model.kv_stats()["used"] - used0
    a.user(args["questions"][0])
    b.user(args["questions"][1])
    a.begin_assistant()
    b.begin_assistant()
    # the two forks decode concurrently (their passes share batches)
    gen_a, gen_b = await asyncio.gather(
        a.generate(max_tokens=args["max_tokens"]).collect_tokens(),
        b.generate(max_tokens=args["max_tokens"]).collect_tokens(),
    )
    fresh = []
    for q in args["questions"]:
        with model.new_context() as c:
            c.system(args["system"])
            c.user(q)
            c.begin_assistant()  # the prompt recorded is what the model continues
            fresh.append({"prompt": c.tokens, "tokens": await c.generate(max_tokens=args["max_tokens"]).collect_tokens()})
    return {
        "ps": ps, "prefix_len": prefix_len, "stats": [sp, sa, sb], "used_forked": used_forked,
        "prompts": [a.tokens[: len(fresh[0]["prompt"])], b.tokens[: len(fresh[1]["prompt"])]],
        "forked": [gen_a, gen_b], "fresh": fresh,
    }
"""


async def fork_and_fresh(runtime, tmp_path) -> dict:
    """Run :data:`FORK` on a new session prompt and check its page
    accounting (shared full pages, one copied tail page per fork) and that
    each fork holds the fresh context's prompt; the result, whose tokens the
    callers compare (``forked[k]`` vs ``fresh[k]["tokens"]``)."""
    system = f"Session {uuid.uuid4().hex[:8]}. You are a concise assistant. Answer plainly and briefly."
    res = await run_ok(runtime, inline_program(tmp_path, FORK, "fork"), {
        "system": system,
        "questions": ["What is the capital of Italy?", "Name a primary colour."],
        "max_tokens": 16,
    })
    ps, n = res["ps"], res["prefix_len"]
    full, tail = divmod(n, ps)
    assert full >= 1 and tail > 0, f"the prefix ({n} tokens) should end mid-page for this test"
    sp, sa, sb = res["stats"]
    for s in (sp, sa, sb):
        assert s["tokens"] == n and s["pages"] == full + 1
    # the full pages are shared by the prefix and both forks; each fork copied only the tail page
    assert sa["shared_pages"] == sb["shared_pages"] == sp["shared_pages"] == full
    assert res["used_forked"] == full + 3, res["used_forked"]
    for k in range(2):
        assert res["prompts"][k] == res["fresh"][k]["prompt"], "fork and fresh context hold different prompts"
        assert len(res["forked"][k]) > 0
    return res


async def test_fork_of_flushed_prefix_shares_pages_and_decodes_like_fresh(runtime, tmp_path):
    res = await fork_and_fresh(runtime, tmp_path)
    for k in range(2):
        assert res["forked"][k] == res["fresh"][k]["tokens"], f"fork {k} decodes differently from a fresh context"


async def test_fork_pages_in_pool_stats(runtime, engine, tmp_path):
    """The same sharing seen from the engine's pool while the inferlet holds its contexts."""
    code = """
    from tartlet import Model
    from tartlet.sdk import session

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill_tokens(list(range(100, 100 + args["n"])))
        await ctx.flush()
        forks = [ctx.fork() for _ in range(3)]
        for f in forks:
            await f.stats()
        session.send("forked")
        await session.receive()   # the test inspects the pool now
    """
    prog = inline_program(tmp_path, code, "pool_fork")
    from tartlet.host.session import Session

    n = 3 * engine.pool.page_size + 5
    session = Session()
    got = asyncio.Event()
    session.listen(lambda m: got.set())
    used0 = engine.pool.stats().used
    inst = runtime.launch(prog, {"n": n}, session)
    await asyncio.wait_for(got.wait(), 60)
    try:
        used = engine.pool.stats().used - used0
        assert used == 4 + 3, f"3 forks of a 4-page context should add only 3 tail pages, {used} pages in use"
        shared = sum(1 for p in range(engine.pool.num_pages) if engine.pool.refcount(p) == 4)
        assert shared == 3, f"{shared} pages have 4 references (expected the 3 full pages)"
    finally:
        session.push("done")
        await inst.wait()
    assert inst.status is Status.FINISHED, inst.error


SAME_SYSTEM = """
from tartlet import Model

async def main(args):
    model = Model.load()
    out = []
    ctxs = []
    for q in args["questions"]:
        c = model.new_context()
        c.system(args["system"])
        await c.flush()
        out.append({"len": c.kv_len, "used": model.kv_stats()["used"], "stats": await c.stats()})
        c.user(q)
        ctxs.append(c)
    texts = [await c.generate(max_tokens=8).collect_text() for c in ctxs]
    return {"ctx": out, "texts": texts}
"""


async def test_same_system_prompt_shares_committed_pages_without_asking(runtime, engine, tmp_path):
    system = f"Conversation {uuid.uuid4().hex}. You are a friendly assistant that answers in one short sentence."
    ps = engine.pool.page_size
    reused0 = engine.scheduler.stats.prefix_tokens_reused
    used0 = engine.pool.stats().used
    res = await run_ok(runtime, inline_program(tmp_path, SAME_SYSTEM, "same_system"), {
        "system": system, "questions": ["Hello!", "How are you?"]})
    first, second = res["ctx"]
    n = first["len"]
    assert second["len"] == n and n > 2 * ps
    full = n // ps
    reused = engine.scheduler.stats.prefix_tokens_reused - reused0
    assert reused == full * ps, f"second prefill reused {reused} tokens, expected its {full} full pages"
    pages = -(-n // ps)
    assert first["used"] - used0 == pages
    assert second["used"] - used0 == pages + (pages - full), "the second context did not share the first one's pages"
    assert second["stats"]["shared_pages"] == full and first["stats"]["shared_pages"] == 0
    assert all(t for t in res["texts"])


@pytest.mark.slow  # sampled generations solo, then together
async def test_seeded_sampling_is_reproducible_alone_and_concurrently(runtime):
    seeded = {"prompt": "Invent a name for a new planet and describe it.", "max_tokens": 24,
              "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = await run_ok(runtime, "text-completion", seeded)
    b = await run_ok(runtime, "text-completion", seeded)
    assert a["tokens"] == b["tokens"]
    others = [{"prompt": p, "max_tokens": 24, "temperature": 1.0, "seed": i} for i, p in enumerate(PROMPTS[:3])]
    together = await run_all(runtime, [seeded, *others, seeded])
    assert together[0]["tokens"] == a["tokens"] and together[-1]["tokens"] == a["tokens"]
    other_seed = await run_ok(runtime, "text-completion", {**seeded, "seed": 99})
    assert other_seed["tokens"] != a["tokens"]


def test_users_share_a_round_fairly(engine):
    """A long prefill of one user does not hold back another user's short
    request: with two users queued, each gets half of ``max_batch_tokens``
    per round, so the short one finishes in the first model call while the
    prefill is chunked over several, and both results equal solo runs."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec
    from tartlet.engine.core.sequence import Sequence

    sched = engine.scheduler
    tok = engine.tokenizer
    long_ids = (tok.encode("The history of the river valley is long and varied. ") * 60)[:1500]
    short_ids = tok.encode("The capital of France is")

    def request(ids: list[int], user: str) -> tuple[ForwardRequest, Sequence]:
        seq = Sequence(engine.pool)
        slot = OutputSlot(len(ids) - 1, SamplerSpec(temperature=0.0))
        return ForwardRequest(seq, list(ids), outputs=[slot], user=user), seq

    solo = []
    for ids in (long_ids, short_ids):
        req, seq = request(ids, "solo")
        solo.append(sched.submit(req).result(timeout=120))
        sched.command(seq.free, seq).result(timeout=60)
    engine.pool.evict_all_cached()

    done_at: dict[str, int] = {}
    calls0 = sched.stats.model_calls
    reqs = [request(long_ids, "alice"), request(short_ids, "bob")]
    with sched._cond:  # queue both before the scheduler looks
        futs = [sched.submit(r) for r, _ in reqs]
    for name, f in zip(("long", "short"), futs):
        f.add_done_callback(lambda _f, name=name: done_at.setdefault(name, sched.stats.model_calls - calls0))
    results = [f.result(timeout=120) for f in futs]
    for _, seq in reqs:
        sched.command(seq.free, seq).result(timeout=60)
    assert results == solo
    assert done_at["short"] == 1
    # the first round gave the prefill half the budget; alone, it gets all of it
    half = sched.max_batch_tokens // 2
    assert done_at["long"] == 1 + -(-(len(long_ids) - half) // sched.max_batch_tokens)


def test_prompts_of_one_length_share_an_attention_group(engine):
    """Whole prompts of equal length in one batch form one attention group
    (B requests x Q queries), in row order or interleaved with others."""
    from tartlet.engine.core.batch import BatchItem, build_batch

    seqs = [engine.new_sequence() for _ in range(4)]
    items = []
    for s, n in zip(seqs, (5, 3, 5, 1)):
        toks = list(range(10, 10 + n))
        items.append(BatchItem(s, toks, 0, s.reserve(toks, list(range(n)), custom_attention=False), [n - 1], None))
    try:
        b = build_batch(items)
        by_q = {g.num_queries: g for g in b.groups}
        assert sorted(by_q) == [1, 3, 5]
        five = by_q[5]
        assert five.kv_slots.shape == (2, 5) and five.mask is None
        assert five.rows.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]  # rows 5-7: the 3-token prompt
        assert five.kv_slots.tolist() == [items[0].slot_mapping, items[2].slot_mapping]
        assert build_batch([items[0], items[2]]).groups[0].rows is None  # adjacent: a row range
    finally:
        for s in seqs:
            s.free()


def test_continuation_rearms_one_request(engine):
    """A request whose continuation (``ForwardRequest.then``) feeds each
    sampled token back runs the passes a chain of separate requests runs:
    the same greedy tokens and sequence length, one future resolved with
    the last pass's results. An exception raised by the continuation fails
    the future; the pass before it stays."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    sched = engine.scheduler
    prompt = engine.tokenizer.encode("The capital of France is")
    greedy = [OutputSlot(0, SamplerSpec(temperature=0.0))]
    first = [OutputSlot(len(prompt) - 1, SamplerSpec(temperature=0.0))]
    chained, seq = [], engine.new_sequence()
    chained.append(int(sched.submit(ForwardRequest(seq, prompt, outputs=first)).result(60)[0]))
    for _ in range(7):
        chained.append(int(sched.submit(ForwardRequest(seq, [chained[-1]], outputs=greedy)).result(60)[0]))
    n = len(seq)
    sched.command(seq.free, seq).result(60)

    got, seq = [], engine.new_sequence()

    def then(results):
        got.append(int(results[0]))
        return ([got[-1]], greedy) if len(got) < 8 else None

    last = sched.submit(ForwardRequest(seq, prompt, outputs=first, then=then)).result(60)
    assert got == chained and int(last[0]) == chained[-1] and len(seq) == n

    def boom(results):
        raise RuntimeError("the continuation failed")

    with pytest.raises(RuntimeError, match="the continuation failed"):
        sched.submit(ForwardRequest(seq, [got[-1]], outputs=greedy, then=boom)).result(60)
    assert len(seq) == n + 1
    sched.command(seq.free, seq).result(60)
