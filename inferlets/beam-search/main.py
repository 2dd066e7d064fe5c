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

Constrained mode: with one of ``json_schema``, ``regex`` or ``grammar``
every beam carries its own grammar matcher (docs/constrained-decoding.md).
A beam's probe names its matcher in the output slot (``{"grammar":
handle}``), so the host masks the logits with that beam's state before the
softmax: the probe's probabilities, and so ``logprob``, are those of the
constrained distribution (renormalised over the allowed tokens). A child
beam forks its parent's matcher and advances it with the chosen token; when
the grammar is complete (only end-of-sequence may follow) the hypothesis is
finished, like one that picked end-of-sequence (allowed only where the
output is a complete match). Finished hypotheses then rank above unfinished
ones, whose text is a prefix of a valid output only.

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    k (int, default 3): beam width (1..16).
    max_tokens (int, default 32).
    length_penalty (float, default 1.0).
    json_schema (dict or JSON text): constrain every beam to one JSON value
        valid against this JSON Schema (:class:`tartlet.JsonSchema`).
    regex (str): constrain every beam to a full match of this regex
        (:class:`tartlet.Regex`, Rust ``regex`` syntax).
    grammar (str): constrain every beam to a sentence of this Lark or GBNF
        grammar (:class:`tartlet.Grammar`).
    At most one of ``json_schema``, ``regex``, ``grammar`` (ValueError
    otherwise; an invalid spec raises the grammar engine's ValueError before
    anything is prefilled).

Returns ``{"text", "tokens", "score", "logprob", "beams": [{"text",
"tokens", "logprob", "score", "finished"}], "steps": int}``, beams best
first; ``logprob`` is the natural-log probability of the tokens (the final
end-of-sequence token included when finished), ``score`` the normalised one.
With ``json_schema`` the result and each beam also carry ``"json"``: the
parsed value, or None for an unfinished beam.
"""

import asyncio
import dataclasses
import json
import math

from tartlet import Model, forward, session
from tartlet.constraint import constraint_from_args, slot_fields


def make_constraint(args: dict, model_name: str):
    """The ``json_schema`` / ``regex`` / ``grammar`` constraint of ``args`` (or None)."""
    return constraint_from_args(args, model_name, "beam-search")


class Beam:
    """One hypothesis: its context (None once finished), tokens, total
    log-probability and grammar matcher (None when unconstrained or finished)."""

    def __init__(self, ctx, tokens: list[int], logprob: float, matcher=None) -> None:
        self.ctx = ctx
        self.tokens = tokens
        self.logprob = logprob
        self.matcher = matcher

    def close(self) -> None:
        if self.ctx is not None:
            self.ctx.close()
        if self.matcher is not None:
            self.matcher.close()


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
    constraint = make_constraint(args, model.name)
    constrained = constraint is not None

    root = model.new_context()
    if args.get("system"):
        root.system(args["system"])
    root.user(prompt)
    root.begin_assistant()
    beams = [Beam(root, [], 0.0, constraint)]
    finished: list[Beam] = []
    steps = 0
    try:
        while beams and len(finished) < k and steps < max_tokens:
            steps += 1

            def probe(b: Beam) -> forward.OutputSlot:
                slot = forward.distribution(len(b.ctx.pending) - 1, k=2 * k)
                if b.matcher is not None:  # the host masks with this beam's state
                    slot = dataclasses.replace(slot, **slot_fields(b.matcher))
                return slot

            probes = await asyncio.gather(*(b.ctx.forward(outputs=[probe(b)]) for b in beams))
            cands = []
            for b, (dist,) in zip(beams, probes):
                for tok, p in zip(*dist):
                    if p > 0:
                        cands.append((b.logprob + math.log(p), b, tok))
            cands.sort(key=lambda c: -c[0])
            nxt: list[Beam] = []
            try:
                for rank, (lp, parent, tok) in enumerate(cands):
                    if len(nxt) == k:
                        break
                    if tok in eos:
                        if rank < k:  # only an eos among the k best counts
                            finished.append(Beam(None, parent.tokens + [tok], lp))
                        continue
                    matcher = None
                    if parent.matcher is not None:
                        matcher = parent.matcher.fork()
                        matcher.advance(tok)  # allowed: the probe was masked with this state
                        if matcher.is_finished():
                            matcher.close()
                            if rank < k:  # the grammar is complete: finished like an eos
                                finished.append(Beam(None, parent.tokens + [tok], lp))
                            continue
                    child = parent.ctx.fork()
                    child.fill_tokens([tok])
                    nxt.append(Beam(child, parent.tokens + [tok], lp, matcher))
            except BaseException:
                for b in nxt:  # children built so far
                    b.close()
                raise
            for b in beams:
                b.close()
            beams = nxt
        hyps = [(b, True) for b in finished] + [(b, False) for b in beams]

        def score(b: Beam) -> float:
            return b.logprob / (max(1, len(b.tokens)) ** alpha)

        # under a constraint an unfinished beam is not a valid output: rank it last
        hyps.sort(key=lambda h: (constrained and not h[1], -score(h[0])))
        out = []
        for b, done in hyps:
            shown = [t for t in b.tokens if t not in eos]
            h = {"text": model.detokenize(shown), "tokens": b.tokens, "logprob": b.logprob, "score": score(b), "finished": done}
            if args.get("json_schema") is not None:
                h["json"] = json.loads(h["text"]) if done else None
            out.append(h)
    finally:
        for b in beams:
            b.close()
        root.close()
        if constraint is not None:
            constraint.close()
    for i, h in enumerate(out):
        session.send(f"[{i}] {h['score']:.3f} ({h['logprob']:.2f}): {h['text']}\n")
    best = out[0]
    res = {"text": best["text"], "tokens": best["tokens"], "score": best["score"], "logprob": best["logprob"], "beams": out, "steps": steps}
    if "json" in best:
        res["json"] = best["json"]
    return res

