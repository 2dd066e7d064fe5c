"""Constrained modes (``json_schema`` / ``regex`` / ``grammar``) of the
``best-of-n`` and ``beam-search`` inferlets on the real model.

Outputs are checked with independent tools (``jsonschema``, Python's ``re``);
a wrapper inferlet runs the inferlet's ``main`` and then counts the grammar
matchers still alive, so forked per-candidate / per-beam matchers are shown
to be freed by the inferlet itself (the ``runtime`` fixture checks pages).
"""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema

from harness import inline_program, run, run_ok
from tartlet.runtime.instance import Status
from tartlet.runtime.program import find_program

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"[0-9]{3}-[0-9]{3}-[0-9]{4}"
LARK_KV = 'start: pair (";" pair){0,1}\npair: KEY "=" VALUE\nKEY: /[a-z]{1,6}/\nVALUE: /[0-9]{1,3}/'

# Runs an inferlet's main() inside this instance, then reports how many
# grammar matchers the instance still holds (native host API).
WRAP = """
import importlib.util
from tartlet.sdk import _binding

async def main(args):
    spec = importlib.util.spec_from_file_location("wrapped_inferlet", args["entry"])
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = await mod.main(args["args"])
    res["live_matchers"] = len(_binding.host()._matchers)
    return res
"""


def _wrapped(runtime, tmp_path, name: str, args: dict):
    prog = inline_program(tmp_path, WRAP, "wrap")
    return run_ok(runtime, prog, {"entry": str(find_program(name).entry), "args": args})


async def test_best_of_n_and_beam_search_json_schema(runtime, tmp_path):
    prompt = "Describe a person as JSON with a name and an age."
    bon, beam = await asyncio.gather(
        _wrapped(runtime, tmp_path, "best-of-n", {"prompt": prompt, "n": 3, "max_tokens": 32, "seed": 3, "json_schema": PERSON}),
        _wrapped(runtime, tmp_path, "beam-search", {"prompt": prompt, "k": 2, "max_tokens": 32, "json_schema": PERSON}),
    )
    # best-of-n: every candidate is complete, schema-valid JSON
    cands = bon["candidates"]
    assert len(cands) == 3
    for c in cands:
        assert c["finish_reason"] == "constraint", c
        value = json.loads(c["text"])
        jsonschema.validate(value, PERSON)
        assert c["json"] == value
        assert len(c["logprobs"]) == len(c["tokens"]) and all(lp <= 0 for lp in c["logprobs"])
    assert len({c["text"] for c in cands}) > 1, "seeded candidates should differ"
    assert bon["score"] == max(c["score"] for c in cands) == cands[bon["best"]]["score"]
    assert bon["tokens"] == cands[bon["best"]]["tokens"] and bon["json"] == cands[bon["best"]]["json"]
    jsonschema.validate(json.loads(bon["text"]), PERSON)
    # beam-search: k finished hypotheses, each valid; finished ones rank first
    beams = beam["beams"]
    done = [b for b in beams if b["finished"]]
    assert len(done) >= 2
    assert beams[: len(done)] == done
    for b in done:
        value = json.loads(b["text"])
        jsonschema.validate(value, PERSON)
        assert b["json"] == value
    assert [b["score"] for b in done] == sorted((b["score"] for b in done), reverse=True)
    assert len({tuple(b["tokens"]) for b in beams}) == len(beams)
    assert beam["json"] == done[0]["json"] and beam["tokens"] == done[0]["tokens"]
    # every per-candidate / per-beam matcher was freed by the inferlet
    assert bon["live_matchers"] == 0 and beam["live_matchers"] == 0


CONSTRAINED_GREEDY = """
from tartlet import JsonSchema, Model, Sampler
from tartlet.sdk import forward

async def main(args):
    model = Model.load()
    with model.new_context() as ctx, JsonSchema(args["schema"]) as c:
        ctx.user(args["prompt"])
        gen = ctx.generate(Sampler.greedy(), max_tokens=args["max_tokens"], constraint=c)
        toks = await gen.collect_tokens()
    # the model's own (unconstrained) log-probability of the tokens
    with model.new_context() as ctx:
        ctx.user(args["prompt"])
        ctx.begin_assistant()
        base = len(ctx.pending)
        ctx.fill_tokens(toks)
        outs = [forward.logprobs(base - 1 + i, [t]) for i, t in enumerate(toks)]
        lp = sum(x[0] for x in await ctx.forward(outputs=outs))
    return {"tokens": toks, "finish_reason": gen.finish_reason, "model_logprob": lp}
"""


async def test_constrained_beam_of_width_one_is_constrained_greedy(runtime, tmp_path):
    """Width 1 under a schema is greedy decoding under the same schema; the
    beam's log-probability is of the renormalised (masked) distribution, so
    it is at least the model's unconstrained log-probability."""
    prompt = "Describe a person as JSON."
    one, ref = await asyncio.gather(
        run_ok(runtime, "beam-search", {"prompt": prompt, "k": 1, "max_tokens": 32, "json_schema": PERSON}),
        run_ok(runtime, inline_program(tmp_path, CONSTRAINED_GREEDY, "cgreedy"), {"prompt": prompt, "schema": PERSON, "max_tokens": 32}),
    )
    assert ref["finish_reason"] == "constraint"
    assert one["tokens"] == ref["tokens"] and one["beams"][0]["finished"]
    jsonschema.validate(one["json"], PERSON)
    assert one["logprob"] >= ref["model_logprob"] - 1e-3 and one["logprob"] <= 0


async def test_regex_and_grammar_constrain_every_candidate_and_beam(runtime, tmp_path):
    kv = r"[a-z]{1,6}=[0-9]{1,3}(;[a-z]{1,6}=[0-9]{1,3})?"
    runs = [
        _wrapped(runtime, tmp_path, "best-of-n", {"prompt": "Give a phone number.", "n": 3, "max_tokens": 24, "seed": 1, "regex": PHONE}),
        _wrapped(runtime, tmp_path, "beam-search", {"prompt": "Give a phone number.", "k": 3, "max_tokens": 24, "regex": PHONE}),
        _wrapped(runtime, tmp_path, "best-of-n", {"prompt": "Write a setting.", "n": 3, "max_tokens": 24, "seed": 7, "grammar": LARK_KV}),
        _wrapped(runtime, tmp_path, "beam-search", {"prompt": "Write a setting.", "k": 2, "max_tokens": 24, "grammar": LARK_KV}),
    ]
    phone_bon, phone_beam, kv_bon, kv_beam = await asyncio.gather(*runs)
    for res, pattern in ((phone_bon, PHONE), (kv_bon, kv)):
        for c in res["candidates"]:
            assert c["finish_reason"] in ("constraint", "eos"), c
            assert re.fullmatch(pattern, c["text"]), (pattern, c["text"])
        assert re.fullmatch(pattern, res["text"])
        assert "json" not in res
    for res, pattern in ((phone_beam, PHONE), (kv_beam, kv)):
        done = [b for b in res["beams"] if b["finished"]]
        assert done and res["beams"][0]["finished"]
        for b in done:
            assert re.fullmatch(pattern, b["text"]), (pattern, b["text"])
    for res in (phone_bon, phone_beam, kv_bon, kv_beam):
        assert res["live_matchers"] == 0


async def test_constraint_argument_errors(runtime):
    """Two constraint args, or a bad spec, fail before anything is prefilled
    (the runtime fixture then finds no leaked page)."""
    for name, base in (("best-of-n", {"prompt": "x", "n": 3}), ("beam-search", {"prompt": "x", "k": 2})):
        for args, msg in (
            ({"json_schema": PERSON, "regex": PHONE}, "at most one of `json_schema`, `regex`, `grammar`"),
            ({"regex": PHONE, "grammar": LARK_KV}, "got `regex` and `grammar`"),
            ({"regex": "(ab"}, "unclosed group"),
            ({"json_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 3}}, "required": ["a"]}}, "unsatisfiable"),
            ({"grammar": 42}, "a grammar is a str"),
        ):
            inst = await run(runtime, name, {**base, **args})
            assert inst.status is Status.FAILED, (name, args)
            assert msg in inst.error, (name, args, inst.error)
