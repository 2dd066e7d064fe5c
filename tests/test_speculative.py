"""Speculative decoding (drafters) and Jacobi decoding on the real model.

Drafts are verified in one forward pass and rejected tokens rolled back with
``truncate``: the output must be token for token what plain decoding with the
same sampler produces, while taking fewer passes when drafts are good.
"""

from __future__ import annotations

import pytest

from harness import inline_program, run_ok
from tartlet.sdk.drafter import NgramDrafter

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
