"""best-of-n: sample N answers concurrently, keep the most likely one.

The prompt is prefilled once and forked N times. Each fork samples with a
custom sampler (:meth:`Sampler.custom`): the engine returns the top-``k``
distribution of ``softmax(logits)`` for each step, the inferlet draws a token
from it (top-k sampling with its own seeded RNG) and adds the token's
log-probability under the model to the candidate's score. Candidates are
ranked by mean log-probability per generated token (length-normalised
likelihood, as in the "best-of" option of OpenAI-style APIs).

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    n (int, default 4): candidates (1..32).
    max_tokens (int, default 64): per candidate.
    k (int, default 40): top-k of each draw.
    seed (int, default 0): candidate ``i`` uses seed ``seed + i``.

Returns ``{"text", "tokens", "score", "best": int, "candidates":
[{"text", "tokens", "logprobs": [float], "score", "finish_reason"}]}`` where
``score`` is the mean natural-log probability of the candidate's tokens and
``logprobs`` holds each token's log-probability.
"""

import asyncio
import math
import random

from tartlet import Model, Sampler, session


class ScoringSampler:
    """Top-k sampling that records the log-probability of every pick."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.logprobs: list[float] = []

    def __call__(self, ids: list[int], probs: list[float]) -> int:
        i = self.rng.choices(range(len(ids)), weights=probs)[0]
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

    with model.new_context() as root:
        if args.get("system"):
            root.system(args["system"])
        root.user(prompt)
        root.begin_assistant()
        await root.flush()

        async def candidate(i: int) -> dict:
            scorer = ScoringSampler(seed + i)
            with root.fork() as ctx:
                gen = ctx.generate(Sampler.custom(scorer, k=k), max_tokens=max_tokens)
                await gen.collect_text()
            lp = scorer.logprobs
            return {
                "text": gen.text,
                "tokens": gen.tokens,
                "logprobs": lp,
                "score": sum(lp) / len(lp),
                "finish_reason": gen.finish_reason,
            }

        cands = await asyncio.gather(*(candidate(i) for i in range(n)))
    best = max(range(n), key=lambda i: cands[i]["score"])
    for i, c in enumerate(cands):
        mark = "*" if i == best else " "
        session.send(f"{mark} [{i}] score {c['score']:.3f}: {c['text']}\n")
    b = cands[best]
    return {"text": b["text"], "tokens": b["tokens"], "score": b["score"], "best": best, "candidates": cands}
