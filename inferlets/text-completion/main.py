"""text-completion: answer one prompt, streaming the text.

Args:
    prompt (str, required): the user message (or raw text with ``raw``).
    system (str): optional system message.
    raw (bool): fill ``prompt`` as is, without the chat template (always
        so for a model without one, e.g. a base model like Gemma-3-270M).
    max_tokens (int, default 256), temperature (float, default 0 = greedy),
    top_p (float, default 1), top_k (int), seed (int), model (str),
    stop (str or list of str): stop strings,
    ignore_eos (bool): keep generating past end-of-sequence tokens (for
    benchmarks that need a fixed number of tokens).

Speculative decoding: when the server configured it for the model
(``[[models]] speculative``), greedy and seeded generations use its drafter
(:func:`tartlet.drafter.served_drafter`): the same tokens, fewer passes
when the output copies the prompt; drafting stops for the rest of the
generation when acceptance is low or the engine is busy, and the text then
streams as without it.

Returns ``{"text", "tokens", "finish_reason"}``, and ``"speculative":
{"passes", "drafted", "accepted", "stopped"}`` when speculation was used.
"""

from tartlet import Model, Sampler, session
from tartlet.drafter import served_drafter


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("text-completion needs a non-empty string argument `prompt` (--prompt \"...\")")
    model = Model.load(args.get("model"))
    sampler = Sampler(
        temperature=float(args.get("temperature", 0.0)),
        top_p=float(args.get("top_p", 1.0)),
        top_k=args.get("top_k"),
        seed=args.get("seed"),
    )
    with model.new_context() as ctx:
        if args.get("raw") or not model.has_chat_template:
            ctx.fill(prompt)
        else:
            if args.get("system"):
                ctx.system(args["system"])
            ctx.user(prompt)
        drafter = served_drafter(model, sampler)
        gen = ctx.generate(
            sampler,
            max_tokens=int(args.get("max_tokens", 256)),
            stop=args.get("stop"),
            eos=not args.get("ignore_eos", False),
            # a host token stream: the passes run on while a step is streamed;
            # a step takes the next 1, 2, 4, then 8 tokens (the first at once),
            # so this code runs once per chunk (stop strings are checked here)
            chunk=8,
            overlap=True,
            drafter=drafter,  # None unless the server speculates; the stream above once it stops drafting
        )
        async for step in gen:
            if step.text:
                session.send(step.text)
        out = {"text": gen.text, "tokens": gen.tokens, "finish_reason": gen.finish_reason}
        if drafter is not None:
            out["speculative"] = {"passes": drafter.passes, "drafted": gen.stats.drafted, "accepted": gen.stats.accepted,
                                  "stopped": drafter.stopped}
        return out
