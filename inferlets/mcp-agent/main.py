"""mcp-agent: answer a prompt with the tools of an MCP server.

The agent opens a session with an MCP server (``tartlet.mcp``: Streamable
HTTP through the host's HTTP call, so it runs natively and sandboxed),
lists its tools and puts them in the system message. Each round is one
assistant turn: a short free-text thought, then ``<tool_call>`` and a JSON
call ``{"name": ..., "arguments": {...}}`` generated under a JSON Schema
built from the tools (one ``anyOf`` branch per tool, ``arguments``
constrained by the tool's ``inputSchema``, extra keys refused), so even a
tiny model always produces a call that parses, names a real tool and has
schema-valid arguments. The call goes to the server (``tools/call``), its
result text is fed back as the next user message, and after the last round
the model answers. With ``max_calls`` > 1, rounds after the first may pick
``{"name": "final_answer"}`` instead: that turn is cut off the context
(``truncate``) and the model answers at once.

Args:
    prompt (str, required): the user's question.
    server (str): a configured MCP server name (``[mcp.servers.NAME]`` in
        the server config) or an endpoint URL on the HTTP allowlist;
        default: the only configured server.
    tools (list of str): use only these tools (default: all).
    max_calls (int, default 1): most tool calls, one per round.
    system (str): extra system instructions, put before the tool list.
    think_tokens (int, default 24): the thought before each call (0: none).
    call_tokens (int, default 96): the JSON call.
    max_tokens (int, default 128): the answer.
    max_result_chars (int, default 2000): a tool result is cut to this.
    temperature (float, default 0), seed (int), model (str).

Returns ``{"server", "tools", "calls": [{"thought", "name", "arguments",
"result", "is_error"}], "answer", "finish_reason", "transcript"}``
(``transcript``: the context's text at the end).
"""

import json

from tartlet import JsonSchema, Model, Sampler, mcp, session

FINAL = "final_answer"


def _strict(schema):
    """An object schema without ``additionalProperties`` gets ``false``, so
    the model cannot add keys the tool does not take."""
    schema = dict(schema) if isinstance(schema, dict) else {"type": "object"}
    if schema.get("type") == "object" and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def call_schema(tools, allow_final):
    """JSON Schema of one call to any of ``tools`` (``mcp.Tool``), or of
    ``{"name": "final_answer", "arguments": {}}`` when ``allow_final``."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": _strict(t.input_schema)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    if allow_final:
        branches.append({
            "type": "object",
            "properties": {"name": {"const": FINAL}, "arguments": {"type": "object", "properties": {}, "additionalProperties": False}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _int(args, key, default, lo):
    v = args.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"argument `{key}` must be an int >= {lo}, got {v!r}")
    return v


def _server(args):
    name = args.get("server")
    if name is None:
        servers = mcp.available_servers()
        if len(servers) != 1:
            listed = ", ".join(sorted(servers)) or "none"
            raise ValueError(f"mcp-agent needs argument `server` (configured MCP servers: {listed})")
        name = next(iter(servers))
    if not isinstance(name, str) or not name:
        raise ValueError(f"argument `server` must be a server name or URL, got {name!r}")
    return name


async def main(args: dict) -> dict:
    prompt = args.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("mcp-agent needs a non-empty string argument `prompt`")
    max_calls = _int(args, "max_calls", 1, 1)
    think_tokens = _int(args, "think_tokens", 24, 0)
    call_tokens = _int(args, "call_tokens", 96, 1)
    max_tokens = _int(args, "max_tokens", 128, 1)
    max_chars = _int(args, "max_result_chars", 2000, 1)
    wanted = args.get("tools")
    if wanted is not None and (not isinstance(wanted, list) or not all(isinstance(t, str) for t in wanted)):
        raise ValueError("argument `tools` must be a list of tool names")
    model = Model.load(args.get("model"))
    sampler = Sampler(temperature=float(args.get("temperature", 0.0)), seed=args.get("seed"))

    async with await mcp.connect(_server(args)) as server:
        tools = await server.list_tools()
        if wanted is not None:
            missing = sorted(set(wanted) - {t.name for t in tools})
            if missing:
                raise ValueError(f"MCP server {server.name!r} has no tool(s) {', '.join(missing)} (it has: {', '.join(t.name for t in tools)})")
            tools = [t for t in tools if t.name in wanted]
        if not tools:
            raise ValueError(f"MCP server {server.name!r} offers no tools")
        listing = "\n".join(json.dumps(t.to_function()) for t in tools)
        system = (args.get("system", "") + "\n").lstrip() + (
            "You can call these tools:\n" + listing + "\nThink in one short sentence, then call a tool as "
            '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
        )
        if max_calls > 1:
            system += f' When you have what you need, call {FINAL} with {{}} as arguments.'
        messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
        rendered = model.apply_chat_template(messages, add_generation_prompt=True)
        calls = []
        with model.new_context() as ctx:
            ctx.fill(rendered)
            for n in range(max_calls):
                turn_start = ctx.seq_len  # just after the assistant header
                thought = ""
                if think_tokens:
                    think = ctx.generate(sampler, max_tokens=think_tokens, stop=["\n", "<tool_call>"])
                    thought = (await think.collect_text()).strip()
                    if think.finish_reason == "eos":  # keep the turn open: drop the end-of-turn token
                        ctx.truncate(ctx.seq_len - 1)
                ctx.fill("\n<tool_call>" if think_tokens else "<tool_call>")
                with JsonSchema(call_schema(tools, allow_final=n > 0), model.name) as constraint:
                    gen = ctx.generate(sampler, max_tokens=call_tokens, constraint=constraint)
                    call_text = await gen.collect_text()
                if gen.finish_reason != "constraint":
                    raise ValueError(f"the tool call did not complete within call_tokens ({gen.finish_reason}): {call_text!r}")
                call = json.loads(call_text)
                if call["name"] == FINAL:  # answer now: this turn leaves the context
                    ctx.truncate(turn_start)
                    break
                ctx.fill("</tool_call>")
                content = f"{thought}\n<tool_call>{call_text}</tool_call>" if think_tokens else f"<tool_call>{call_text}</tool_call>"
                session.send(content + "\n")
                result = await server.call_tool(call["name"], call["arguments"])
                text = result.text[:max_chars]
                calls.append({"thought": thought, "name": call["name"], "arguments": call["arguments"], "result": text, "is_error": result.is_error})
                last = n == max_calls - 1
                status = "failed" if result.is_error else "returned"
                messages.append({"role": "assistant", "content": content})
                messages.append({"role": "user", "content": f"Tool {call['name']} {status}: {text}" + ("\nNow answer my question." if last else "")})
                full = model.apply_chat_template(messages, add_generation_prompt=True)
                if not full.startswith(rendered + content):
                    raise ValueError("the model's chat template rewrites earlier turns; mcp-agent needs an append-only template")
                ctx.fill(full[len(rendered) + len(content):])
                rendered = full
            answer = ctx.generate(sampler, max_tokens=max_tokens)
            async for step in answer:
                if step.text:
                    session.send(step.text)
            transcript = ctx.text
    return {
        "server": server.name, "tools": [t.name for t in tools], "calls": calls,
        "answer": answer.text, "finish_reason": answer.finish_reason, "transcript": transcript,
    }
