"""Model-native tool calling and reasoning: chat rendering with ``tools``,
tool-call parsers, forced (constrained) tool calls and a ``<think>`` splitter.

Tools are described in the OpenAI shape (``{"type": "function", "function":
{"name", "description", "parameters": JSON Schema}}``), which is also what
Hugging Face chat templates receive as ``tools``. A conversation with tools::

    ctx.system("You are a weather bot.", tools=TOOLS)   # or ctx.set_tools(TOOLS)
    ctx.user("Weather in Paris?")
    call = await ForcedToolCall(ctx, TOOLS).collect()   # always schema-valid
    ctx.tool(json.dumps(get_weather(**call.args())), tool_call_id=call.id)
    reply = await ctx.generate().collect_text()

Formats (:class:`ToolFormat`), each as its model family writes a call:

* ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call (NousResearch Hermes-2-Pro/Hermes-3 model cards and
  their ``tool_use`` chat templates; Qwen2.5/Qwen3 chat templates in their
  ``tokenizer_config.json``).
* ``llama3_json``: ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;`` (Meta's Llama 3.1/3.2 model
  cards, "JSON based tool calling", and their chat templates).
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or
  the v11 form ``[TOOL_CALLS]name[ARGS]{...}`` (mistral-common's tokenizer
  versions; Mistral-Nemo-Instruct-2407 and Mistral-Small-3.2 templates).

The format is picked from the model's own template by rendering a probe
conversation (:func:`detect_format`): which markup the template writes for
an assistant tool call. A template that ignores ``tools`` (such as
SmolLM2's) gets the Hermes format rendered by this module
(:func:`template_messages`): the tool list in the system message with
Qwen2.5's instructions, calls as ``<tool_call>`` blocks in the assistant
content, tool results as user messages in ``<tool_response>`` tags.

Pure Python (no torch): bundled into WASM builds like the rest of the SDK.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from .constraint import Grammar

if TYPE_CHECKING:
    from .context import Context
    from .model import Model
    from .sampler import Sampler

#: OpenAI's rule for function names.
NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The JSON Schema of a function without parameters.
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# A renderer: (messages, add_generation_prompt, tools) -> prompt text.
Render = Callable[[list[dict[str, Any]], bool, "list[dict[str, Any]] | None"], str]


class ToolSpecError(ValueError):
    """A malformed tool list, tool choice or tool message. ``param`` names
    the offending field the way the OpenAI API does (``tools[0].function.name``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def normalize_tools(tools: Any) -> list[dict[str, Any]]:
    """Check a tool list and return it in the OpenAI shape, ``parameters``
    filled in (``{"type": "object", "properties": {}}`` when absent).

    Accepts ``{"type": "function", "function": {...}}`` items or bare
    function objects ``{"name", "description", "parameters"}``.

    Raises:
        ToolSpecError: not a non-empty list, an item of another type, a
            name not matching ``[A-Za-z0-9_-]{1,64}``, a repeated name, a
            non-string description, parameters that are not a JSON Schema
            object, or a non-boolean ``strict``.
    """
    if not isinstance(tools, list) or not tools:
        raise ToolSpecError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}", "tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict):
            raise ToolSpecError(f"{where} must be an object, got {type(t).__name__}", where)
        if "function" in t or "type" in t:
            if t.get("type") != "function":
                raise ToolSpecError(f"{where}.type must be 'function', got {t.get('type')!r}", f"{where}.type")
            extra = set(t) - {"type", "function"}
            if extra:
                raise ToolSpecError(f"unknown field(s) in {where}: {', '.join(sorted(extra))}", where)
            fn, where = t.get("function"), f"{where}.function"
        else:
            fn = t
        if not isinstance(fn, dict):
            raise ToolSpecError(f"{where} must be an object with 'name' and 'parameters'", where)
        extra = set(fn) - {"name", "description", "parameters", "strict"}
        if extra:
            raise ToolSpecError(f"unknown field(s) in {where}: {', '.join(sorted(extra))}", where)
        name = fn.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise ToolSpecError(f"{where}.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}", f"{where}.name")
        if name in seen:
            raise ToolSpecError(f"{where}.name {name!r} is used by two tools", f"{where}.name")
        seen.add(name)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ToolSpecError(f"{where}.description must be a string", f"{where}.description")
        params = fn.get("parameters")
        if params is None:
            params = dict(EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolSpecError(f"{where}.parameters must be a JSON Schema object with type 'object'", f"{where}.parameters")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise ToolSpecError(f"{where}.strict must be a boolean", f"{where}.strict")
        f: dict[str, Any] = {"name": name}
        if desc is not None:
            f["description"] = desc
        f["parameters"] = params
        out.append({"type": "function", "function": f})
    return out


def tool_names(tools: list[dict[str, Any]]) -> list[str]:
    """Names of a :func:`normalize_tools` list, in order."""
    return [t["function"]["name"] for t in tools]


def new_call_id() -> str:
    """A fresh OpenAI-style call id, ``call_`` + 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    """One tool call.

    Attributes:
        name: the function name.
        arguments: the arguments as JSON text (an object), as the OpenAI API
            carries them.
        id: the call id (``call_...``).
    """

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def args(self) -> dict[str, Any]:
        """The arguments parsed. Raises ValueError when they are not a JSON object."""
        value = json.loads(self.arguments)
        if not isinstance(value, dict):
            raise ValueError(f"tool call arguments are not a JSON object: {self.arguments[:200]!r}")
        return value

    def to_openai(self) -> dict[str, Any]:
        """``{"id", "type": "function", "function": {"name", "arguments"}}``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _args_object(value: Any) -> dict[str, Any] | None:
    if isinstance(value, str):  # some models write the arguments as a JSON string
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def _call_from(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not NAME_RE.fullmatch(obj["name"]):
        return None
    raw: Any = next((obj[k] for k in args_keys if k in obj), {})
    args = _args_object(raw)
    if args is None:
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_DECODER = json.JSONDecoder()


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
            (stripped); text that does not parse as calls stays content
            (``calls`` empty), as vLLM's parsers do.
        """
        if self.name == "hermes":
            return _parse_hermes(text)
        if self.name == "mistral":
            return _parse_mistral(text)
        return _parse_llama3(text)

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

_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls, spans = [], []
    for m in _HERMES_BLOCK.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except ValueError:
            continue
        call = _call_from(obj, ("arguments", "parameters"))
        if call is not None:
            calls.append(call)
            spans.append(m.span())
    if not calls:
        return text.strip(), []
    content, last = [], 0
    for a, b in spans:
        content.append(text[last:a])
        last = b
    content.append(text[last:])
    return "".join(content).strip(), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    s = text.strip()
    if s.startswith("<|python_tag|>"):
        s = s[len("<|python_tag|>"):].lstrip()
    calls, i = [], 0
    while i < len(s):
        try:
            obj, end = _DECODER.raw_decode(s, i)
        except ValueError:
            return text.strip(), []
        call = _call_from(obj, ("parameters", "arguments"))
        if call is None:
            return text.strip(), []
        calls.append(call)
        i = end
        while i < len(s) and (s[i].isspace() or s[i] == ";"):
            i += 1
    return "", calls


_MISTRAL_V11 = re.compile(r"\s*([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9]+)?\[ARGS\]")


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    at = text.find("[TOOL_CALLS]")
    if at < 0:
        return text.strip(), []
    content, rest = text[:at], text[at + len("[TOOL_CALLS]"):]
    calls: list[ToolCall] = []
    try:
        if rest.lstrip().startswith("["):
            items, _ = _DECODER.raw_decode(rest.lstrip())
            for obj in items if isinstance(items, list) else [None]:
                call = _call_from(obj, ("arguments", "parameters"))
                if call is None:
                    return text.strip(), []
                calls.append(call)
        else:
            i = 0
            while True:
                m = _MISTRAL_V11.match(rest, i)
                if m is None:
                    break
                args, i = _DECODER.raw_decode(rest, m.end())
                call = _call_from({"name": m.group(1), "arguments": args}, ("arguments",))
                if call is None:
                    return text.strip(), []
                calls.append(call)
                j = rest.find("[TOOL_CALLS]", i)
                if j < 0:
                    break
                i = j + len("[TOOL_CALLS]")
    except ValueError:
        return text.strip(), []
    if not calls:
        return text.strip(), []
    return content.strip(), calls


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


# -- streaming parse ------------------------------------------------------------------
def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolCallStream:
    """Incremental tool-call parsing of generated text: content is passed
    on as it comes, except what may be the start of a call, which is held
    until the end and parsed by :meth:`ToolFormat.parse`.

    ``push(text)`` returns the content that is safe to show; ``finish()``
    returns ``(content_tail, calls)``. The shown content concatenates to the
    whole content (calls removed); text that never parses as a call is
    shown at the end.
    """

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self._buf = ""
        self._in_call = False
        self._started = False

    def push(self, text: str) -> str:
        self._buf += text
        if self._in_call:
            return ""
        if self.fmt.name == "llama3_json":
            if not self._started:
                s = self._buf.lstrip()
                if not s:
                    return ""
                tag = "<|python_tag|>"
                if len(s) < len(tag) and tag.startswith(s):
                    return ""  # undecided
                self._started = True
                if s.startswith("{") or s.startswith(tag):
                    self._in_call = True
                    return ""
            out, self._buf = self._buf, ""
            return out
        marker = self.fmt.marker
        at = self._buf.find(marker)
        if at >= 0:
            out, self._buf = self._buf[:at], self._buf[at:]
            self._in_call = True
            return out
        keep = _partial_suffix(self._buf, marker)
        out, self._buf = self._buf[: len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        if not self._in_call:
            return buf, []
        content, calls = self.fmt.parse(buf)
        return (content, calls) if calls else (buf, [])


# -- forced calls ------------------------------------------------------------------------
class ForcedToolCall:
    """Generate exactly one tool call, constrained to be valid: the format's
    opening markup is filled, then the call's JSON body is generated under a
    grammar (:meth:`ToolFormat.grammar`: one of the allowed names, arguments
    valid against that tool's ``parameters``), then the closing markup is
    filled. The assistant turn is recorded in the context's chat as a
    message with ``tool_calls``.

    Use ``async for delta in ForcedToolCall(...)`` to stream (deltas are
    OpenAI ``delta.tool_calls`` items: first ``{"index": 0, "id", "name"}``,
    then ``{"index": 0, "arguments": str}`` pieces that concatenate to the
    arguments), or ``await ForcedToolCall(...).collect()``.

    Args:
        ctx: a chat context (the conversation so far; tools set with
            :meth:`Context.set_tools` or given here).
        tools: the allowed tools (default: the context's).
        name: force this tool (OpenAI ``tool_choice`` named); None: any.
        sampler: token selection (default greedy).
        max_tokens: cap on the generated body; a call cut there ends with
            ``finish_reason`` ``"length"`` and incomplete arguments.

    Attributes (after iteration):
        call: the :class:`ToolCall` (None before the name is generated).
        finish_reason: ``"tool_calls"`` or ``"length"``.
        generator: the underlying :class:`tartlet.generator.Generator`.

    Raises:
        ValueError: no tools, or ``name`` is not one of them.
    """

    def __init__(self, ctx: "Context", tools: list[dict[str, Any]] | None = None, *, name: str | None = None,
                 sampler: "Sampler | None" = None, max_tokens: int | None = 256) -> None:
        tools = normalize_tools(tools if tools is not None else ctx.tools)
        self.ctx, self.tools, self.name = ctx, tools, name
        self.fmt = tool_format(ctx.model)
        self.grammar_text = self.fmt.grammar(tools, name)
        self.sampler, self.max_tokens = sampler, max_tokens
        self.call: ToolCall | None = None
        self.finish_reason: str | None = None
        self.generator: Any = None
        self._call_id = _mistral_id(new_call_id()) if self.fmt.name == "mistral" else new_call_id()

    async def collect(self) -> ToolCall:
        """Run to the end; the call (arguments possibly cut at ``max_tokens``:
        check :attr:`finish_reason`).

        Raises:
            ValueError: ``max_tokens`` ended the generation before the
                tool's name was complete.
        """
        async for _ in self:
            pass
        if self.call is None:
            raise ValueError(f"max_tokens ({self.max_tokens}) ended the tool call before its name was complete")
        return self.call

    async def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        ctx, fmt = self.ctx, self.fmt
        ctx.begin_assistant()
        if fmt.open:
            ctx.fill(fmt.open)
        grammar = Grammar(self.grammar_text, ctx.model.name)
        try:
            self.generator = gen = ctx.generate(self.sampler, max_tokens=self.max_tokens, constraint=grammar)
            text, sent, name = "", 0, None
            async for step in gen:
                text += step.text
                if name is None:
                    name = _body_name(text, fmt)
                    if name is None:
                        continue
                    self.call = ToolCall(name, "", self._call_id)
                    yield {"index": 0, "id": self._call_id, "name": name}
                # hold back what may be the body's closing text (all of it, once finished)
                start, end = len(fmt.body_prefix(name)), len(text) - len(fmt.body_suffix)
                piece = text[start + sent: end] if end > start + sent else ""
                if piece:
                    assert self.call is not None  # set when the name was found
                    sent += len(piece)
                    self.call.arguments += piece
                    yield {"index": 0, "arguments": piece}
            text = gen.text
        finally:
            grammar.close()
        self.finish_reason = "tool_calls" if gen.finish_reason == "constraint" else "length"
        if self.finish_reason == "length" and self.call is not None:
            rest = text[len(fmt.body_prefix(self.call.name)) + len(self.call.arguments):]
            if rest:
                self.call.arguments += rest
                yield {"index": 0, "arguments": rest}
        if self.finish_reason == "tool_calls":
            assert self.call is not None  # the grammar ends only after a complete call
            if fmt.close:
                ctx.fill(fmt.close)
            ctx._replace_assistant_turn(
                {"role": "assistant", "content": None, "tool_calls": [self.call.to_openai()]}, fmt.open + text + fmt.close,
            )


def _body_name(text: str, fmt: ToolFormat) -> str | None:
    head = ('[{"name": "' if fmt.array else '{"name": "')
    if not text.startswith(head):
        return None
    end = text.find('"', len(head))
    return None if end < 0 else text[len(head):end]


# -- reasoning -------------------------------------------------------------------------
class ReasoningSplitter:
    """Splits generated text into reasoning and content for models that
    think in ``<think>...</think>`` (DeepSeek-R1, QwQ, Qwen3; the tags as
    their chat templates and model cards write them), streaming-safe: a tag
    split across pushes is held back until it is decided.

    Reasoning is recognised only at the start of the output (leading
    whitespace allowed), or from the first token when ``in_reasoning`` is
    set (templates whose generation prompt already opens ``<think>``, see
    :func:`prompt_opens_reasoning`). Whitespace around the reasoning is
    dropped. Output that ends before ``</think>`` is all reasoning.

    ``push(text)`` and ``finish()`` return ``(reasoning, content)`` deltas.
    """

    def __init__(self, in_reasoning: bool = False, open_tag: str = "<think>", close_tag: str = "</think>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._state = "reasoning_start" if in_reasoning else "start"
        self._buf = ""
        self.saw_reasoning = in_reasoning

    def push(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while True:
            buf = self._buf
            if self._state == "start":
                s = buf.lstrip()
                if s.startswith(self.open_tag):
                    self._buf, self._state, self.saw_reasoning = s[len(self.open_tag):], "reasoning_start", True
                    continue
                if self.open_tag.startswith(s):
                    return reasoning, content
                self._state = "content"
                continue
            if self._state == "reasoning_start":
                self._buf = buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self._state = "reasoning"
                continue
            if self._state == "reasoning":
                at = buf.find(self.close_tag)
                if at >= 0:
                    reasoning += buf[:at].rstrip()
                    self._buf, self._state = buf[at + len(self.close_tag):], "content_start"
                    continue
                keep = _partial_suffix(buf, self.close_tag)
                body = buf[: len(buf) - keep]
                ws = len(body) - len(body.rstrip())
                reasoning += body[: len(body) - ws]
                self._buf = buf[len(body) - ws:]
                return reasoning, content
            if self._state == "content_start":
                self._buf = buf.lstrip()
                if not self._buf:
                    return reasoning, content
                self._state = "content"
                continue
            content += buf
            self._buf = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        buf, self._buf = self._buf, ""
        if self._state in ("reasoning", "reasoning_start"):
            return buf.strip(), ""
        if self._state == "content_start":
            return "", buf.lstrip()
        return "", buf


def prompt_opens_reasoning(prompt: str, open_tag: str = "<think>") -> bool:
    """True when a rendered prompt ends inside an open ``<think>`` (the
    generation prompt of DeepSeek-R1 and QwQ templates), so the output
    starts as reasoning."""
    tail = prompt.rstrip()
    return tail.endswith(open_tag)
