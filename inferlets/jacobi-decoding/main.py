"""jacobi-decoding: greedy decoding as a parallel fixed-point iteration.

Jacobi decoding (Santilli et al., ACL 2023, "Accelerating Transformer
Inference for Translation via Parallel Decoding"; the basis of lookahead
decoding, Fu et al., 2024) treats the next ``window`` tokens as unknowns
``y_1..y_W`` of the system ``y_i = argmax p(. | prompt, y_<i)`` and solves
it by iteration: one forward pass feeds the last accepted token plus the
current guesses at their explicit positions and reads the greedy choice at
every position. The leading guesses that equal those choices are fixed
points and are accepted together with one more token; the KV of the rest is
rolled back with ``truncate`` and the new choices become the next guesses.
Every accepted token is the greedy token given the accepted prefix, so the
output equals plain greedy decoding token for token.

Args:
    prompt (str, required): the user message.
    system (str): optional system message.
    max_tokens (int, default 128).
    window (int, default 8): guesses refined per pass (1..64).

Returns ``{"text", "tokens", "finish_reason", "passes", "accepted_guesses",
"tokens_per_pass"}`` (``accepted_guesses``: tokens fixed beyond the one
token every pass yields anyway).
"""

from tartlet import Model, Sampler, forward, session


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("jacobi-decoding needs a non-empty string argument `prompt`")
    max_tokens = int(args.get("max_tokens", 128))
    window = int(args.get("window", 8))
    if not 1 <= window <= 64:
        raise ValueError(f"jacobi-decoding: window must be in 1..64, got {window}")
    model = Model.load(args.get("model"))
    eos = set(model.eos_token_ids)
    greedy = Sampler.greedy()

    out: list[int] = []
    passes = 0
    sent = 0  # characters streamed so far
    finish = "length"
    with model.new_context() as ctx:
        if args.get("system"):
            ctx.system(args["system"])
        ctx.user(prompt)
        ctx.begin_assistant()
        # Prefill all but the last prompt token; that one leads every pass.
        last = ctx.pending[-1]
        ctx.truncate(ctx.seq_len - 1)
        await ctx.flush()
        guess = [last] * window
        while len(out) < max_tokens:
            room = model.max_seq_len - ctx.kv_len - 1
            if room < 1:
                break
            guess = guess[: min(window, room, max_tokens - len(out))]
            start = ctx.kv_len
            inputs = [last] + guess
            picks = await ctx.forward(
                inputs,
                positions=list(range(start, start + len(inputs))),
                outputs=[forward.sample(i, greedy) for i in range(len(inputs))],
            )
            passes += 1
            m = 0  # guesses that are fixed points
            while m < len(guess) and guess[m] == picks[m]:
                m += 1
            accepted = picks[: m + 1]
            # keep the KV of `last` and the accepted guesses; drop the rest
            ctx.truncate(start + 1 + m)
            for tok in accepted:
                out.append(tok)
                if tok in eos:
                    finish = "eos"
                    break
                if len(out) == max_tokens:
                    break
            text = model.detokenize([t for t in out if t not in eos])
            if not text.endswith("\ufffd") and len(text) > sent:  # hold back split characters
                session.send(text[sent:])
                sent = len(text)
            if finish == "eos":
                break
            last = accepted[-1]
            guess = picks[m + 1 :]
            guess += [guess[-1] if guess else last] * (window - len(guess))
    text = model.detokenize([t for t in out if t not in eos])
    if len(text) > sent:
        session.send(text[sent:])
    return {
        "text": text,
        "tokens": out,
        "finish_reason": finish,
        "passes": passes,
        "accepted_guesses": len(out) - passes,
        "tokens_per_pass": len(out) / max(1, passes),
    }
