"""beam-search: keep the k most likely partial answers at every step.

Each beam is a context whose last token is pending. A step runs one forward
pass per beam (concurrently, so the engine batches them) with a top-``2k``
distribution probe (:func:`tartlet.forward.distribution`); the ``k`` best
extensions by total log-probability become the next beams, each a
``fork()`` of its parent plus the new token, so beams share the KV pages of
their common prefix. A candidate ending in an end-of-sequence token is set
aside as finished. The search stops when ``k`` hypotheses have finished, or
after ``max_tokens`` steps.

The final ranking divides each hypothesis' log-probability by
``len ** length_penalty`` (Wu et al., 2016, GNMT, without their constant);
``length_penalty = 0`` ranks by total log-probability. With ``k = 1`` the
result is exactly greedy decoding.

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    k (int, default 3): beam width (1..16).
    max_tokens (int, default 32).
    length_penalty (float, default 1.0).

Returns ``{"text", "tokens", "score", "logprob", "beams": [{"text",
"tokens", "logprob", "score", "finished"}], "steps": int}``, beams best
first; ``logprob`` is the natural-log probability of the tokens (the final
end-of-sequence token included when finished), ``score`` the normalised one.
"""

import asyncio
import math

from tartlet import Model, forward, session


class Beam:
    def __init__(self, ctx, tokens: list[int], logprob: float) -> None:
        self.ctx = ctx
        self.tokens = tokens
        self.logprob = logprob


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("beam-search needs a non-empty string argument `prompt`")
    k = int(args.get("k", 3))
    if not 1 <= k <= 16:
        raise ValueError(f"beam-search: k must be in 1..16, got {k}")
    max_tokens = int(args.get("max_tokens", 32))
    alpha = float(args.get("length_penalty", 1.0))
    model = Model.load(args.get("model"))
    eos = set(model.eos_token_ids)

    root = model.new_context()
    if args.get("system"):
        root.system(args["system"])
    root.user(prompt)
    root.begin_assistant()
    beams = [Beam(root, [], 0.0)]
    finished: list[Beam] = []
    steps = 0
    try:
        while beams and len(finished) < k and steps < max_tokens:
            steps += 1
            probes = await asyncio.gather(
                *(b.ctx.forward(outputs=[forward.distribution(len(b.ctx.pending) - 1, k=2 * k)]) for b in beams)
            )
            cands = []
            for b, (dist,) in zip(beams, probes):
                for tok, p in zip(*dist):
                    if p > 0:
                        cands.append((b.logprob + math.log(p), b, tok))
            cands.sort(key=lambda c: -c[0])
            nxt: list[Beam] = []
            for rank, (lp, parent, tok) in enumerate(cands):
                if len(nxt) == k:
                    break
                if tok in eos:
                    if rank < k:  # only an eos among the k best counts
                        finished.append(Beam(None, parent.tokens + [tok], lp))
                    continue
                child = parent.ctx.fork()
                child.fill_tokens([tok])
                nxt.append(Beam(child, parent.tokens + [tok], lp))
            for b in beams:
                b.ctx.close()
            beams = nxt
        hyps = [(b, True) for b in finished] + [(b, False) for b in beams]

        def score(b: Beam) -> float:
            return b.logprob / (max(1, len(b.tokens)) ** alpha)

        hyps.sort(key=lambda h: -score(h[0]))
        out = []
        for b, done in hyps:
            shown = [t for t in b.tokens if t not in eos]
            out.append({"text": model.detokenize(shown), "tokens": b.tokens, "logprob": b.logprob, "score": score(b), "finished": done})
    finally:
        for b in beams:
            b.ctx.close()
        root.close()
    for i, h in enumerate(out):
        session.send(f"[{i}] {h['score']:.3f} ({h['logprob']:.2f}): {h['text']}\n")
    best = out[0]
    return {"text": best["text"], "tokens": best["tokens"], "score": best["score"], "logprob": best["logprob"], "beams": out, "steps": steps}
