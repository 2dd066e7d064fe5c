"""chat: a multi-turn conversation on one context.

Each user turn is appended to the same context, so the KV cache of earlier
turns is reused: a turn costs the prefill of its own tokens only. Replies
stream to the client as they are generated.

Args:
    turns (list[str]): user messages, answered in order.
    interactive (bool): after ``turns``, keep reading user messages from the
        client session (``session.receive()``) until it closes or sends an
        empty line or ``/exit``.
    system (str): optional system message.
    max_tokens (int, default 256): per reply.
    temperature (float, default 0 = greedy), top_p (float), top_k (int),
    seed (int): sampler.

Returns ``{"replies": [str], "tokens": [[int]], "finish_reasons": [str],
"context_tokens": int}`` (``context_tokens``: tokens in the context at the
end, every turn included).
"""

from tartlet import Model, Sampler, session


async def main(args: dict) -> dict:
    turns = args.get("turns", [])
    if isinstance(turns, str):
        turns = [turns]
    if not isinstance(turns, list) or not all(isinstance(t, str) and t for t in turns):
        raise ValueError("chat: `turns` must be a list of non-empty strings")
    interactive = bool(args.get("interactive", False))
    if not turns and not interactive:
        raise ValueError("chat needs `turns` (a list of user messages) or `interactive: true`")
    max_tokens = int(args.get("max_tokens", 256))
    seed = args.get("seed")
    model = Model.load(args.get("model"))
    replies: list[str] = []
    tokens: list[list[int]] = []
    reasons: list[str] = []

    with model.new_context() as ctx:
        if args.get("system"):
            ctx.system(args["system"])

        async def answer(text: str, turn: int) -> None:
            ctx.user(text)
            sampler = Sampler(
                temperature=float(args.get("temperature", 0.0)),
                top_p=float(args.get("top_p", 1.0)),
                top_k=args.get("top_k"),
                seed=None if seed is None else int(seed) + turn,
            )
            gen = ctx.generate(sampler, max_tokens=max_tokens)
            async for step in gen:
                if step.text:
                    session.send(step.text)
            session.send("\n")
            replies.append(gen.text)
            tokens.append(gen.tokens)
            reasons.append(gen.finish_reason or "")

        for i, t in enumerate(turns):
            await answer(t, i)
        if interactive:
            while True:
                try:
                    msg = await session.receive()
                except EOFError:
                    break
                if not msg.strip() or msg.strip() == "/exit":
                    break
                await answer(msg, len(replies))
        return {"replies": replies, "tokens": tokens, "finish_reasons": reasons, "context_tokens": ctx.seq_len}
