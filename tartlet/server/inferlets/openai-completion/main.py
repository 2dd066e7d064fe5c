"""openai-completion: the inferlet behind ``/v1/chat/completions`` and
``/v1/completions``.

Args:
    messages (list of {role, content}): chat mode, rendered with the model's
        chat template exactly as ``text-completion`` renders its
        ``system``/``prompt`` (one SDK call per message).
    prompt (str): completion mode, filled as raw text (``text-completion
        --raw``).
    max_tokens (int), temperature (float, 0 = greedy), top_p (float),
    seed (int), stop (list of str), model (str).

Streams the text with ``session.send``; returns ``{"text", "finish_reason",
"prompt_tokens", "completion_tokens"}``.
"""

from tartlet import Model, Sampler, session


async def main(args: dict) -> dict:
    model = Model.load(args.get("model"))
    sampler = Sampler(
        temperature=float(args.get("temperature", 0.0)),
        top_p=float(args.get("top_p", 1.0)),
        seed=args.get("seed"),
    )
    with model.new_context() as ctx:
        if "messages" in args:
            for m in args["messages"]:
                getattr(ctx, m["role"])(m["content"])
        else:
            ctx.fill(args["prompt"])
        prompt_tokens = ctx.seq_len
        gen = ctx.generate(sampler, max_tokens=int(args.get("max_tokens", 256)), stop=args.get("stop") or None)
        async for step in gen:
            if step.text:
                session.send(step.text)
        return {
            "text": gen.text,
            "finish_reason": gen.finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(gen.tokens),
        }
