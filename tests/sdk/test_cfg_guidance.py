"""Classifier-free guidance (``tartlet.guidance`` and the ``cfg-guidance``
inferlet) on the real model: the guided logits are ``u + w (c - u)`` of the
two contexts' own logits, both passes of a step share one model call, and
``w = 1`` is plain greedy decoding."""

from __future__ import annotations

import numpy as np
import pytest

from harness import inline_program, run_ok
from tartlet.guidance import combine, pick

GUIDED = """
from tartlet import Model, forward
from tartlet.guidance import guided_logits

async def main(args):
    model = Model.load()
    w = args["scale"]
    with model.new_context() as c, model.new_context() as u:
        c.user(args["prompt"]); c.begin_assistant()
        u.user(args["negative"]); u.begin_assistant()
        ids_c, ids_u = list(c.pending), list(u.pending)
        first = await guided_logits(c, u, w)
        c.fill_tokens([7]); u.fill_tokens([7])
        second = await guided_logits(c, u, w)
    alone = []
    for ids in (ids_c, ids_u):  # each context's logits from a pass of its own
        with model.new_context() as ctx:
            ctx.fill_tokens(ids + [7])
            rows = await ctx.forward(outputs=[forward.logits(len(ids) - 1), forward.logits(len(ids))])
            alone.append(rows)
    return {"first": first, "second": second, "c": alone[0], "u": alone[1]}
"""


async def test_guided_logits_are_u_plus_w_times_c_minus_u(runtime, tmp_path, engine):
    w = 2.5
    calls = engine.scheduler.stats.model_calls
    res = await run_ok(runtime, inline_program(tmp_path, GUIDED, "guided"),
                       {"scale": w, "prompt": "Write a sentence about the ocean.", "negative": "Write a sentence."})
    assert engine.scheduler.stats.model_calls - calls <= 2 + 2  # a call per guided step (both passes), then the two references
    for step, key in ((0, "first"), (1, "second")):
        c = np.array(res["c"][step], dtype=np.float64)
        u = np.array(res["u"][step], dtype=np.float64)
        want = u + w * (c - u)
        got = np.array(res[key], dtype=np.float64)
        # float32 logits, batched or alone the same bits on this engine (measured: 0.0)
        assert np.abs(got - want).max() < 1e-5 * (1 + w), (key, np.abs(got - want).max())
        assert int(got.argmax()) == int(want.argmax())


async def test_scale_1_is_plain_greedy_decoding(runtime):
    args = {"prompt": "Name three colors.", "max_tokens": 24}
    guided = await run_ok(runtime, "cfg-guidance", {**args, "guidance_scale": 1.0})
    plain = await run_ok(runtime, "text-completion", args)
    assert guided["tokens"] == plain["tokens"] and guided["text"] == plain["text"]
    assert guided["finish_reason"] == plain["finish_reason"] == "eos"


async def test_cfg_inferlet_batches_both_contexts_and_guidance_changes_the_output(runtime, engine):
    args = {"prompt": "The capital of France is", "raw": True, "max_tokens": 10, "ignore_eos": True}
    calls = engine.scheduler.stats.model_calls
    strong = await run_ok(runtime, "cfg-guidance", {**args, "guidance_scale": 4.0, "negative_prompt": "The capital of Italy is"})
    assert len(strong["tokens"]) == 10
    assert engine.scheduler.stats.model_calls - calls <= 10 + 1  # one call per step (the first may prefill apart)
    plain = await run_ok(runtime, "cfg-guidance", {**args, "guidance_scale": 1.0})
    assert strong["tokens"] != plain["tokens"]
    seeded = [await run_ok(runtime, "cfg-guidance", {**args, "temperature": 0.8, "seed": 5}) for _ in range(2)]
    assert seeded[0]["tokens"] == seeded[1]["tokens"]


def test_combine_and_pick():
    assert combine([1.0, 3.0], [2.0, 0.0], 1.5) == [0.5, 4.5]
    with pytest.raises(ValueError, match="one length"):
        combine([1.0], [1.0, 2.0], 1.0)
    with pytest.raises(ValueError, match="guidance scale"):
        combine([1.0], [1.0], float("nan"))
    assert pick([0.0, 2.0, 2.0, 1.0]) == 1  # the first of ties
    import random
    rng = random.Random(0)
    got = [pick([0.0, 1.0, 5.0], 1.0, 0.5, rng) for _ in range(50)]
    assert set(got) == {2}  # the nucleus of mass 0.5 is the most likely token alone
    with pytest.raises(ValueError, match="top_p"):
        pick([0.0], 1.0, 0.0)
