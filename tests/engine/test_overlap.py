"""Overlap scheduling (``tartlet/engine/core/lookahead.py``) on the real
model: greedy token chains run one step ahead of their continuations and
give the tokens, sequence lengths and pages of the synchronous loop.

On a CPU nothing overlaps (the host computes each step), but the scheduler
takes the same path as on a GPU: lookahead passes whose input token is
copied from the step before, dropped ones rolled back. The tests run it
with ``overlap=True`` beside the shared engine (overlap off) as the oracle.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tartlet.engine.core.requests import ForwardRequest
from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "The three primary colours are"]


@pytest.fixture(scope="module")
def overlap_engine(loaded_model):
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = loaded_model
    eng = Engine(EngineConfig(kv_cache_mb=64, overlap=True), lm.config, dict(lm.weights), lm.tokenizer)
    assert eng.scheduler.overlap
    yield eng
    eng.close()


def chain(engine, prompt: list[int], steps, feed_back: bool = True, rewrite=None):
    """Submit one greedy chain: ``steps(n, token)`` says whether the
    continuation goes on after its n-th token; ``rewrite(n, token)`` may
    change the token fed back. Returns (future, tokens seen, sequence)."""
    greedy = [OutputSlot(0, SamplerSpec(temperature=0.0))]
    first = [OutputSlot(len(prompt) - 1, SamplerSpec(temperature=0.0))]
    got: list[int] = []
    seq = engine.new_sequence()

    def then(results):
        got.append(int(results[0]))
        if not steps(len(got), got[-1]):
            return None
        fed = got[-1] if rewrite is None else rewrite(len(got), got[-1])
        return [fed], greedy

    req = ForwardRequest(seq, list(prompt), outputs=first, then=then, feed_back=greedy[0] if feed_back else None)
    return engine.scheduler.submit(req), got, seq


def free(engine, *seqs) -> None:
    for s in seqs:
        engine.scheduler.command(s.free, s).result(60)


def run_chains(engine, lengths: list[int], rewrite=None):
    """Chains of the given lengths over :data:`PROMPTS`, all at once; their
    tokens and final sequence lengths (the sequences are freed)."""
    subs = [chain(engine, engine.tokenizer.encode(p), lambda n, t, m=m: n < m, rewrite=rewrite)
            for p, m in zip(PROMPTS, lengths)]  # fmt: skip
    for f, _, _ in subs:
        f.result(120)
    out = [(list(got), len(seq)) for _, got, seq in subs]
    free(engine, *(s for _, _, s in subs))
    return out


def test_chains_match_the_synchronous_loop_and_leak_no_page(engine, overlap_engine):
    """Four concurrent greedy chains of different lengths (each stop
    drops a lookahead that already ran): the same tokens and sequence
    lengths as without overlap, lookaheads made and dropped, and every page
    back in the pool after the sequences are freed."""
    pool = overlap_engine.pool
    free0 = pool.available()
    st = overlap_engine.scheduler.stats
    made0, dropped0 = st.lookaheads, st.lookaheads_dropped
    lengths = [3, 17, 9, 30]
    assert run_chains(overlap_engine, lengths) == run_chains(engine, lengths)
    assert st.lookaheads - made0 >= sum(lengths) - len(lengths) - 4  # nearly every step ran ahead
    assert st.lookaheads_dropped - dropped0 == len(lengths)  # one per stop
    assert pool.available() == free0


def test_a_continuation_feeding_another_token_drops_its_lookahead(engine, overlap_engine):
    """A continuation that feeds back a token other than the one sampled
    (every third step here): its lookahead is dropped and rolled back, and
    the chain goes on with the fed token exactly as without overlap."""
    st = overlap_engine.scheduler.stats
    dropped0 = st.lookaheads_dropped
    rewrite = lambda n, t: 13 if n % 3 == 0 else t  # noqa: E731
    lengths = [12, 12, 7, 20]
    assert run_chains(overlap_engine, lengths, rewrite) == run_chains(engine, lengths, rewrite)
    assert st.lookaheads_dropped - dropped0 >= sum(m // 3 for m in lengths)


def test_a_failing_continuation_fails_its_future_and_keeps_the_pass_before(overlap_engine):
    prompt = overlap_engine.tokenizer.encode(PROMPTS[0])

    def steps(n, t):
        if n == 5:
            raise RuntimeError("the continuation failed")
        return True

    fut, got, seq = chain(overlap_engine, prompt, steps)
    with pytest.raises(RuntimeError, match="the continuation failed"):
        fut.result(60)
    assert len(got) == 5 and len(seq) == len(prompt) + 4  # the lookahead of the 5th token was rolled back
    free(overlap_engine, seq)


def test_pages_filled_ahead_are_registered_with_their_real_tokens(overlap_engine):
    """Tokens of lookahead passes are placeholders until their step's
    token is known; pages they fill must be registered in the prefix
    cache under the real tokens: a new sequence with the chain's prompt and
    tokens reuses them and predicts the chain's next token."""
    eng = overlap_engine
    prompt = eng.tokenizer.encode(PROMPTS[1])
    fut, got, seq = chain(eng, prompt, lambda n, t: n < 40)
    fut.result(120)
    assert len(seq) == len(prompt) + 39
    context = prompt + got[:-1]
    assert seq.tokens == context
    st = eng.scheduler.stats
    reused0 = st.prefix_tokens_reused
    again = eng.new_sequence()
    out = eng.scheduler.submit(ForwardRequest(again, context, outputs=[OutputSlot(len(context) - 1, SamplerSpec())])).result(60)
    assert st.prefix_tokens_reused - reused0 >= (len(context) // eng.pool.page_size - 1) * eng.pool.page_size
    assert int(out[0]) == got[-1]
    free(eng, seq, again)


def test_a_command_waits_for_the_step_in_flight(overlap_engine):
    """A fork of a chain's sequence while the chain runs copies only
    tokens whose pass has finished (never a lookahead's placeholder)."""
    eng = overlap_engine
    prompt = eng.tokenizer.encode(PROMPTS[2])
    fut, got, seq = chain(eng, prompt, lambda n, t: n < 60)
    forks = []
    while not fut.done():
        forks.append(eng.scheduler.command(seq.fork, seq).result(60))
    fut.result(60)
    assert forks
    for child in forks:
        n = len(child.tokens)
        assert child.tokens == seq.tokens[:n] and n >= len(prompt)
    free(eng, seq, *forks)


async def test_text_completion_inferlets_match_without_overlap(overlap_engine, runtime, tmp_path):
    """Host token streams (``generate(overlap=True)``, greedy) on the
    overlap engine: the same text as on the shared engine, concurrently."""
    from conftest import _host_state, _runtime
    from harness import run_ok

    args = [{"prompt": p, "max_tokens": 24} for p in PROMPTS]
    want = [await run_ok(runtime, "text-completion", a) for a in args]
    gen = _runtime(_host_state(overlap_engine))
    rt = next(gen)
    try:
        got = await asyncio.gather(*(run_ok(rt, "text-completion", a) for a in args))
    finally:
        next(gen, None)
    assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
    assert overlap_engine.scheduler.stats.lookaheads > 0


def test_freeing_a_chains_sequence_fails_it_cleanly(overlap_engine):
    """A free of the sequence while its chain runs ahead (an abort): the
    chain's future fails with SequenceFreedError or ends, nothing hangs, and
    every page comes back."""
    from tartlet.sdk.errors import SequenceFreedError

    eng = overlap_engine
    free0 = eng.pool.available()
    prompt = eng.tokenizer.encode(PROMPTS[3])
    subs = [chain(eng, prompt, lambda n, t: n < 200) for _ in range(3)]
    while len(subs[0][1]) < 5:
        time.sleep(0.001)
    for _, _, seq in subs:
        eng.scheduler.command(seq.free, seq).result(60)
    for fut, got, _ in subs:
        try:
            fut.result(60)
        except SequenceFreedError:
            pass
        assert len(got) < 200
    assert eng.pool.available() == free0


def test_closing_the_engine_with_chains_in_flight_fails_them(loaded_model):
    """``Engine.close`` while chains run ahead: every chain's future ends
    (the engine-stopped error or its last results), none hangs."""
    from tartlet.engine.core.engine import Engine, EngineConfig

    lm = loaded_model
    eng = Engine(EngineConfig(kv_cache_mb=16, overlap=True), lm.config, dict(lm.weights), lm.tokenizer)
    prompt = eng.tokenizer.encode(PROMPTS[0])
    subs = [chain(eng, prompt, lambda n, t: True) for _ in range(4)]
    while len(subs[0][1]) < 3:
        time.sleep(0.001)
    eng.close()
    for fut, _, _ in subs:
        with pytest.raises(RuntimeError, match="stopped"):
            fut.result(30)
