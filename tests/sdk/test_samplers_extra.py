"""Decoding algorithms as samplers (issue 36, part 4), each by its defining
property on the real model's logits: min-p keeps exactly the tokens with
``p >= min_p * p_max``; typical-p exactly the set of Meister et al.'s rule
(Hugging Face's ``TypicalLogitsWarper``); XTC removes exactly the tokens
above its threshold but the least likely of them, and never acts with
probability 0; DRY lowers the logit of the token that would extend a
repeated sequence by ``multiplier * base ** (n - allowed_length)``;
Mirostat v2's observed surprise settles at its target ``tau``. Greedy
output is unchanged when none of them is used. References are computed
here, independently, in float64."""

from __future__ import annotations

import copy
import math
import random
import statistics

import numpy as np
import pytest
import torch

from harness import inline_program, run_ok
from tartlet import Sampler
from tartlet.engine.core.dry import DryBreakers, DryParams, _vocab_texts, dry_penalties, process_breakers
from tartlet.engine.core.sampler import SamplerSpec, SlotSampler
from tartlet.engine.core.sampling_filters import xtc
from tartlet.host.api import HostApi
from tartlet.sdk import mirostat
from tartlet.sdk.errors import SamplingError
from tartlet.sdk.forward import OutputSlot

PROMPTS = ["Write a short poem about the sea.", "List three colors.", "Tell me a story about a fox."]


@pytest.fixture(scope="module")
def api(host_state):
    a = HostApi(host_state)
    yield a
    a.close()


def chat_ids(engine, text: str) -> list[int]:
    rendered = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    return engine.tokenizer.encode(rendered)


def one_pass(api, ids: list[int], outputs: list[OutputSlot]) -> list:
    """Run ``ids`` on a fresh context with ``outputs`` at its last token; free it."""
    h = api.context_new(None)
    try:
        return api.forward(h, ids, outputs=outputs).result(timeout=120)
    finally:
        api.context_free(h)


@pytest.fixture(scope="module")
def rows(api, engine):
    """The real model's next-token logits (float32 ``[V]``) after each prompt."""
    out = []
    for text in PROMPTS:
        ids = chat_ids(engine, text)
        out.append((ids, torch.tensor(one_pass(api, ids, [OutputSlot(len(ids) - 1, "logits")])[0], dtype=torch.float32)))
    return out


def softmax64(row: torch.Tensor, t: float) -> np.ndarray:
    x = row.double().numpy() / t
    e = np.exp(x - x.max())
    return e / e.sum()


def candidate_set(spec: SamplerSpec, row: torch.Tensor, vocab: int) -> set[int]:
    p, ids = SlotSampler(vocab).candidates(row, spec)
    return set(range(vocab)) if ids is None else set(ids.tolist())


def draws(api, ids: list[int], n: int = 200, **kw) -> list[int]:
    """``n`` seeded draws (seeds 0..n-1) at the prompt's last token, one pass."""
    return one_pass(api, ids, [OutputSlot(len(ids) - 1, "sample", seed=s, **kw) for s in range(n)])


# -- min-p, typical-p -----------------------------------------------------------------


@pytest.mark.parametrize("t", [0.7, 1.0, 1.5])
def test_min_p_keeps_exactly_the_tokens_above_p_times_max(api, rows, engine, t):
    vocab = engine.config.vocab_size
    for ids, row in rows:
        q = softmax64(row, t)
        for mp in (0.02, 0.1, 0.3):
            want = set(np.flatnonzero(q >= mp * q.max()).tolist())
            assert candidate_set(SamplerSpec(temperature=t, min_p=mp), row, vocab) == want, (t, mp)
        want = set(np.flatnonzero(q >= 0.05 * q.max()).tolist())
        got = draws(api, ids, temperature=t, min_p=0.05)
        assert set(got) <= want and len(set(got)) > 1


def typical_reference(q: np.ndarray, mass: float) -> set[int]:
    """Locally typical set (Meister et al. 2023; HF TypicalLogitsWarper),
    float64: tokens by |surprise - entropy| ascending until the mass is
    reached; ties at the cut kept."""
    live = np.flatnonzero(q > 0)
    qq = q[live] / q[live].sum()
    surprise = -np.log(qq)
    dist = np.abs(surprise - float((qq * surprise).sum()))
    order = np.argsort(dist, kind="stable")
    cum = np.cumsum(qq[order])
    cut = min(int(np.searchsorted(cum, mass, side="left")), len(order) - 1)
    return set(live[dist <= dist[order[cut]]].tolist())


def test_typical_p_keeps_exactly_the_locally_typical_set(api, rows, engine):
    vocab = engine.config.vocab_size
    for ids, row in rows:
        for t in (0.8, 1.0):
            q = softmax64(row, t)
            for mass in (0.2, 0.5, 0.9, 0.95):
                want = typical_reference(q, mass)
                assert candidate_set(SamplerSpec(temperature=t, typical_p=mass), row, vocab) == want, (t, mass)
        # after top-k: the rule runs on the 40 most likely, renormalised
        q = softmax64(row, 1.0)
        top = np.argsort(-q, kind="stable")[:40]
        cut = np.zeros_like(q)
        cut[top] = q[top]
        assert candidate_set(SamplerSpec(temperature=1.0, top_k=40, typical_p=0.5), row, vocab) == typical_reference(cut, 0.5)
        got = draws(api, ids, temperature=1.0, typical_p=0.5)
        assert set(got) <= typical_reference(q, 0.5)


# -- XTC --------------------------------------------------------------------------------


def test_xtc_removes_the_top_choices_but_the_last_and_never_acts_at_probability_0(api, rows, engine):
    ids, row = rows[2]
    t = 1.5
    q = softmax64(row, t)
    order = np.argsort(-q, kind="stable")
    assert q[order[2]] > q[order[3]]
    thr = float((q[order[2]] + q[order[3]]) / 2)  # exactly three tokens pass it
    assert 0.5 >= thr
    p = torch.softmax(row / t, -1)
    kept_p, kept = xtc(p, torch.arange(len(p)), 1.0, thr, torch.Generator().manual_seed(0))
    assert set(kept.tolist()) == set(range(len(p))) - {int(order[0]), int(order[1])}
    assert torch.equal(kept_p, p[kept])
    # on the host: with probability 1 the two most likely never come out, the third often does
    acted = draws(api, ids, temperature=t, xtc_probability=1.0, xtc_threshold=thr)
    assert not {int(order[0]), int(order[1])} & set(acted)
    third = q[order[2]] / (1 - q[order[0]] - q[order[1]])  # its share once the top two are gone
    assert abs(acted.count(int(order[2])) / len(acted) - third) < 5 * math.sqrt(third * (1 - third) / len(acted)) + 0.01
    plain = draws(api, ids, temperature=t)
    assert set(plain) & {int(order[0]), int(order[1])}
    # probability 0, or a threshold above 0.5, never acts: the draws are the plain sampler's
    assert draws(api, ids, temperature=t, xtc_probability=0.0, xtc_threshold=thr) == plain
    assert draws(api, ids, temperature=t, xtc_probability=1.0, xtc_threshold=0.51) == plain
    # at 0.5 a seed either keeps the plain draw (XTC did not act: its coin
    # is a stream of its own) or draws without the top two; about half act
    half = draws(api, ids, temperature=t, xtc_probability=0.5, xtc_threshold=thr)
    same = [a == b for a, b in zip(half, plain)]
    assert all(s or h not in (int(order[0]), int(order[1])) for s, h in zip(same, half))
    assert 60 < sum(not s for s in same) < 140  # Binomial(200, 0.5), minus acted seeds that drew the same token


# -- DRY ----------------------------------------------------------------------------------


def dry_reference(h: list[int], mult: float, base: float, allowed: int, last_n: int,
                  breakers: list[list[int]]) -> dict[int, float]:
    """DRY as llama.cpp defines it, O(n^2): for each earlier position, the
    length of the longest suffix of the context also ending there, not
    reaching back past the breaker found first scanning heads from the
    end; the next token of each such repetition of length >= allowed is
    penalised by mult * base ** (n - allowed) (the exponent capped so the
    power is a finite float32), single-token breakers excepted."""
    if last_n >= 0:
        h = h[len(h) - last_n:]
    n = len(h)
    if n <= allowed:
        return {}
    limit = n  # tokens after the breaker whose head is nearest the end (its longest complete form)
    for i in range(n):
        head = n - 1 - i
        whole = [len(b) for b in breakers if b[0] == h[head] and len(b) - 1 <= i and h[head:head + len(b)] == b]
        if whole:
            limit = i - (max(whole) - 1)
            break
    if limit < allowed:
        return {}
    best: dict[int, int] = {}
    for j in range(n - 1):
        m = 0
        while m < limit and j - m >= 0 and h[j - m] == h[n - 1 - m]:
            m += 1
        if m >= allowed:
            tok = h[j + 1]
            best[tok] = max(best.get(tok, -1), m)
    single = {b[0] for b in breakers if len(b) == 1}
    cap = int(math.log(3.4028234e38) / math.log(base)) if base > 1.000001 else None  # pow stays a finite float32
    return {t: mult * base ** (m - allowed if cap is None else min(m - allowed, cap)) for t, m in best.items() if t not in single}


def params(breakers: list[list[int]], mult=0.8, base=1.75, allowed=2, last_n=-1) -> DryParams:
    tails: dict[int, list[tuple[int, ...]]] = {}
    for b in breakers:
        tails.setdefault(b[0], []).append(tuple(b[1:]))
    br = DryBreakers({k: tuple(v) for k, v in tails.items()}, frozenset(b[0] for b in breakers if len(b) == 1))
    return DryParams(mult, base, allowed, last_n, br)


def test_dry_penalises_the_continuation_of_a_repeated_sequence_by_its_formula():
    a, b, c, d, e, x, nl = 10, 11, 12, 13, 14, 15, 99
    # "a b c" repeats: d would extend it to 4 tokens, 1 past the allowed 2
    assert dry_penalties([a, b, c, d, x, a, b, c], params([[nl]])) == pytest.approx({d: 0.8 * 1.75**1})
    assert dry_penalties([a, b, c, d, e, x, a, b, c, d], params([[nl]])) == pytest.approx({e: 0.8 * 1.75**2})
    assert dry_penalties([a, b, x, a, b], params([[nl]])) == pytest.approx({x: 0.8})  # n == allowed: base ** 0
    assert dry_penalties([a, x, e, a], params([[nl]])) == {}  # one token repeated: shorter than allowed
    # a breaker inside the repetition cuts it: only "b c" after the newline counts
    assert dry_penalties([a, nl, b, c, d, a, nl, b, c], params([[nl]])) == pytest.approx({d: 0.8})
    # the last n tokens only
    assert dry_penalties([a, b, c, d, x, a, b, c], params([[nl]], last_n=4)) == {}
    # a two-token breaker cuts only when complete
    assert dry_penalties([a, b, c, d, x, a, b, c], params([[x, a]])) == pytest.approx({d: 0.8})
    assert dry_penalties([a, b, c, d, x, a, b, c], params([[x, e]])) == pytest.approx({d: 0.8 * 1.75})
    # a single-token breaker is never penalised itself
    assert dry_penalties([a, b, nl, c, a, b], params([[nl]], allowed=1)) == {}
    assert dry_penalties([a, b, nl, c, a, b], params([[x]], allowed=1)) == pytest.approx({nl: 0.8 * 1.75})
    # against the definition on random contexts over a small alphabet (many repeats)
    rng = random.Random(0)
    for trial in range(300):
        h = [rng.randrange(6) for _ in range(rng.randrange(1, 60))]
        brk = [[rng.randrange(6) for _ in range(rng.randrange(1, 3))] for _ in range(rng.randrange(0, 3))]
        kw = dict(mult=rng.choice([0.5, 1.0, 3.0]), base=rng.choice([1.0, 1.75, 3.0]), allowed=rng.randrange(0, 4),
                  last_n=rng.choice([-1, 5, 20]))
        got = dry_penalties(h, params(brk, **kw))
        want = dry_reference(h, kw["mult"], kw["base"], kw["allowed"], kw["last_n"], brk)
        assert got == pytest.approx(want), (trial, h, brk, kw)
    # long runs of one token or a short period (the engine's Z-algorithm path)
    for h in ([a] * 300, [a, b] * 150, [a, b, c] * 90 + [d, a, b]):
        for brk in ([], [[d]]):
            assert dry_penalties(h, params(brk)) == pytest.approx(dry_reference(h, 0.8, 1.75, 2, -1, brk))


def test_dry_sequence_breakers_match_the_vocabulary_as_llama_cpp(tokenizer):
    """A token whose text holds a breaker is a breaker; one whose text ends
    with the start of a breaker heads it, the rest tokenized as its tail."""
    texts = _vocab_texts(tokenizer)
    for brk in ("\n", '"', "### Answer:"):
        got = process_breakers(tokenizer, (brk,))
        want: dict[int, set[tuple[int, ...]]] = {}
        for tok, w in enumerate(texts):
            if brk in w:
                want.setdefault(tok, set()).add(())
                continue
            for k in range(1, len(brk)):
                if w.endswith(brk[:k]):
                    want.setdefault(tok, set()).add(tuple(tokenizer.encode(brk[k:])[:20]))
        assert {t: set(v) for t, v in got.tails.items()} == want, brk
        assert got.single == {t for t, v in want.items() if () in v}
    assert len(process_breakers(tokenizer, ("\n",)).single) > 100  # "\n" alone and the tokens that hold it


def test_dry_on_the_real_model_changes_the_greedy_pick_by_the_formula(api, engine):
    """Greedy with DRY picks argmax(logits - penalty), the penalty from the
    context's tokens; it moves the model off a phrase it would repeat."""
    tok = engine.tokenizer
    ids = tok.encode("The secret words are: apple banana cherry grape lemon. Again, the secret words are: apple banana cherry")
    logits = torch.tensor(one_pass(api, ids, [OutputSlot(len(ids) - 1, "logits")])[0], dtype=torch.float64)
    brk = process_breakers(tok, ("\n", ":", '"', "*"))
    pen = dry_penalties(ids, DryParams(2.0, 1.75, 2, -1, brk))
    plain = int(logits.argmax())
    assert plain in pen, "the model would continue the repeated list"
    adjusted = logits.clone()
    for t, v in pen.items():
        adjusted[t] -= v
    want = int(adjusted.argmax())
    assert want != plain
    slot = OutputSlot(len(ids) - 1, "sample", temperature=0.0, dry_multiplier=2.0)
    assert one_pass(api, ids, [slot])[0] == want
    # the penalties are the definition's, with the vocabulary's breakers
    as_lists = [[head, *tail] for head, tails in brk.tails.items() for tail in tails]
    assert pen == pytest.approx(dry_reference(ids, 2.0, 1.75, 2, -1, as_lists))


# -- Mirostat v2 -------------------------------------------------------------------------


def test_mirostat_step_truncates_by_surprise_and_updates_mu():
    probs = [0.5, 0.2, 0.12, 0.08, 0.05, 0.03, 0.02]
    ids = list(range(100, 107))
    mu = -math.log2(0.08)  # keeps p >= 0.08: four tokens
    assert mirostat.truncate(probs, mu) == 4
    seen = {}
    for s in range(400):
        tok, surprise, new_mu = mirostat.draw(ids, probs, mu, 3.0, 0.1, random.Random(s))
        j = ids.index(tok)
        assert j < 4
        assert surprise == pytest.approx(-math.log2(probs[j] / sum(probs[:4])))
        assert new_mu == pytest.approx(mu - 0.1 * (surprise - 3.0))
        seen[j] = seen.get(j, 0) + 1
    assert set(seen) == {0, 1, 2, 3}
    assert mirostat.truncate(probs, 0.1) == 1  # at least the most likely
    # the distribution slot asks for enough tokens: at most 2**mu of them have p >= 2**-mu
    assert mirostat.candidates_needed(10.0, 49152) == 1025
    assert mirostat.candidates_needed(20.0, 49152) == 49152


def test_unseeded_mirostat_makes_its_random_stream_at_its_first_draw():
    """An unseeded Sampler seeds no random stream until Mirostat draws
    (seeding one from os.urandom cost ~0.1 ms a request); a copy draws from
    its own stream."""
    ids, probs = [5, 6, 7, 8], [0.4, 0.3, 0.2, 0.1]
    s = Sampler.mirostat_v2(3.0, eta=0.1)
    assert s._rng is None
    s.slot(0, 0)
    assert s.pick((ids, probs)) in ids and s._rng is not None
    rng = s._rng
    assert s.pick((ids, probs)) in ids and s._rng is rng  # the same stream from then on
    c = copy.copy(s)
    assert c._rng is None and c.surprises == s.surprises
    c.slot(0, 2)
    assert c.pick((ids, probs)) in ids and c._rng is not None and c._rng is not rng
    assert Sampler(seed=4)._rng is None and Sampler()._rng is None


MIROSTAT = """
from tartlet import Model, Sampler

async def main(args):
    model = Model.load()
    out = []
    for tau, t, seed in args["cases"]:
        s = Sampler.mirostat_v2(tau, eta=0.1, temperature=t, seed=seed)
        with model.new_context() as ctx:
            ctx.user("Write a short story about a dragon who learns to paint.")
            gen = ctx.generate(s, max_tokens=args["n"], eos=False)
            await gen.collect_tokens()
            out.append({"surprises": s.surprises, "mu": s.mu, "tokens": gen.tokens})
    return out
"""


@pytest.mark.slow  # 320 tokens, one pass each
async def test_mirostat_observed_surprise_settles_at_tau(runtime, tmp_path):
    """Seeded 160-token runs: the mean observed surprise of the second half
    is within 0.35 bits of tau (targets 2 and 4 bits; the model's own surprise
    at these temperatures starts below both)."""
    cases = [(2.0, 1.0, 1), (4.0, 1.5, 2)]
    res = await run_ok(runtime, inline_program(tmp_path, MIROSTAT, "mirostat"), {"cases": cases, "n": 160})
    for (tau, _, _), r in zip(cases, res):
        s = r["surprises"]
        assert len(s) == 160 == len(r["tokens"])
        assert abs(statistics.mean(s[80:]) - tau) < 0.35, (tau, statistics.mean(s[80:]))
    assert statistics.mean(res[1]["surprises"][80:]) - statistics.mean(res[0]["surprises"][80:]) > 1.4
    again = await run_ok(runtime, inline_program(tmp_path, MIROSTAT, "mirostat"), {"cases": cases[:1], "n": 20})
    assert again[0]["tokens"] == res[0]["tokens"][:20]  # seeded: reproducible


# -- greedy unchanged, validation -----------------------------------------------------------

GREEDY = """
from tartlet import Model, Sampler, forward

async def main(args):
    model = Model.load()
    out = {}
    samplers = {
        "greedy": Sampler.greedy(),
        # filters apply to draws only: at temperature 0 they change nothing
        "greedy_filters": Sampler(typical_p=0.3, xtc_probability=1.0, xtc_threshold=0.01, min_p=0.5),
        "seeded": Sampler(temperature=0.9, seed=4),
        "seeded_defaults": Sampler(temperature=0.9, seed=4, typical_p=1.0, xtc_probability=0.0, dry_multiplier=0.0),
    }
    for name, s in samplers.items():
        with model.new_context() as ctx:
            ctx.user(args["prompt"])
            out[name] = await ctx.generate(s, max_tokens=24, eos=False).collect_tokens()
    # the argmax of the logits, token by token (no sampler involved)
    with model.new_context() as ctx:
        ctx.user(args["prompt"])
        ctx.begin_assistant()
        toks = []
        for _ in range(24):
            [row] = await ctx.forward(outputs=[forward.logits(len(ctx.pending) - 1)])
            toks.append(max(range(len(row)), key=row.__getitem__))
            ctx.fill_tokens([toks[-1]])
        out["argmax"] = toks
    return out
"""


async def test_greedy_output_is_unchanged_when_no_new_sampler_is_used(runtime, tmp_path):
    res = await run_ok(runtime, inline_program(tmp_path, GREEDY, "greedy"), {"prompt": "Name three colors."})
    assert res["greedy"] == res["argmax"] == res["greedy_filters"]
    assert res["seeded"] == res["seeded_defaults"]


def test_sampler_parameters_are_validated_and_named(api):
    bad = {
        "typical_p": dict(typical_p=0.0), "xtc_probability": dict(xtc_probability=1.5),
        "xtc_threshold": dict(xtc_threshold=-0.1), "dry_multiplier": dict(dry_multiplier=-1.0),
        "dry_base": dict(dry_base=0.5), "dry_allowed_length": dict(dry_allowed_length=-1),
        "dry_penalty_last_n": dict(dry_penalty_last_n=-2), "dry_sequence_breakers": dict(dry_sequence_breakers="\n"),
    }
    h = api.context_new(None)
    for name, kw in bad.items():
        with pytest.raises(SamplingError, match=name):
            Sampler(temperature=1.0, **kw)
        with pytest.raises(SamplingError, match=name):  # the host checks too (a sandboxed caller may skip the SDK)
            api.forward(h, [1], outputs=[OutputSlot(0, "sample", temperature=1.0, **kw)])
    with pytest.raises(SamplingError, match="dry_sequence_breakers"):
        Sampler(dry_multiplier=1.0, dry_sequence_breakers=["x" * 41])
    with pytest.raises(SamplingError, match="tau"):
        Sampler.mirostat_v2(0.0)
    with pytest.raises(SamplingError, match="temperature"):
        Sampler.mirostat_v2(3.0, temperature=0.0)
    with pytest.raises(TypeError):
        Sampler.xtc(0.1, 0.5)  # keyword-only: llama.cpp's order (p, t) and webui's (t, p) differ
    assert api.context_len(h) == 0
    api.context_free(h)


async def test_mirostat_refuses_a_drafter_and_forks_copy_its_state(runtime, tmp_path):
    src = """
from tartlet import Model, NgramDrafter, Sampler

async def main(args):
    model = Model.load()
    s = Sampler.mirostat_v2(3.0, seed=1)
    with model.new_context() as ctx:
        ctx.user("Hi")
        try:
            ctx.generate(s, drafter=NgramDrafter())
            err = None
        except ValueError as e:
            err = str(e)
        gen = ctx.generate(s, max_tokens=3, eos=False)
        async for _ in gen:
            break
        child = gen.fork()
        await child.collect_tokens()
        out = {"err": err, "same_object": child.sampler is s, "parent_surprises": len(s.surprises),
               "child_surprises": len(child.sampler.surprises)}
        await gen.collect_tokens()
        child.ctx.close()
        return out
"""
    res = await run_ok(runtime, inline_program(tmp_path, src, "miro_fork"))
    assert "Mirostat" in res["err"]
    assert res == {**res, "same_object": False, "parent_surprises": 1, "child_surprises": 3}


async def test_dry_with_a_drafter_gives_the_tokens_of_plain_decoding(runtime, tmp_path):
    """Each draft position's DRY penalty reads its own prefix, so speculative
    decoding keeps exactly the tokens of step-by-step decoding."""
    src = """
from tartlet import Model, NgramDrafter, Sampler

async def main(args):
    model = Model.load()
    out = []
    for drafter in (None, NgramDrafter()):
        s = Sampler(dry_multiplier=1.5, dry_allowed_length=1)
        with model.new_context() as ctx:
            ctx.user("Repeat exactly: red blue red blue red blue red blue red blue")
            gen = ctx.generate(s, max_tokens=32, eos=False, drafter=drafter)
            await gen.collect_tokens()
            out.append({"tokens": gen.tokens, "accepted": gen.stats.accepted})
    return out
"""
    plain, drafted = await run_ok(runtime, inline_program(tmp_path, src, "dry_drafter"))
    assert drafted["tokens"] == plain["tokens"]
    assert drafted["accepted"] > 0  # drafts were verified and kept, not all rejected
