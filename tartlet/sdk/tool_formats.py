"""How each model family writes tool calls (:class:`ToolFormat`: Hermes, Llama 3
JSON, Mistral), which one a chat template uses (:func:`detect_format`), and chat
rendering with tools, natively or in the Hermes fallback (:func:`render_with`).
See :mod:`tartlet.sdk.tools` for the formats' sources."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .tool_call_stream import ToolCallStream
from .tool_calls import EMPTY_PARAMETERS, ToolCall, ToolSpecError, _args_object, new_call_id, tool_names

if TYPE_CHECKING:
    from .model import Model


# A renderer: (messages, add_generation_prompt, tools) -> prompt text.
Render = Callable[[list[dict[str, Any]], bool, "list[dict[str, Any]] | None"], str]


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls (see the module docstring).

    Attributes:
        name: ``hermes``, ``llama3_json`` or ``mistral``.
        open: text filled before a forced call (``<tool_call>\\n``).
        close: text filled after it (``\\n</tool_call>``).
        args_key: the key holding the arguments in the call object.
        array: calls are written as one JSON array.
        native: the model's template renders tools itself (False: this
            module renders them in the Hermes format).
        marker: the text that opens tool calls in generated text (empty for
            ``llama3_json``, which starts with ``{`` or ``<|python_tag|>``).
    """

    name: str
    open: str
    close: str
    args_key: str
    array: bool = False
    native: bool = True

    @property
    def marker(self) -> str:
        return self.open.strip()

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Split generated ``text`` into content and tool calls.

        Returns:
            ``(content, calls)``: ``content`` is the text outside the calls
            (stripped); text that does not parse as calls stays content.
            The same as :class:`ToolCallStream` gives for ``text`` in any
            pieces (it is that parser, fed at once), see there for the rules.
        """
        stream = ToolCallStream(self)
        content = stream.push(text)
        content += stream.finish()[0]
        return content, stream.calls

    def body_prefix(self, name: str) -> str:
        """The call text before the arguments, as :meth:`grammar` writes it."""
        return ("[" if self.array else "") + '{"name": ' + json.dumps(name) + f', "{self.args_key}": '

    @property
    def body_suffix(self) -> str:
        """The call text after the arguments."""
        return "}]" if self.array else "}"

    def grammar(self, tools: list[dict[str, Any]], name: str | None = None) -> str:
        """Lark grammar (llguidance dialect) of one call's JSON body: for
        each allowed tool, its name and arguments valid against its
        ``parameters`` schema (compact JSON). ``name`` restricts it to one tool.

        Raises:
            ValueError: ``name`` is not in ``tools``.
        """
        names = tool_names(tools)
        if name is not None and name not in names:
            raise ValueError(f"no tool named {name!r} (tools: {', '.join(names)})")
        alts, rules = [], []
        for i, t in enumerate(tools):
            fn = t["function"]
            if name is not None and fn["name"] != name:
                continue
            schema = dict(fn.get("parameters") or EMPTY_PARAMETERS)
            schema["x-guidance"] = {"whitespace_flexible": False}
            alts.append(f"{json.dumps(self.body_prefix(fn['name']))} args{i} {json.dumps(self.body_suffix)}")
            rules.append(f"args{i}: %json {json.dumps(schema)}")
        return "start: " + " | ".join(alts) + "\n" + "\n".join(rules) + "\n"

    def template_call_text(self, call: ToolCall) -> str:
        """A call as this format writes it (the fallback rendering uses it;
        the same spacing as :meth:`grammar`, so a forced call's tokens
        equal their later rendering)."""
        return self.open + self.body_prefix(call.name) + _compact(call.arguments) + self.body_suffix + self.close


def _compact(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False, separators=(",", ":"))
    except ValueError:
        return arguments


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments")


LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters")


MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", array=True)


FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}


# -- detecting the format from the template ----------------------------------------
_PROBE_NAME = "tartlet_probe_fn"


_PROBE_TOOLS = [{"type": "function", "function": {
    "name": _PROBE_NAME, "description": "probe", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
}}]  # fmt: skip


_PROBE_CALLS = [{"id": "probecall", "type": "function", "function": {"name": _PROBE_NAME, "arguments": {"a": 1}}}]


def detect_format(render: Render) -> ToolFormat:
    """The tool format of a chat template, found by rendering probes with
    ``render(messages, add_generation_prompt, tools)``: a template whose
    output does not mention a probe tool does not support tools (the
    Hermes fallback, ``native=False``); otherwise the markup it writes for an
    assistant tool call (``<tool_call>``, ``[TOOL_CALLS]``, or a JSON object
    with ``"parameters"``) names the format. Templates that render tools but
    reject the probe call default to Hermes with ``native=True``."""
    user = {"role": "user", "content": "hi"}
    try:
        with_tools = render([user], True, _PROBE_TOOLS)
    except ValueError:
        return _fallback()
    if _PROBE_NAME not in with_tools:
        return _fallback()
    try:
        call = render([user, {"role": "assistant", "content": "", "tool_calls": _PROBE_CALLS}], False, _PROBE_TOOLS)
    except ValueError:
        call = with_tools
    if "<tool_call>" in call:
        return HERMES
    if "[TOOL_CALLS]" in call:
        return MISTRAL  # also the v11 form [TOOL_CALLS]name[ARGS]{...}: parsed; forced calls use the array form
    if re.search(r'"name":\s*"' + _PROBE_NAME + r'",\s*"parameters"', call):
        return LLAMA3_JSON
    return HERMES


def _fallback() -> ToolFormat:
    return ToolFormat("hermes", HERMES.open, HERMES.close, HERMES.args_key, native=False)


_formats: dict[str, ToolFormat] = {}


def tool_format(model: "Model") -> ToolFormat:
    """The tool format of ``model``'s chat template (probed once per model
    name, see :func:`detect_format`)."""
    fmt = _formats.get(model.name)
    if fmt is None:
        fmt = _formats[model.name] = detect_format(lambda m, agp, t: model.apply_chat_template(m, agp, t))
    return fmt


# -- rendering -----------------------------------------------------------------------
#: Qwen2.5's tool instructions (Qwen/Qwen2.5-7B-Instruct ``chat_template``,
#: Apache-2.0), used for templates that do not render tools themselves.
HERMES_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def uses_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> bool:
    """True when rendering needs this module: tools given, a tool message
    or an assistant message with tool calls."""
    return bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def template_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fmt: ToolFormat,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages and tools as the template receives them.

    ``messages`` may hold assistant messages with OpenAI ``tool_calls``
    (``arguments`` JSON text) and ``tool`` messages with ``tool_call_id``.
    Native templates get the calls with ``arguments`` as objects (the
    Hugging Face convention), each tool message the ``name`` of its call,
    ``content`` ``""`` rather than None (some templates take its length),
    and for ``mistral`` call ids mapped to the 9 alphanumerics Mistral
    templates require. Other templates (``fmt.native`` False) get plain
    messages: the tool list appended to the system message (one is added
    first if there is none) with :data:`HERMES_TOOLS_PROMPT`, calls as
    ``<tool_call>`` blocks in the assistant content, and each tool result
    as a user message ``<tool_response>\\n...\\n</tool_response>``.

    Raises:
        ToolSpecError: a tool call whose ``arguments`` are not a JSON object.
    """
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls:
            parsed = []
            for j, c in enumerate(calls):
                fn = c.get("function") or {}
                args = _args_object(fn.get("arguments", {}))
                if args is None:
                    raise ToolSpecError(f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                                        f"messages[{i}].tool_calls[{j}].function.arguments")
                cid = str(c.get("id") or new_call_id())
                names[cid] = fn.get("name", "")
                parsed.append((cid, fn.get("name", ""), args))
            if fmt.native:
                tc = [{"id": _mistral_id(cid) if fmt.name == "mistral" else cid, "type": "function",
                       "function": {"name": n, "arguments": a}} for cid, n, a in parsed]
                out.append({"role": "assistant", "content": m.get("content") or "", "tool_calls": tc})
            else:
                text = "\n".join(fmt.template_call_text(ToolCall(n, json.dumps(a, ensure_ascii=False), cid)) for cid, n, a in parsed)
                content = m.get("content")
                out.append({"role": "assistant", "content": f"{content}\n{text}" if content else text})
        elif m.get("role") == "tool":
            tool_cid = m.get("tool_call_id")
            if fmt.native:
                msg = {"role": "tool", "content": m.get("content") or ""}
                if tool_cid is not None:
                    msg["tool_call_id"] = _mistral_id(tool_cid) if fmt.name == "mistral" else tool_cid
                name = m.get("name") or names.get(tool_cid or "")
                if name:
                    msg["name"] = name
                out.append(msg)
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content")})
    if fmt.native or not tools:
        return out, tools if fmt.native else None
    prompt = HERMES_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content'] or ''}\n\n{prompt}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _mistral_id(call_id: str) -> str:
    if re.fullmatch(r"[A-Za-z0-9]{9}", call_id):
        return call_id
    return hashlib.sha1(call_id.encode()).hexdigest()[:9]


def render_with(render: Render, fmt: ToolFormat | None, messages: list[dict[str, Any]], add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None) -> str:
    """Render a conversation with tools through ``render`` (the model's
    template); ``fmt`` is needed only when :func:`uses_tools` is true."""
    if not uses_tools(messages, tools):
        return render(messages, add_generation_prompt, None)
    assert fmt is not None
    msgs, t = template_messages(messages, tools, fmt)
    return render(msgs, add_generation_prompt, t)


def render_chat(model: "Model", messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None) -> str:
    """Render ``messages`` (OpenAI shapes, tool calls and tool messages
    included) with ``model``'s own template and ``tools`` (see
    :func:`template_messages`).

    Raises:
        ToolSpecError: malformed tool call arguments.
        ValueError: no chat template, or the template rejects the conversation.
    """
    fmt = tool_format(model) if uses_tools(messages, tools) else None
    return render_with(lambda m, agp, t: model.apply_chat_template(m, agp, t), fmt, messages, add_generation_prompt, tools)
