"""openai-responses: the inferlet behind ``POST /v1/responses``
(:mod:`tartlet.server.responses_api`).

Args:
    model (str): served model name.
    messages (list): the whole conversation in the chat shape (``system``,
        ``user``, ``assistant`` with ``tool_calls``, ``tool`` with
        ``tool_call_id``), as :mod:`tartlet.server.responses_protocol`
        converts Responses items.
    tools (list, optional), tool_choice ("auto" | "none" | "required" |
        {"name": str}): as for ``openai-completion``.
    snapshot (str, optional): a snapshot holding the rendering of the first
        ``snapshot_messages`` messages (with ``tools``), saved by an earlier
        turn, except its ``snapshot_pending`` token ids (list, optional):
        opened, those filled, and adopted (:meth:`Context.adopt_chat`), so
        only the later messages are prefilled. If it is gone or does not
        match, the conversation is filled from scratch.
    save (str, optional): save the conversation, this turn's reply
        included, under this snapshot name when done, without a model call
        (:meth:`Context.save` with ``pending=True``: the reply's last token
        and closing markup are returned as ``pending``, prefilled by the next
        turn with its new items); a failed save, e.g. over the snapshot
        quota, is reported as ``saved: false``.
    max_tokens (int), temperature (float, 0 = greedy), top_p (float),
    seed (int), response_format (chat shape, optional), ignore_eos (bool,
    default false; true: EOS does not end the turn, so the reply is exactly
    ``max_tokens`` long unless ``response_format`` completes first).

Streams one JSON object per ``session.send``, in the order generated:
``{"text": str}`` as content is generated, ``{"tool_call": {"index", "id",
"name"} | {"index", "arguments"}}`` for tool calls (id and name first, then
argument pieces as they are generated; forced or found in ``auto`` mode by
:class:`tartlet.tools.ToolCallStream`).

Returns ``{"text" (all content), "tool_calls": [{"id", "name", "arguments"}],
"finish_reason", "prompt_tokens" (every token before the first generated
one), "cached_tokens" (of those, held by the opened snapshot: not
computed), "completion_tokens", "saved" (bool), "pending" (token ids the
snapshot leaves out), "assistant" (the reply as a chat message)}``.
"""

import json

from tartlet import AnyJson, Context, JsonSchema, Model, Sampler, session
from tartlet.errors import SnapshotError
from tartlet.tools import ForcedToolCall, ToolCallStream, tool_format


def make_constraint(rf, model_name: str):
    if not rf or rf.get("type") == "text":
        return None
    if rf.get("type") == "json_object":
        return JsonSchema({"type": "object"}, model_name)
    schema = (rf.get("json_schema") or {}).get("schema")
    return AnyJson(model_name) if schema is None else JsonSchema(schema, model_name)


def open_conversation(model, args: dict, tools):
    """``(ctx, cached, start)``: a context holding the first ``start``
    messages (``cached`` of its tokens from the snapshot)."""
    name, k = args.get("snapshot"), int(args.get("snapshot_messages") or 0)
    if name and k:
        try:
            ctx = Context.open(model, name)
        except SnapshotError:
            ctx = None
        if ctx is not None:
            try:
                ctx.fill_tokens(args.get("snapshot_pending") or [])
                ctx.adopt_chat(args["messages"][:k], tools)
                return ctx, ctx.kv_len, k
            except ValueError:
                ctx.close()
    ctx = model.new_context()
    if tools:
        ctx.set_tools(tools)
    return ctx, 0, 0


async def main(args: dict) -> dict:
    model = Model.load(args.get("model"))
    choice = args.get("tool_choice", "auto") if args.get("tools") else "none"
    tools = args.get("tools") if choice != "none" else None
    sampler = Sampler(temperature=float(args.get("temperature", 0.0)), top_p=float(args.get("top_p", 1.0)), seed=args.get("seed"))
    max_tokens = int(args.get("max_tokens", 256))
    ctx, cached, start = open_conversation(model, args, tools)
    with ctx:
        for m in args["messages"][start:]:
            ctx.add_message(m)
        ctx.begin_assistant()
        prompt_tokens = ctx.seq_len
        calls = []
        if choice == "required" or isinstance(choice, dict):
            forced = ForcedToolCall(ctx, tools, name=choice["name"] if isinstance(choice, dict) else None,
                                    sampler=sampler, max_tokens=max_tokens)
            async for delta in forced:
                session.send(json.dumps({"tool_call": delta}))
            text, finish, generated = "", forced.finish_reason, len(forced.generator.tokens)
            if forced.call is not None:
                calls.append({"id": forced.call.id, "name": forced.call.name, "arguments": forced.call.arguments})
        else:
            constraint = make_constraint(args.get("response_format"), model.name)
            stream = ToolCallStream(tool_format(model)) if tools else None
            parts = []

            def send(events: list) -> None:
                """Content and tool-call deltas, in the order generated."""
                for e in events:
                    if "content" in e:
                        parts.append(e["content"])
                        session.send(json.dumps({"text": e["content"]}))
                    else:
                        session.send(json.dumps({"tool_call": e}))
            try:
                gen = ctx.generate(sampler, max_tokens=max_tokens, constraint=constraint, eos=not args.get("ignore_eos", False),
                                   overlap=True)  # the next pass runs while this step is sent, as on the chat route
                async for step in gen:
                    send(stream.feed(step.text) if stream is not None else [{"content": step.text}] if step.text else [])
            finally:
                if constraint is not None:
                    constraint.close()
            finish, generated = gen.finish_reason, len(gen.tokens)
            if stream is not None:
                send(stream.end())
                calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in stream.calls]
                if calls:  # cut inside a call's arguments: length (incomplete), as OpenAI
                    finish = "length" if stream.cut else "tool_calls"
            text = "".join(parts)
        assistant = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            assistant["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls
            ]
        saved, pending = False, []
        if args.get("save"):
            ctx.end_turn(assistant)  # the context is then the rendering of messages + reply: reopens with adopt_chat
            try:
                pending = ctx.save(args["save"], pending=True)  # no pass now: the next turn prefills these with its items
                saved = True
            except (SnapshotError, ValueError) as e:  # over the snapshot quota, ...
                print(f"openai-responses: snapshot {args['save']!r} not saved: {e}")
        return {"text": text, "tool_calls": calls, "finish_reason": finish, "prompt_tokens": prompt_tokens,
                "cached_tokens": cached, "completion_tokens": generated, "saved": saved, "pending": pending,
                "assistant": assistant}
