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

This module is the facade: it re-exports the parts, each in its own module
(:mod:`.tool_calls` the data, :mod:`.tool_formats` the formats and
rendering, :mod:`.tool_call_stream` the incremental parser,
:mod:`.reasoning` the ``<think>`` splitter) and holds
:class:`ForcedToolCall`, the part that drives a context.

Pure Python (no torch): bundled into WASM builds like the rest of the SDK.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, AsyncIterator

from .constraint import Grammar
from .reasoning import ReasoningSplitter, prompt_opens_reasoning
from .tool_call_stream import ToolCallStream
from .tool_calls import EMPTY_PARAMETERS, NAME_RE, ToolCall, ToolSpecError, new_call_id, normalize_tools, tool_names
from .tool_formats import (
    FORMATS,
    HERMES,
    HERMES_TOOLS_PROMPT,
    LLAMA3_JSON,
    MISTRAL,
    Render,
    ToolFormat,
    _mistral_id,
    detect_format,
    render_chat,
    render_with,
    template_messages,
    tool_format,
    uses_tools,
)

if TYPE_CHECKING:
    from .context import Context
    from .sampler import Sampler


#: Everything tool calling offers, from the modules it is built of (this
#: module keeps :class:`ForcedToolCall`, the part that drives a context).
__all__ = ["EMPTY_PARAMETERS", "FORMATS", "HERMES", "HERMES_TOOLS_PROMPT", "LLAMA3_JSON", "MISTRAL", "NAME_RE",
           "ForcedToolCall", "ReasoningSplitter", "Render", "ToolCall", "ToolCallStream", "ToolFormat", "ToolSpecError",
           "detect_format", "new_call_id", "normalize_tools", "prompt_opens_reasoning", "render_chat", "render_with",
           "template_messages", "tool_format", "tool_names", "uses_tools"]


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
        adapter: a LoRA adapter the generation runs with
            (:meth:`Context.generate`'s ``adapter``), or None.

    Attributes (after iteration):
        call: the :class:`ToolCall` (None before the name is generated).
        finish_reason: ``"tool_calls"`` or ``"length"``.
        generator: the underlying :class:`tartlet.generator.Generator`.

    Raises:
        ValueError: no tools, or ``name`` is not one of them.
    """

    def __init__(self, ctx: "Context", tools: list[dict[str, Any]] | None = None, *, name: str | None = None,
                 sampler: "Sampler | None" = None, max_tokens: int | None = 256, adapter: Any = None) -> None:
        tools = normalize_tools(tools if tools is not None else ctx.tools)
        self.adapter = adapter
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
            self.generator = gen = ctx.generate(self.sampler, max_tokens=self.max_tokens, constraint=grammar,
                                                adapter=self.adapter)
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
