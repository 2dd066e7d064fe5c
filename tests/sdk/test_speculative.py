"""Speculative decoding (drafters) and Jacobi decoding on the real model.

Drafts are verified in one forward pass and rejected tokens rolled back with
``truncate``: the output must be token for token what plain decoding with the
same sampler produces, while taking fewer passes when drafts are good.
"""

from __future__ import annotations

import asyncio

import pytest

from harness import inline_program, run_ok
from tartlet.sdk.drafter import AdaptiveDrafter, NgramDrafter

CODE_TASK = (
    "Rewrite this function with clearer variable names, keeping the logic:\n\n"
    "def f(a, b):\n    c = a + b\n    d = c * 2\n    e = d - a\n    return e\n"
)


def test_ngram_drafter_looks_up_the_latest_longest_match():
    d = NgramDrafter(max_draft=3, max_ngram=2)
    assert d.draft() == []
    d.update([1, 2, 3, 4, 9, 2, 3, 5, 6])
    assert d.draft() == []  # suffix (5, 6) / (6,) never occurred before
    d.update([2, 3])
    assert d.draft() == [5, 6, 2]  # latest occurrence of (2, 3) was followed by 5, 6, 2
    d.update([4])
    assert d.draft() == [9, 2, 3]  # (3, 4) occurred once, at the start
    d.update([7])
    assert d.draft() == []
    d2 = NgramDrafter(max_draft=2, max_ngram=3, min_ngram=2)
    d2.update([1, 2, 8, 2])
    assert d2.draft() == []  # a 1-gram match is not enough with min_ngram=2


@pytest.mark.parametrize("kw", [{"max_draft": 0}, {"max_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"max_draft": 1.5}])
def test_ngram_drafter_rejects_bad_settings(kw):
    with pytest.raises(ValueError, match="NgramDrafter"):
        NgramDrafter(**kw)


SPEC = """
from tartlet import Model, Sampler
from tartlet.sdk.drafter import NgramDrafter


class Garbage:
    def update(self, tokens):
        pass

    def draft(self):
        return [49000, 48500, 47000, 46000]


async def main(args):
    model = Model.load()
    out = {}
    for name, drafter, sampler in (
        ("plain", None, Sampler.greedy()),
        ("ngram", NgramDrafter(max_draft=6), Sampler.greedy()),
        ("garbage", Garbage(), Sampler.greedy()),
        ("plain_seeded", None, Sampler.top_p(0.9, temperature=0.7, seed=11)),
        ("ngram_seeded", NgramDrafter(max_draft=6), Sampler.top_p(0.9, temperature=0.7, seed=11)),
    ):
        ctx = model.new_context()
        ctx.user(args["prompt"])
        gen = ctx.generate(sampler, max_tokens=args["max_tokens"], drafter=drafter)
        steps = [s.tokens async for s in gen]
        st = await ctx.stats()
        out[name] = {"tokens": gen.tokens, "text": gen.text, "steps": gen.stats.steps,
                     "drafted": gen.stats.drafted, "accepted": gen.stats.accepted,
                     "step_sizes": [len(s) for s in steps], "kv": ctx.kv_len, "stats": st}
        ctx.close()
    return out
"""


@pytest.mark.slow  # every prompt decoded twice
async def test_speculative_decoding_equals_plain_decoding(runtime, tmp_path):
    res = await run_ok(runtime, inline_program(tmp_path, SPEC, "spec"), {"prompt": CODE_TASK, "max_tokens": 40})
    plain, ngram, garbage = res["plain"], res["ngram"], res["garbage"]
    assert len(plain["tokens"]) >= 30
    assert ngram["tokens"] == plain["tokens"]
    assert ngram["text"] == plain["text"]
    assert garbage["tokens"] == plain["tokens"]
    # the rewrite copies the prompt: many drafts accepted, far fewer passes
    assert ngram["accepted"] >= len(plain["tokens"]) // 3, ngram
    assert ngram["steps"] < plain["steps"] == len(plain["tokens"])
    assert ngram["steps"] + ngram["accepted"] == len(ngram["tokens"])
    assert sum(ngram["step_sizes"]) == len(ngram["tokens"]) and max(ngram["step_sizes"]) > 1
    # rejected drafts were rolled back: the KV holds the prompt and the output only
    for r in (plain, ngram, garbage):
        assert r["kv"] == plain["kv"]
        assert r["stats"]["tokens"] == r["kv"]
        assert r["stats"]["pages"] == -(-r["kv"] // 16)
    assert garbage["accepted"] == 0 and garbage["drafted"] > 0
    # a seeded sampler draws the same tokens with or without a drafter
    assert res["ngram_seeded"]["tokens"] == res["plain_seeded"]["tokens"]
    assert res["plain_seeded"]["tokens"] != plain["tokens"]


async def test_drafter_returning_invalid_ids_is_a_clear_error(runtime, tmp_path):
    code = """
    from tartlet import Model

    class Bad:
        def __init__(self, out):
            self.out = out
        def update(self, tokens):
            pass
        def draft(self):
            return self.out

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.user("Say hi.")
        errors = []
        for bad in ([5, model.vocab_size], [-1], [3, "x"], [2.0]):
            gen = ctx.generate(max_tokens=8, drafter=Bad(bad))
            try:
                await gen.collect_tokens()
            except ValueError as e:
                errors.append(str(e))
            assert gen.finish_reason == "error"
        # the context is unchanged and still generates normally
        after = await ctx.generate(max_tokens=8).collect_tokens()
        ref = model.new_context()
        ref.user("Say hi.")
        return {"errors": errors, "after": after, "ref": await ref.generate(max_tokens=8).collect_tokens()}
    """
    res = await run_ok(runtime, inline_program(tmp_path, code, "baddraft"))
    assert len(res["errors"]) == 4
    assert all(e.startswith("drafter returned token id") and "outside the vocabulary" in e for e in res["errors"])
    assert res["after"] == res["ref"]


async def test_speculative_inferlet_reports_acceptance(runtime):
    res = await run_ok(runtime, "speculative-decoding", {"prompt": CODE_TASK, "max_tokens": 40, "compare": True})
    assert res["identical"] is True
    assert res["tokens"] == res["baseline"]["tokens"]
    assert res["passes"] < res["baseline"]["passes"] == len(res["tokens"])
    assert 0 < res["acceptance_rate"] <= 1
    assert res["acceptance_rate"] == res["accepted"] / res["drafted"]
    assert res["tokens_per_pass"] == len(res["tokens"]) / res["passes"] > 1


async def test_jacobi_decoding_equals_greedy(runtime):
    prompt = "Count from 1 to 10, separated by commas."
    ref = await run_ok(runtime, "text-completion", {"prompt": prompt, "max_tokens": 24})
    res = await run_ok(runtime, "jacobi-decoding", {"prompt": prompt, "max_tokens": 24, "window": 4})
    assert res["tokens"] == ref["tokens"]
    assert res["text"] == ref["text"]
    assert res["finish_reason"] == ref["finish_reason"]
    assert res["passes"] + res["accepted_guesses"] == len(res["tokens"])
    assert res["passes"] <= len(res["tokens"])


# -- adaptive and served speculation ---------------------------------------------------------

def test_adaptive_drafter_stops_when_acceptance_is_low():
    """The acceptance rule: over the last ``window`` passes fewer than
    ``min_tokens_per_pass`` tokens per pass stops drafting for good; the
    first update (the context) is not a pass."""
    d = AdaptiveDrafter(NgramDrafter(max_draft=3), window=4, min_tokens_per_pass=1.5)
    d.update([1, 2, 3, 1, 2])
    assert d.passes == 0 and d.draft() == [3, 1, 2]
    for toks in ([3, 1, 2, 7], [5], [6]):
        d.update(toks)
    assert d.active and d.passes == 3  # fewer passes than the window: no verdict yet
    d.update([8])  # 4 + 1 + 1 + 1 = 7 tokens in 4 passes: 1.75 >= 1.5
    assert d.active and d.tokens == 7
    d.update([9])  # the last 4 passes: 4 tokens
    assert not d.active and d.stopped == "acceptance" and d.draft() == []
    d.update([1, 2])  # later updates still feed the wrapped drafter, nothing restarts
    assert not d.active and d.drafter.tokens[-2:] == [1, 2]


def test_adaptive_drafter_stops_when_the_engine_is_busy():
    loads = iter([1, 4, 5, 1])
    d = AdaptiveDrafter(NgramDrafter(max_draft=2), load=lambda: next(loads), max_batch=4)
    d.update([1, 2, 3, 1, 2])
    assert d.draft() == [3, 1]  # load 1
    assert d.draft() == [3, 1]  # load 4: not above max_batch
    assert d.draft() == [] and d.stopped == "load" and not d.active  # load 5
    assert d.draft() == []  # stays off (the load is not read again)
    assert next(loads) == 1


@pytest.mark.parametrize("kw", [{"window": 0}, {"max_batch": 0}, {"window": 2.0}, {"min_tokens_per_pass": 0.5},
                                {"min_tokens_per_pass": True}])
def test_adaptive_drafter_rejects_bad_settings(kw):
    with pytest.raises(ValueError, match=f"AdaptiveDrafter: {next(iter(kw))}"):
        AdaptiveDrafter(NgramDrafter(), **kw)


ADAPTIVE = """
from tartlet import Model, Sampler
from tartlet.drafter import AdaptiveDrafter, NgramDrafter


async def main(args):
    model = Model.load()
    out = {}
    for name, prompt, drafter in (
        ("plain_copy", args["copy"], None),
        ("spec_copy", args["copy"], AdaptiveDrafter(NgramDrafter(max_draft=6), window=8)),
        ("plain_free", args["free"], None),
        ("spec_free", args["free"], AdaptiveDrafter(NgramDrafter(max_draft=6), window=8)),
    ):
        ctx = model.new_context()
        ctx.user(prompt)
        gen = ctx.generate(Sampler.greedy(), max_tokens=args["max_tokens"], drafter=drafter, overlap=True, chunk=8)
        steps = [len(s.tokens) async for s in gen]
        st = await ctx.stats()
        out[name] = {"tokens": gen.tokens, "text": gen.text, "finish": gen.finish_reason, "steps": steps,
                     "kv": ctx.kv_len, "stats": st, "dropped": gen.drafter is None,
                     "drafter": None if drafter is None else [drafter.stopped, drafter.passes, drafter.tokens]}
        ctx.close()
    return out
"""


async def test_adaptive_drafter_with_overlap_falls_back_to_the_token_stream(runtime, tmp_path):
    """With ``overlap=True`` an :class:`AdaptiveDrafter` speculates while it
    pays; once acceptance is low it is dropped and the generation goes on as
    a token stream in chunks of 1, 2, 4, 8 tokens: the same tokens and KV
    cache as plain decoding either way."""
    free = "Write a short poem about the sea."
    res = await run_ok(runtime, inline_program(tmp_path, ADAPTIVE, "adaptive"),
                       {"copy": CODE_TASK, "free": free, "max_tokens": 48})
    for kind in ("copy", "free"):
        plain, spec = res[f"plain_{kind}"], res[f"spec_{kind}"]
        assert spec["tokens"] == plain["tokens"] and spec["text"] == plain["text"] and spec["finish"] == plain["finish"]
        assert spec["kv"] == plain["kv"] and spec["stats"]["pages"] == plain["stats"]["pages"]
    copy, free_ = res["spec_copy"], res["spec_free"]
    assert copy["drafter"][0] is None and not copy["dropped"]  # the rewrite copies the prompt: it kept drafting
    assert max(copy["steps"]) > 1 and len(copy["steps"]) < len(copy["tokens"])
    stopped, passes, tokens = free_["drafter"]
    assert stopped == "acceptance" and passes == 8 and tokens < 12 and free_["dropped"]
    assert len(free_["tokens"]) == 48 and sum(free_["steps"]) == 48
    # the stream after the stop: chunks of 1, 2, 4, then 8 tokens
    rest = free_["steps"][passes:]
    assert rest[:4] == [1, 2, 4, 8][: len(rest[:4])] and sum(rest) == 48 - tokens


SPEC_CFG = {"method": "ngram", "max_draft": 8, "max_ngram": 3, "min_ngram": 1, "max_batch": 4}


@pytest.fixture
def served_spec(host_state):
    """The shared host state's default model with ``[[models]] speculative``
    set (as the server's config sets it), for one test."""
    slot = host_state.model(None)
    slot.speculative = dict(SPEC_CFG)
    yield slot
    slot.speculative = None


SERVED = """
from tartlet import Model, Sampler
from tartlet.drafter import served_drafter


async def main(args):
    model = Model.load()
    def kind(s):
        d = served_drafter(model, s)
        return None if d is None else [type(d.drafter).__name__, d.drafter.max_draft, d.max_batch]
    return {"speculative": model.speculative, "batch_requests": model.kv_stats()["batch_requests"], "drafters": [
        kind(Sampler.greedy()), kind(Sampler.top_p(0.9, temperature=0.7, seed=3)), kind(Sampler(temperature=0.7)),
        kind(Sampler.custom(lambda ids, probs: ids[0])), kind(Sampler.mirostat_v2(5.0, seed=1)),
    ]}
"""


async def test_served_drafter_follows_the_model_config_and_the_sampler(runtime, served_spec, tmp_path):
    """``Model.speculative`` is the server's ``[[models]] speculative``;
    :func:`served_drafter` speculates for greedy and seeded engine samplers
    only."""
    prog = inline_program(tmp_path, SERVED, "served")
    res = await run_ok(runtime, prog)
    assert res["speculative"] == SPEC_CFG
    assert res["batch_requests"] >= 0
    assert res["drafters"] == [["NgramDrafter", 8, 4], ["NgramDrafter", 8, 4], None, None, None]
    served_spec.speculative = None
    res = await run_ok(runtime, prog)
    assert res["speculative"] is None and res["drafters"] == [None] * 5


PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished the lens, "
    "and wrote the weather in a small leather book. Ships passed far out on the grey water, and none of them knew his name."
)
COPY_PROMPT = "Repeat this passage word for word:\n\n" + PASSAGE


async def test_text_completion_speculates_alone_and_stops_when_the_batch_is_full(runtime, host_state, served_spec):
    """``text-completion`` on a model configured to speculate: alone, far
    fewer passes than tokens; six at once with ``max_batch`` 1, every one
    stops drafting for the load (``batch_requests`` of a call above 1).
    Tokens equal plain decoding's throughout."""
    args = {"prompt": COPY_PROMPT, "max_tokens": 60}
    served_spec.speculative = None
    plain = await run_ok(runtime, "text-completion", args)
    served_spec.speculative = dict(SPEC_CFG)
    alone = await run_ok(runtime, "text-completion", args)
    assert alone["tokens"] == plain["tokens"] and alone["text"] == plain["text"]
    assert "speculative" not in plain
    spec = alone["speculative"]
    assert spec["stopped"] is None and spec["passes"] < len(plain["tokens"]) // 3
    # every pass yields its accepted drafts plus one token; the last may be cut by EOS
    assert spec["passes"] + spec["accepted"] >= len(plain["tokens"]) > spec["passes"] + spec["accepted"] - 8
    served_spec.speculative = dict(SPEC_CFG, max_batch=1)
    many = await asyncio.gather(*(run_ok(runtime, "text-completion", args) for _ in range(6)))
    for r in many:
        assert r["tokens"] == plain["tokens"]
        assert r["speculative"]["stopped"] == "load"
