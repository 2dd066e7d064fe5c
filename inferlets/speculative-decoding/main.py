"""speculative-decoding: greedy generation with an n-gram drafter.

:class:`tartlet.drafter.NgramDrafter` (prompt lookup decoding) guesses the
next tokens by finding the context's last n-gram earlier in the context. Each
step sends the pending token plus the guesses with their positions, samples
at every position in one forward pass, keeps the guesses that match and
rolls back the rest with ``truncate`` (see :mod:`tartlet.generator`). With
greedy sampling the output is token for token the output of plain greedy
decoding; only the number of forward passes shrinks. Tasks that copy from
the prompt (rewriting code, quoting) accept the most guesses.

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    max_tokens (int, default 256).
    max_draft (int, default 8), max_ngram (int, default 3), min_ngram
        (int, default 1): drafter settings.
    compare (bool, default false): also run plain greedy decoding on a
        second context and report both.

Returns ``{"text", "tokens", "finish_reason", "passes", "drafted",
"accepted", "acceptance_rate", "tokens_per_pass", "seconds"}`` and, with
``compare``, ``"baseline": {"tokens", "passes", "seconds"}``,
``"identical": bool`` and ``"speedup"`` (baseline seconds / speculative
seconds; wall time on a shared engine is only indicative, ``passes`` is the
exact measure).
"""

import time

from tartlet import Model, session
from tartlet.drafter import NgramDrafter


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("speculative-decoding needs a non-empty string argument `prompt`")
    max_tokens = int(args.get("max_tokens", 256))
    drafter = NgramDrafter(
        max_draft=int(args.get("max_draft", 8)),
        max_ngram=int(args.get("max_ngram", 3)),
        min_ngram=int(args.get("min_ngram", 1)),
    )
    model = Model.load(args.get("model"))

    def new_ctx():
        ctx = model.new_context()
        if args.get("system"):
            ctx.system(args["system"])
        ctx.user(prompt)
        return ctx

    with new_ctx() as ctx:
        t0 = time.perf_counter()
        gen = ctx.generate(max_tokens=max_tokens, drafter=drafter)
        async for step in gen:
            if step.text:
                session.send(step.text)
        seconds = time.perf_counter() - t0
    st = gen.stats
    out = {
        "text": gen.text,
        "tokens": gen.tokens,
        "finish_reason": gen.finish_reason,
        "passes": st.steps,
        "drafted": st.drafted,
        "accepted": st.accepted,
        "acceptance_rate": st.acceptance_rate,
        "tokens_per_pass": len(gen.tokens) / max(1, st.steps),
        "seconds": seconds,
    }
    session.send(
        f"\n[{len(gen.tokens)} tokens in {st.steps} passes; accepted {st.accepted}/{st.drafted} drafted tokens "
        f"({st.acceptance_rate:.0%})]\n"
    )
    if args.get("compare"):
        with new_ctx() as ctx:
            t0 = time.perf_counter()
            base = ctx.generate(max_tokens=max_tokens)
            await base.collect_tokens()
            b_seconds = time.perf_counter() - t0
        out["baseline"] = {"tokens": base.tokens, "passes": base.stats.steps, "seconds": b_seconds}
        out["identical"] = base.tokens == gen.tokens
        out["speedup"] = b_seconds / seconds if seconds > 0 else 0.0
        session.send(f"[plain greedy: {base.stats.steps} passes; identical: {out['identical']}; speedup {out['speedup']:.2f}x]\n")
    return out
