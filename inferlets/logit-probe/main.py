"""logit-probe: look at the model's next-token distribution, and classify.

One forward pass over the prompt carries three probes on its last token:
the top-``k`` distribution (:func:`tartlet.forward.distribution`), the
entropy in nats (:func:`tartlet.forward.entropy`) and the log-probabilities
of the first token of every choice (:func:`tartlet.forward.logprobs`). A
choice longer than one token gets one more pass, on a fork, that reads the
log-probabilities of its remaining tokens (teacher forcing). The choice with
the highest total log-probability is the label, which makes the inferlet a
zero-shot classifier ("yes"/"no" by default).

Args:
    prompt (str, required): the user message (ask for the answer format).
    system (str): optional system message.
    choices (list[str], default ["Yes", "No"]): candidate answers, as the
        assistant reply would start.
    k (int, default 10): size of the reported top-k distribution.

Returns ``{"label": str, "choices": {choice: logprob}, "probs": {choice:
normalised probability among the choices}, "entropy": float,
"top": [{"token": int, "text": str, "prob": float}]}``.
"""

import asyncio
import math

from tartlet import Model, forward, session


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("logit-probe needs a non-empty string argument `prompt`")
    choices = args.get("choices", ["Yes", "No"])
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("logit-probe: `choices` must be a non-empty list of non-empty strings")
    k = int(args.get("k", 10))
    model = Model.load(args.get("model"))
    choice_ids = [model.tokenize(c) for c in choices]

    with model.new_context() as ctx:
        if args.get("system"):
            ctx.system(args["system"])
        ctx.user(prompt)
        ctx.begin_assistant()
        last = len(ctx.pending) - 1
        firsts = [ids[0] for ids in choice_ids]
        (ids, probs), ent, first_lp = await ctx.forward(
            outputs=[forward.distribution(last, k=k), forward.entropy(last), forward.logprobs(last, firsts)]
        )

        async def rest(ids: list[int]) -> float:
            """log P(ids[1:] | prompt, ids[0]) from one pass on a fork."""
            if len(ids) == 1:
                return 0.0
            with ctx.fork() as f:
                lps = await f.forward(ids[:-1], outputs=[forward.logprobs(j, [ids[j + 1]]) for j in range(len(ids) - 1)])
            return sum(lp[0] for lp in lps)

        tails = await asyncio.gather(*(rest(c) for c in choice_ids))
    scores = {c: first_lp[i] + tails[i] for i, c in enumerate(choices)}
    m = max(scores.values())
    z = sum(math.exp(s - m) for s in scores.values())
    norm = {c: math.exp(s - m) / z for c, s in scores.items()}
    label = max(scores, key=scores.get)
    top = [{"token": t, "text": model.detokenize([t]), "prob": p} for t, p in zip(ids, probs)]
    lines = [f"top-{k} next tokens (entropy {ent:.3f} nats):"]
    lines += [f"  {e['prob']:.4f}  {e['text']!r}" for e in top]
    lines += [f"log P({c!r}) = {s:.3f}  (p among choices {norm[c]:.3f})" for c, s in scores.items()]
    lines.append(f"label: {label}")
    session.send("\n".join(lines) + "\n")
    return {"label": label, "choices": scores, "probs": norm, "entropy": ent, "top": top}
