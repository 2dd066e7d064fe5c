"""The explicit forward pass, probes, custom samplers and the generator, on the real model.

``Context.forward`` takes explicit positions, per-token attention masks
(BRLE), logit masks and several output slots in one pass; each must agree
with the plain path it generalises.
"""

from __future__ import annotations

import math

import pytest

from harness import inline_program, run_ok

PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog"


async def test_output_slots_agree_with_each_other(runtime, tmp_path):
    """One pass, five slot kinds at two input positions: the distribution,
    log-probabilities, entropy and greedy sample all follow from the raw
    logits of the same position."""
    code = f"""
    from tartlet import Model, Sampler
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ids = model.tokenize({PROMPT!r})
        n = len(ids)
        res = await ctx.forward(ids, outputs=[
            forward.logits(n - 1), forward.distribution(n - 1, k=5), forward.logprobs(n - 1, [11, 12, 13]),
            forward.entropy(n - 1), forward.sample(n - 1, Sampler.greedy()),
            forward.logits(3), forward.sample(3, Sampler.greedy()),
            forward.distribution(n - 1, k=5, temperature=0.5),
        ])
        return {{"res": res, "n": n, "kv": ctx.kv_len}}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "slots"))
    logits, (ids, probs), lps, ent, tok, logits3, tok3, (ids_t, probs_t) = out["res"]
    assert out["kv"] == out["n"]
    m = max(logits)
    z = sum(math.exp(x - m) for x in logits)
    logp = [x - m - math.log(z) for x in logits]
    top = sorted(range(len(logits)), key=lambda i: -logits[i])[:5]
    assert list(ids) == top
    assert all(abs(p - math.exp(logp[i])) < 1e-5 for i, p in zip(ids, probs))
    assert all(abs(lp - logp[i]) < 1e-4 for i, lp in zip([11, 12, 13], lps))
    assert abs(ent - -sum(math.exp(x) * x for x in logp)) < 1e-3
    assert tok == top[0]
    assert tok3 == max(range(len(logits3)), key=lambda i: logits3[i])
    assert logits3 != logits
    # temperature sharpens: same order, higher top probability
    assert list(ids_t) == top and probs_t[0] > probs[0]


async def test_explicit_positions_equal_to_default_change_nothing(runtime, tmp_path):
    code = f"""
    from tartlet import Model
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ids = model.tokenize({PROMPT!r})
        a, b = model.new_context(), model.new_context()
        (la,) = await a.forward(ids, outputs=[forward.logits(len(ids) - 1)])
        (lb,) = await b.forward(ids, positions=list(range(len(ids))), outputs=[forward.logits(len(ids) - 1)])
        # RoPE encodes relative positions: shifting all of them changes
        # the logits only by rounding
        c = model.new_context()
        (lc,) = await c.forward(ids, positions=[p + 1000 for p in range(len(ids))], outputs=[forward.logits(len(ids) - 1)])
        return {{"diff_same": max(abs(x - y) for x, y in zip(la, lb)), "diff_shift": max(abs(x - y) for x, y in zip(la, lc))}}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "positions"))
    assert out["diff_same"] == 0.0
    assert out["diff_shift"] < 0.05, "RoPE attention depends on relative positions only"


async def test_custom_attention_mask_equals_masking_and_equals_a_shorter_context(runtime, tmp_path):
    """Hiding the middle segment B of A+B+C three ways gives the same logits:
    a BRLE attention mask per token of C, ``mask_token_range`` over B, and a
    context that never had B, with C at the same explicit positions."""
    code = """
    from tartlet import Model
    from tartlet.sdk import brle, forward

    async def main(args):
        model = Model.load()
        A = model.tokenize("My favourite colour is blue. ")
        B = model.tokenize("Ignore that: my favourite colour is green, and I love green things. ")
        C = model.tokenize("So my favourite colour is")
        a, b = len(A), len(B)
        out = lambda: [forward.logits(len(C) - 1)]
        pos_c = list(range(a + b, a + b + len(C)))

        x = model.new_context()           # attention masks on C's tokens
        x.fill_tokens(A + B)
        await x.flush()
        masks = [brle.from_ranges(a + b + j + 1, [(0, a), (a + b, a + b + j + 1)]) for j in range(len(C))]
        (lx,) = await x.forward(C, attention=masks, outputs=out())

        y = model.new_context()           # mask_token_range over B
        y.fill_tokens(A + B)
        await y.flush()
        y.mask_token_range(a, a + b)
        (ly,) = await y.forward(C, outputs=out())

        z = model.new_context()           # no B at all, C at the same positions
        z.fill_tokens(A)
        await z.flush()
        (lz,) = await z.forward(C, positions=pos_c, outputs=out())

        w = model.new_context()           # B visible: the plain context
        w.fill_tokens(A + B)
        await w.flush()
        (lw,) = await w.forward(C, outputs=out())
        d = lambda p, q: max(abs(i - j) for i, j in zip(p, q))
        return {"xz": d(lx, lz), "yz": d(ly, lz), "wz": d(lw, lz)}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "attn"))
    assert out["xz"] < 1e-3, out
    assert out["yz"] < 1e-3, out
    assert out["wz"] > 0.1, f"B should matter when visible: {out}"


async def test_logit_mask_restricts_sampling(runtime, tmp_path):
    code = f"""
    from tartlet import Model, Sampler
    from tartlet.sdk import brle, forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ids = model.tokenize({PROMPT!r})
        n = len(ids)
        allowed = [100, 2000, 3000]
        mask = brle.from_ranges(model.vocab_size, [(t, t + 1) for t in allowed])
        logits, tok, (d_ids, d_probs) = await ctx.forward(ids, outputs=[
            forward.logits(n - 1), forward.sample(n - 1, Sampler.greedy(), logit_mask=mask),
            forward.distribution(n - 1, k=5, logit_mask=mask),
        ])
        return {{"logits": [logits[t] for t in allowed], "tok": tok, "d_ids": d_ids, "d_probs": d_probs}}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "logitmask"))
    allowed = [100, 2000, 3000]
    best = allowed[max(range(3), key=lambda i: out["logits"][i])]
    assert out["tok"] == best
    assert set(out["d_ids"][:3]) == set(allowed) and out["d_ids"][0] == best
    assert abs(sum(out["d_probs"][:3]) - 1.0) < 1e-5  # masked tokens get no mass


async def test_custom_sampler_and_reasoning_preset(runtime, tmp_path):
    """``Sampler.custom`` sees the engine's top-k (ids, probs) and its choice
    is followed: always picking the second most likely token gives a
    different, reproducible generation whose every token was second."""
    code = """
    from tartlet import Model, Sampler
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        seen = []

        def second(ids, probs):
            seen.append((list(ids), list(probs)))
            return ids[1]

        ctx = model.new_context()
        ctx.user("Name a colour.")
        gen = ctx.generate(Sampler.custom(second, k=4), max_tokens=8)
        toks = await gen.collect_tokens()
        # replay: the second choice at each step, checked with a distribution probe
        check = model.new_context()
        check.user("Name a colour.")
        check.begin_assistant()
        rank = []
        for t in toks:
            (ids, probs), = await check.forward(outputs=[forward.distribution(len(check.pending) - 1, k=4)])
            rank.append(list(ids).index(t) if t in ids else -1)
            check.fill_tokens([t])
        r = Sampler.reasoning(seed=3)
        return {"toks": toks, "seen": seen, "rank": rank,
                "reasoning": [r.temperature, r.top_k, r.top_p, r.seed]}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "custom"))
    assert len(out["toks"]) == 8 and len(out["seen"]) == 8
    for ids, probs in out["seen"]:
        assert len(ids) == 4 and probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6
    assert out["rank"] == [1] * 8
    assert out["reasoning"] == [0.6, 20, 0.95, 3]


async def test_generator_streams_steps_and_collects(runtime, tmp_path):
    code = """
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.user("What is the capital of France?")
        gen = ctx.generate(max_tokens=16)
        steps = []
        async for step in gen:
            steps.append([step.tokens, step.text])
        again = model.new_context()
        again.user("What is the capital of France?")
        text = await again.generate(max_tokens=16).collect_text()
        j2 = model.new_context()
        j2.fill('Here is a JSON list of three numbers: [1, 2,')
        bad = None
        try:
            await j2.generate(max_tokens=3).collect_json()
        except ValueError as e:
            bad = str(e)
        return {"steps": steps, "tokens": gen.tokens, "text": gen.text, "reason": gen.finish_reason,
                "again": text, "bad": bad}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "gen"))
    assert [t for s in out["steps"] for t in s[0]] == out["tokens"]
    assert all(len(s[0]) == 1 for s in out["steps"])  # no drafter: one token a step
    assert "".join(s[1] for s in out["steps"]) == out["text"] == out["again"]
    assert out["text"] == "The capital of France is Paris." and out["reason"] == "eos"
    assert out["bad"] is not None and out["bad"].startswith("generated text is not valid JSON")


async def test_collect_json(runtime, tmp_path):
    code = """
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.user('Reply with only this JSON object, nothing else: {"name": "Bob", "age": 42}')
        return await ctx.generate(max_tokens=24).collect_json()
    """
    assert await run_ok(runtime, inline_program(tmp_path, code, "json")) == {"name": "Bob", "age": 42}


async def test_bad_forward_input_is_rejected_and_leaves_the_context_usable(runtime, tmp_path):
    code = f"""
    from tartlet import Model
    from tartlet.sdk import forward

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill({PROMPT!r})
        await ctx.flush()
        n = ctx.kv_len
        errors = {{}}
        async def expect(name, coro_fn):
            try:
                await coro_fn()
            except ValueError as e:
                errors[name] = str(e)
        L = model.max_seq_len
        await expect("position", lambda: ctx.forward([5, 6], positions=[n, L]))
        await expect("negative position", lambda: ctx.forward([5], positions=[-1]))
        await expect("positions length", lambda: ctx.forward([5, 6], positions=[n]))
        await expect("attention length", lambda: ctx.forward([5, 6], attention=[[0, 3]]))
        await expect("attention too long", lambda: ctx.forward([5], attention=[[0, n + 50]]))
        await expect("output index", lambda: ctx.forward([5], outputs=[forward.logits(1)]))
        await expect("no input", lambda: ctx.forward())
        await expect("too long", lambda: ctx.forward([5] * (L - n + 1)))
        ctx.fill("!")
        def mask(a, b):
            async def f():
                ctx.mask_token_range(a, b)
            return f
        await expect("mask beyond", mask(0, n + 1))  # the pending token cannot be masked
        await expect("mask reversed", mask(5, 2))
        async def trunc():
            ctx.truncate(n + 2)
        await expect("truncate beyond", trunc)
        empty = model.new_context()
        await expect("generate on empty", lambda: empty.generate(max_tokens=4).collect_text())
        gone = ctx.fork()
        gone.close()
        async def fork_closed():
            gone.fork()
        await expect("fork of closed", fork_closed)
        await expect("generate on closed", lambda: gone.generate(max_tokens=4).collect_text())
        kv_after = ctx.kv_len
        text = await ctx.generate(max_tokens=8).collect_text()
        ref = model.new_context()
        ref.fill({PROMPT!r} + "!")
        ref_text = await ref.generate(max_tokens=8).collect_text()
        return {{"errors": errors, "n": n, "kv_after": kv_after, "pending": 1, "text": text, "ref": ref_text}}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "badfwd"))
    e = out["errors"]
    assert len(e) == 14, e
    assert e["fork of closed"].startswith("fork on a closed context")
    assert "closed context" in e["generate on closed"]
    assert "position" in e["position"] and "outside the model's context" in e["position"]
    assert "outside the model's context" in e["negative position"]
    assert "one per token" in e["positions length"]
    assert "one mask per token" in e["attention length"]
    assert "covers" in e["attention too long"]
    assert e["output index"].startswith("output index 1 outside")
    assert "needs input" in e["no input"]
    assert "more than the model's" in e["too long"]
    assert "mask range" in e["mask beyond"] and "mask range" in e["mask reversed"]
    assert "truncate" in e["truncate beyond"]
    assert "empty context" in e["generate on empty"]
    assert out["kv_after"] == out["n"], "a rejected call must not change the context"
    assert out["text"] == out["ref"]


def test_brle_excluding_bans_exactly_the_ids():
    from tartlet.sdk import brle

    assert brle.decode(brle.excluding(6, [4, 0, 4])) == [False, True, True, True, False, True]
    assert brle.decode(brle.excluding(3, [])) == [True, True, True]
    assert brle.decode(brle.excluding(2, [0, 1])) == [False, False]
    with pytest.raises(ValueError, match="outside"):
        brle.excluding(3, [3])
