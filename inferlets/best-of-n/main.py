"""best-of-n: sample N answers concurrently, keep the most likely one.

The prompt is prefilled once and forked N times. Each fork samples with a
custom sampler (:meth:`Sampler.custom`): the engine returns the top-``k``
distribution of ``softmax(logits)`` for each step, the inferlet draws a token
from it (top-k sampling with its own seeded RNG) and adds the token's
log-probability under the model to the candidate's score. Candidates are
ranked by mean log-probability per generated token (length-normalised
likelihood, as in the "best-of" option of OpenAI-style APIs).

Constrained mode: with one of ``json_schema``, ``regex`` or ``grammar`` every
candidate is generated under that constraint (docs/constrained-decoding.md).
The constraint is compiled once and forked per candidate, so each candidate
has its own matcher state. The host masks each step's logits with the
candidate's matcher before the softmax, so a candidate's ``logprobs`` are
log-probabilities of the *constrained* distribution (renormalised over the
allowed tokens). A complete candidate (``finish_reason`` ``"constraint"`` or
``"eos"``) always ranks above one cut off by ``max_tokens`` (``"length"``),
whose text does not satisfy the constraint.

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    n (int, default 4): candidates (1..32).
    max_tokens (int, default 64): per candidate.
    k (int, default 40): top-k of each draw.
    seed (int, default 0): candidate ``i`` uses seed ``seed + i``.
    json_schema (dict or JSON text): every candidate is one JSON value valid
        against this JSON Schema (:class:`tartlet.JsonSchema`, compact JSON).
    regex (str): every candidate matches this regex in full
        (:class:`tartlet.Regex`, Rust ``regex`` syntax).
    grammar (str): every candidate is a sentence of this Lark or GBNF
        grammar (:class:`tartlet.Grammar`).
    At most one of ``json_schema``, ``regex``, ``grammar`` (ValueError
    otherwise; an invalid spec raises the grammar engine's ValueError before
    anything is prefilled).

Returns ``{"text", "tokens", "score", "best": int, "candidates":
[{"text", "tokens", "logprobs": [float], "score", "finish_reason"}]}`` where
``score`` is the mean natural-log probability of the candidate's tokens and
``logprobs`` holds each token's log-probability. With ``json_schema`` the
result and each candidate also carry ``"json"``: the parsed value, or None
for a candidate cut off by ``max_tokens``.
"""

import asyncio
import json
import math
import random

from tartlet import Model, Sampler, session
from tartlet.constraint import constraint_from_args

COMPLETE = ("constraint", "eos")


def make_constraint(args: dict, model_name: str):
    """The ``json_schema`` / ``regex`` / ``grammar`` constraint of ``args`` (or None)."""
    return constraint_from_args(args, model_name, "best-of-n")


class ScoringSampler:
    """Top-k sampling that records the log-probability of every pick."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.logprobs: list[float] = []

    def __call__(self, ids: list[int], probs: list[float]) -> int:
        # under a constraint the top-k may hold masked tokens with probability 0
        live = [i for i, p in enumerate(probs) if p > 0]
        i = self.rng.choices(live, weights=[probs[j] for j in live])[0]
        self.logprobs.append(math.log(probs[i]))
        return ids[i]


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("best-of-n needs a non-empty string argument `prompt`")
    n = int(args.get("n", 4))
    if not 1 <= n <= 32:
        raise ValueError(f"best-of-n: n must be in 1..32, got {n}")
    max_tokens = int(args.get("max_tokens", 64))
    k = int(args.get("k", 40))
    seed = int(args.get("seed", 0))
    model = Model.load(args.get("model"))
    constraint = make_constraint(args, model.name)
    is_json = args.get("json_schema") is not None

    try:
        with model.new_context() as root:
            if args.get("system"):
                root.system(args["system"])
            root.user(prompt)
            root.begin_assistant()
            await root.flush()

            async def candidate(i: int) -> dict:
                scorer = ScoringSampler(seed + i)
                own = constraint.fork() if constraint is not None else None
                try:
                    with root.fork() as ctx:
                        gen = ctx.generate(Sampler.custom(scorer, k=k), max_tokens=max_tokens, constraint=own)
                        await gen.collect_text()
                finally:
                    if own is not None:
                        own.close()
                lp = scorer.logprobs
                c = {
                    "text": gen.text,
                    "tokens": gen.tokens,
                    "logprobs": lp,
                    "score": sum(lp) / len(lp),
                    "finish_reason": gen.finish_reason,
                }
                if is_json:
                    c["json"] = json.loads(gen.text) if gen.finish_reason in COMPLETE else None
                return c

            cands = await asyncio.gather(*(candidate(i) for i in range(n)))
    finally:
        if constraint is not None:
            constraint.close()

    def rank(i: int) -> tuple:
        c = cands[i]
        return (constraint is None or c["finish_reason"] in COMPLETE, c["score"])

    best = max(range(n), key=rank)
    for i, c in enumerate(cands):
        mark = "*" if i == best else " "
        session.send(f"{mark} [{i}] score {c['score']:.3f}: {c['text']}\n")
    b = cands[best]
    out = {"text": b["text"], "tokens": b["tokens"], "score": b["score"], "best": best, "candidates": cands}
    if is_json:
        out["json"] = b["json"]
    return out
