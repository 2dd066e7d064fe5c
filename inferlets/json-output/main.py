"""json-output: answer a question as JSON matching a JSON Schema.

Every sampled token is masked by the schema's grammar (llguidance on the
host), so the answer always parses and validates unless generation hits
``max_tokens`` first (then ``finish_reason`` is ``"length"`` and ``json``
is None).

Args:
    prompt (str, required): what to answer (alias: ``question``).
    schema (dict or JSON text): the JSON Schema of the answer (default: any
        JSON value).
    system (str): system message (default: asks for JSON only and shows the
        schema).
    max_tokens (int, default 256), temperature (float, default 0 = greedy),
    top_p (float, default 1), top_k (int), seed (int), model (str),
    stream (bool, default false): send the text to the session as it grows.

Returns ``{"json", "text", "tokens", "finish_reason"}``.
"""

import json

from tartlet import AnyJson, JsonSchema, Model, Sampler, session


async def main(args: dict) -> dict:
    question = args.get("prompt", args.get("question"))
    if not isinstance(question, str) or not question:
        raise ValueError("json-output needs a non-empty string argument `prompt` (or its alias `question`)")
    schema = args.get("schema")
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"argument `schema` is not valid JSON: {e}") from None
    model = Model.load(args.get("model"))
    constraint = AnyJson(model.name) if schema is None else JsonSchema(schema, model.name)
    sampler = Sampler(
        temperature=float(args.get("temperature", 0.0)),
        top_p=float(args.get("top_p", 1.0)),
        top_k=args.get("top_k"),
        seed=args.get("seed"),
    )
    system = args.get("system")
    if system is None:
        system = "You are a helpful assistant. Reply with JSON only."
        if schema is not None:
            system += " The JSON must follow this JSON Schema: " + json.dumps(schema, separators=(",", ":"))
    with model.new_context() as ctx, constraint:
        ctx.system(system)
        ctx.user(question)
        gen = ctx.generate(sampler, max_tokens=int(args.get("max_tokens", 256)), constraint=constraint)
        async for step in gen:
            if step.text and args.get("stream"):
                session.send(step.text)
        value = json.loads(gen.text) if gen.finish_reason in ("constraint", "eos") else None
        return {"json": value, "text": gen.text, "tokens": gen.tokens, "finish_reason": gen.finish_reason}
