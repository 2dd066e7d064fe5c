"""tool-call: think, call a tool (constrained JSON), read its result, answer.

One assistant turn has two parts: free text (up to ``think_tokens``, ending
at a newline or ``<tool_call>``), then ``<tool_call>`` and a JSON call
``{"name": ..., "arguments": {...}}`` generated under a JSON Schema built
from the tools (one ``anyOf`` branch per tool, ``arguments`` constrained by
the tool's ``parameters``), so the call always parses and names a real tool
with valid arguments. The tool runs, its result is appended as the next
message, and the model answers.

Built-in tools: ``calculator`` (arithmetic on numbers with ``+ - * / // %
**`` and parentheses) and ``word_count``. Other tools given in ``tools`` are
run by the client: the inferlet sends ``{"tool_call": {"name", "arguments"}}``
as JSON on the session and waits for the result message.

Args:
    prompt (str, required): the user's question (alias: ``question``).
    tools (list): OpenAI-style function specs ``{"name", "description",
        "parameters"}`` (default: the built-ins). A spec with only a
        ``name`` of a built-in tool uses the built-in.
    system (str): system message (default: lists the tools).
    think_tokens (int, default 32), call_tokens (int, default 64),
    max_tokens (int, default 128; the answer), temperature (float,
    default 0), seed (int), model (str).

Returns ``{"thought", "call", "result", "answer", "finish_reason"}``.
"""

import ast
import json
import operator

from tartlet import JsonSchema, Model, Sampler, session

CALCULATOR = {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression, e.g. 12 * (3 + 4).",
    "parameters": {
        "type": "object",
        "properties": {"expression": {"type": "string", "pattern": "^[0-9+\\-*/%(). ]{1,40}$"}},
        "required": ["expression"],
        "additionalProperties": False,
    },
}
WORD_COUNT = {
    "name": "word_count",
    "description": "Count the words of a text.",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string", "maxLength": 200}},
        "required": ["text"],
        "additionalProperties": False,
    },
}
BUILTINS = {"calculator": CALCULATOR, "word_count": WORD_COUNT}

_OPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculate(expression: str) -> str:
    """Value of an arithmetic expression as text (``error: ...`` when it
    cannot be evaluated); exponents are limited to 100."""

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(b) > 100:
                raise ValueError("exponent too large")
            return _OPS[type(node.op)](a, b)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        return str(ev(ast.parse(expression.strip(), mode="eval")))
    except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as e:
        return f"error: {e}"


def call_schema(tools: list) -> dict:
    """JSON Schema of one call to any of ``tools``."""
    branches = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, "arguments": t.get("parameters", {"type": "object"})},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def _tools(arg) -> list:
    if arg is None:
        return [CALCULATOR, WORD_COUNT]
    if not isinstance(arg, list) or not arg:
        raise ValueError("argument `tools` must be a non-empty list of function specs")
    out = []
    for t in arg:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise ValueError(f"a tool spec is a dict with a string `name`, got {t!r}")
        out.append(BUILTINS[t["name"]] if set(t) == {"name"} and t["name"] in BUILTINS else t)
    return out


async def run_tool(name: str, arguments: dict) -> str:
    if name == "calculator":
        return calculate(arguments["expression"])
    if name == "word_count":
        return str(len(arguments["text"].split()))
    session.send(json.dumps({"tool_call": {"name": name, "arguments": arguments}}))
    return await session.receive()


async def main(args: dict) -> dict:
    question = args.get("prompt", args.get("question"))
    if not isinstance(question, str) or not question:
        raise ValueError("tool-call needs a non-empty string argument `prompt` (or its alias `question`)")
    tools = _tools(args.get("tools"))
    model = Model.load(args.get("model"))
    sampler = Sampler(temperature=float(args.get("temperature", 0.0)), seed=args.get("seed"))
    constraint = JsonSchema(call_schema(tools), model.name)
    listing = "\n".join(json.dumps({k: t[k] for k in ("name", "description", "parameters") if k in t}) for t in tools)
    system = args.get("system") or (
        "You can call these tools:\n" + listing + "\nThink in one short sentence, then call a tool as "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call>.'
    )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    prompt = model.apply_chat_template(messages, add_generation_prompt=True)

    with model.new_context() as ctx, constraint:
        ctx.fill(prompt)
        # 1. free text
        think = ctx.generate(sampler, max_tokens=int(args.get("think_tokens", 32)), stop=["\n", "<tool_call>"])
        thought = (await think.collect_text()).strip()
        if think.finish_reason == "eos":  # keep the turn open: drop the end-of-turn token
            ctx.truncate(ctx.seq_len - 1)
        # 2. the call, constrained by the tools' schemas
        ctx.fill("\n<tool_call>")
        call_gen = ctx.generate(sampler, max_tokens=int(args.get("call_tokens", 64)), constraint=constraint)
        call_text = await call_gen.collect_text()
        if call_gen.finish_reason != "constraint":
            raise ValueError(f"the tool call did not complete within call_tokens ({call_gen.finish_reason}): {call_text!r}")
        call = json.loads(call_text)
        ctx.fill("</tool_call>")
        content = f"{thought}\n<tool_call>{call_text}</tool_call>"
        session.send(content + "\n")
        # 3. the tool's result, appended as the next message
        result = await run_tool(call["name"], call["arguments"])
        messages.append({"role": "assistant", "content": content})
        messages.append({"role": "user", "content": f"Tool {call['name']} returned: {result}\nNow answer my question."})
        full = model.apply_chat_template(messages, add_generation_prompt=True)
        if not full.startswith(prompt + content):
            raise ValueError("the model's chat template rewrites earlier turns; tool-call needs an append-only template")
        ctx.fill(full[len(prompt) + len(content):])
        # 4. the answer
        answer = ctx.generate(sampler, max_tokens=int(args.get("max_tokens", 128)))
        async for step in answer:
            if step.text:
                session.send(step.text)
        return {"thought": thought, "call": call, "result": result, "answer": answer.text, "finish_reason": answer.finish_reason}
