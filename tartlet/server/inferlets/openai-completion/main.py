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
    response_format (dict, optional): OpenAI shape, as validated by the
        server: ``{"type": "json_object"}`` (output is a JSON object) or
        ``{"type": "json_schema", "json_schema": {"name", "schema",
        "strict"}}`` (output is JSON valid against ``schema``; no schema:
        any JSON value); ``{"type": "text"}`` or absent: unconstrained.
        Applied with :mod:`tartlet.constraint` (``ctx.generate(...,
        constraint=...)``); compact JSON, generation ends when the value is
        complete (finish_reason ``"constraint"``).

Streams the text with ``session.send``; returns ``{"text", "finish_reason",
"prompt_tokens", "completion_tokens"}``.

Raises:
    ValueError: an unknown response_format type, or an invalid schema (the
        grammar engine's message), before anything is generated.
"""

from tartlet import AnyJson, JsonSchema, Model, Sampler, session


def make_constraint(rf, model: str):
    """The constraint for an OpenAI ``response_format`` (None: none)."""
    if not rf or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return JsonSchema({"type": "object"}, model)
    if rf.get("type") == "json_schema":
        schema = (rf.get("json_schema") or {}).get("schema")
        return AnyJson(model) if schema is None else JsonSchema(schema, model)
    raise ValueError(f"response_format type {rf.get('type')!r} is not supported (text, json_object, json_schema)")


async def main(args: dict) -> dict:
    model = Model.load(args.get("model"))
    sampler = Sampler(
        temperature=float(args.get("temperature", 0.0)),
        top_p=float(args.get("top_p", 1.0)),
        seed=args.get("seed"),
    )
    constraint = make_constraint(args.get("response_format"), model.name)
    try:
        with model.new_context() as ctx:
            if "messages" in args:
                for m in args["messages"]:
                    getattr(ctx, m["role"])(m["content"])
            else:
                ctx.fill(args["prompt"])
            prompt_tokens = ctx.seq_len
            gen = ctx.generate(
                sampler, max_tokens=int(args.get("max_tokens", 256)), stop=args.get("stop") or None, constraint=constraint,
                eos=not args.get("ignore_eos", False),
            )
            async for step in gen:
                if step.text:
                    session.send(step.text)
            return {
                "text": gen.text,
                "finish_reason": gen.finish_reason,
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(gen.tokens),
            }
    finally:
        if constraint is not None:
            constraint.close()
