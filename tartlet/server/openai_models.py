"""The ``/v1/chat/completions`` and ``/v1/completions`` request bodies as
pydantic models, and the tool fields the Responses route shares.

Each field takes the raw JSON value and checks it (:mod:`.openai_fields`:
no coercion, a message naming the parameter); checks across fields are the
models' ``after`` validators. :func:`parse_request` validates a body and
maps the first error to OpenAI's 400 with
:func:`.openai_errors.validation_error` (``param``: the field's path,
``messages[1].tool_calls[0].function.arguments``; ``code``:
``invalid_value``, ``unsupported_parameter`` for a parameter not served,
``missing_required_parameter``). It returns the inferlet args the routes
(:mod:`.openai_api`) read, the same dicts whatever the model.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal, TypedDict

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainValidator,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from ..sdk.tools import ToolSpecError, normalize_tools, tool_names
from .openai_errors import PARAM, validation_error
from .openai_fields import boolean, checked_by, integer, invalid, non_empty_string, nucleus, number
from .openai_protocol import is_json_object_text, parse_response_format
from .openai_sampling import SamplerFields

#: Known OpenAI parameters and why they are refused (an unknown parameter's 400 says so).
UNSUPPORTED = {
    "tools": "tool calling is available on /v1/chat/completions only",
    "tool_choice": "tool calling is available on /v1/chat/completions only",
    "parallel_tool_calls": "tool calling is available on /v1/chat/completions only",
    "functions": "the deprecated 'functions' parameter is not supported: use 'tools'",
    "function_call": "the deprecated 'function_call' parameter is not supported: use 'tool_choice'",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported", "service_tier": "service tiers are not supported",
}

#: The most prompts one ``/v1/completions`` request may carry.
MAX_PROMPTS = 64

#: The most choices (``n``) one request may ask for.
MAX_N = 16

#: The most alternatives per token: ``top_logprobs`` (chat) and ``logprobs`` (completions).
MAX_TOP_LOGPROBS = {True: 20, False: 5}

_ROLES = ("system", "developer", "user", "assistant", "tool")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise invalid(f"{PARAM} must be a string or a list of text parts (images and audio are not supported)")


def _arguments(v: Any) -> str:
    if not is_json_object_text(v):
        raise invalid(f"{PARAM} must be a JSON object as a string, got {v!r:.80}")
    return str(v)


class FunctionCall(BaseModel):
    """The ``function`` of an assistant message's tool call."""

    name: Annotated[str, non_empty_string()] = Field("", validate_default=True)
    #: a JSON object as a string (OpenAI's shape)
    arguments: Annotated[str, PlainValidator(_arguments)] = "{}"


class MessageToolCall(BaseModel):
    """A tool call of an assistant message: ``{"id", "type": "function",
    "function": {"name", "arguments"}}``."""

    id: Annotated[str, non_empty_string()] = Field("", validate_default=True)
    function: FunctionCall

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, c: Any) -> Any:
        if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
            raise invalid(f"{PARAM} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}")
        return c


def _list(v: Any) -> Any:
    if v is not None and not isinstance(v, list):
        raise invalid(f"{PARAM} must be a list")
    return v


class Message(BaseModel):
    """A chat message. ``developer`` is ``system`` for the inferlet; an
    assistant message may carry ``tool_calls`` (then its content may be
    null; other roles' ``tool_calls`` are ignored); a ``tool`` message needs
    ``tool_call_id``; content is a string or a list of text parts."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: Annotated[list[MessageToolCall] | None, BeforeValidator(_list)] = None
    content: str | None = Field(None, validate_default=True)
    tool_call_id: str | None = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _role(cls, m: Any) -> Any:
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise invalid(f"{PARAM} must be system, developer, user, assistant or tool", field="role")
        return m if m["role"] == "assistant" or "tool_calls" not in m else {k: v for k, v in m.items() if k != "tool_calls"}

    @field_validator("content", mode="plain")
    @classmethod
    def _content(cls, v: Any, info: ValidationInfo) -> str | None:
        if v is None and info.data.get("tool_calls") is not None:
            return None
        return _text(v)

    @field_validator("tool_call_id", mode="plain")
    @classmethod
    def _call_id(cls, v: Any, info: ValidationInfo) -> str | None:
        if info.data.get("role") != "tool":
            return None
        if not isinstance(v, str) or not v:
            raise invalid(f"{PARAM} is required for role 'tool' (the id of the call it answers)")
        return v

    def inferlet_message(self) -> dict[str, Any]:
        """The message in the inferlet's shape: ``{"role", "content"}``,
        ``tool_calls`` when it has some, ``tool_call_id`` for ``tool``."""
        msg: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}} for c in self.tool_calls
            ]
        elif msg["content"] is None:
            msg["content"] = ""
        if self.role == "tool":
            msg["tool_call_id"] = self.tool_call_id
        return msg


def _tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    try:
        return normalize_tools(v)
    except ToolSpecError as e:
        raise invalid(str(e), at=e.param) from None


_CHOICE = "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"


def _tool_choice(v: Any) -> str | dict[str, str] | None:
    if isinstance(v, dict):
        fn = v.get("function")
        if v.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or set(v) - {"type", "function"}:
            raise invalid(_CHOICE)
        return {"name": fn["name"]}
    if v not in (None, "none", "auto", "required"):
        raise invalid(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {v!r}")
    return None if v is None else str(v)


class ToolFields(BaseModel):
    """``tools`` (normalized by :func:`tartlet.sdk.tools.normalize_tools`),
    ``tool_choice`` (``auto``, ``none``, ``required`` or ``{"name": str}``,
    a tool of ``tools``; only ``none`` without tools) and
    ``parallel_tool_calls`` (a boolean)."""

    tools: Annotated[list[dict[str, Any]] | None, PlainValidator(_tools)] = None
    tool_choice: Annotated[str | dict[str, str] | None, PlainValidator(_tool_choice)] = None
    parallel_tool_calls: Annotated[bool | None, boolean] = None

    @model_validator(mode="after")
    def _choice_in_tools(self) -> ToolFields:
        choice = self.tool_choice
        if self.tools is None:
            if choice not in (None, "none"):
                raise invalid("'tool_choice' is only allowed when 'tools' are specified", at="tool_choice")
        elif isinstance(choice, dict) and choice["name"] not in tool_names(self.tools):
            raise invalid(f"tool_choice names {choice['name']!r}, which is not in 'tools' ({', '.join(tool_names(self.tools))})", at="tool_choice")
        return self

    def tool_args(self, args: dict[str, Any]) -> None:
        """Put ``tools`` and ``tool_choice`` (default ``auto``) into the
        inferlet ``args`` when there are tools."""
        if self.tools is not None:
            args["tools"] = self.tools
            args["tool_choice"] = self.tool_choice if self.tool_choice is not None else "auto"


def parse_tools(fields: dict[str, Any], args: dict[str, Any]) -> None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (the
    chat shapes, :class:`ToolFields`) into ``args``.

    Raises:
        ApiError: 400 naming the parameter (``tools[0].function.name``, ``tool_choice``, ...).
    """
    try:
        ToolFields.model_validate(fields).tool_args(args)
    except ValidationError as e:
        raise validation_error(e) from None


def _stop(v: Any) -> list[str] | None:
    stop = [v] if isinstance(v, str) else v
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop)):
        raise invalid(f"{PARAM} must be a string or a list of at most 4 non-empty strings")
    return stop


def _include_usage(v: Any) -> bool:
    so = v or {}
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise invalid(f"{PARAM} supports only include_usage")
    return bool(so.get("include_usage"))


def _logit_bias(bias: Any, info: ValidationInfo) -> dict[str, float]:
    """OpenAI's ``logit_bias``: token id (a decimal string in JSON) -> bias
    in [-100, 100], ids checked against the context's ``vocab_size``; zero
    biases dropped."""
    if bias is None:
        return {}
    vocab_size = (info.context or {}).get("vocab_size")
    if not isinstance(bias, dict):
        raise invalid(f"{PARAM} must be an object mapping token ids to biases in [-100, 100]")
    out = {}
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdigit()) or (vocab_size is not None and int(k) >= vocab_size):
            raise invalid(f"logit_bias key {k!r} is not a token id in [0, {vocab_size})")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise invalid(f"logit_bias[{k!r}] must be a number in [-100, 100], got {v!r}")
        if v:
            out[str(int(k))] = float(v)
    return out


class _Request(SamplerFields):
    """The fields ``/v1/chat/completions`` and ``/v1/completions`` share;
    any other key is a 400 ``unsupported_parameter``."""

    model_config = ConfigDict(extra="forbid")
    #: the inferlet args, built by the ``after`` validator (which checks the sampler fields against the rest)
    _inferlet_args: dict[str, Any] = PrivateAttr(default_factory=dict)

    model: Annotated[str, non_empty_string("is required (see GET /v1/models)", "missing_required_parameter")] = Field(
        "", validate_default=True,
    )
    n: Annotated[int | None, integer(1, MAX_N)] = None
    #: the shape check the Responses route shares (its ``text.format``)
    response_format: Annotated[dict[str, Any] | None, checked_by(parse_response_format)] = None
    max_tokens: Annotated[int | None, integer(1, hi_from="max_seq_len")] = None
    temperature: Annotated[float | None, number(0.0, 2.0)] = None
    top_p: Annotated[float | None, nucleus()] = None
    seed: Annotated[int | None, integer()] = None
    stop: Annotated[list[str] | None, PlainValidator(_stop)] = None
    #: vLLM's extension: generate exactly max_tokens
    ignore_eos: Annotated[bool | None, boolean] = None
    presence_penalty: Annotated[float | None, number(-2.0, 2.0)] = None
    frequency_penalty: Annotated[float | None, number(-2.0, 2.0)] = None
    logit_bias: Annotated[dict[str, float], PlainValidator(_logit_bias)] = Field(default_factory=dict)
    stream: Any = None
    stream_options: Annotated[bool, PlainValidator(_include_usage)] = False
    user: Any = None

    def inferlet_args(self) -> dict[str, Any]:
        """The ``openai-completion`` inferlet's args (for completions,
        without the prompt), as validated."""
        return self._inferlet_args

    def _args(self, top_n: int | None, max_tokens: tuple[int | None, int]) -> dict[str, Any]:
        """The inferlet args besides ``model``, ``messages`` and the tools;
        ``max_tokens``: (the value given, the default)."""
        args: dict[str, Any] = {}
        given, default = max_tokens
        args["max_tokens"] = given if given is not None else default
        args["temperature"] = self.temperature if self.temperature is not None else 0.0
        args["top_p"] = self.top_p if self.top_p is not None else 1.0
        args["seed"] = self.seed
        args["stop"] = self.stop
        args["ignore_eos"] = bool(self.ignore_eos)
        if self.response_format is not None:
            args["response_format"] = self.response_format
        for key, v in (("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if v:
                args[key] = v
        if self.logit_bias:
            args["logit_bias"] = self.logit_bias
        if self.n is not None and self.n > 1:
            args["n"] = self.n
        if top_n is not None:
            args["logprobs"] = top_n
        self.sampler_args(args)  # llama.cpp's min_p, typical_p, mirostat, dry_*, xtc_*
        return args


def _non_empty(v: Any) -> Any:
    if not isinstance(v, list) or not v:
        raise invalid(f"{PARAM} must be a non-empty list")
    return v


class ChatRequest(_Request, ToolFields):
    """A ``/v1/chat/completions`` body."""

    model_config = ConfigDict(extra="forbid")

    messages: Annotated[list[Message], BeforeValidator(_non_empty)] = Field(default_factory=list, validate_default=True)
    max_completion_tokens: Annotated[int | None, integer(1, hi_from="max_seq_len")] = None
    logprobs: Annotated[bool | None, boolean] = None
    top_logprobs: Annotated[int | None, integer(0, MAX_TOP_LOGPROBS[True])] = None
    metadata: Any = None
    store: Any = None

    @model_validator(mode="after")
    def _combinations(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid("'top_logprobs' needs 'logprobs' set to true", at="top_logprobs")
        forced = isinstance(self.tool_choice, dict) or self.tool_choice == "required"
        if forced and self.logprobs:
            raise invalid("'logprobs' cannot be combined with a forced tool call (tool_choice required or named)", "unsupported_parameter",
                          at="logprobs")
        if self.response_format is not None and self.tools is not None and self.tool_choice != "none":
            raise invalid("'response_format' cannot be combined with 'tools' unless tool_choice is 'none'", "unsupported_parameter",
                          at="response_format")
        self._inferlet_args = self._build()  # checks the sampler fields against the rest
        return self

    def top_n(self) -> int | None:
        """Alternatives per token to report (None: no logprobs)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def _build(self) -> dict[str, Any]:
        args: dict[str, Any] = {"model": self.model, "messages": [m.inferlet_message() for m in self.messages]}
        self.tool_args(args)
        mt = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return args | self._args(self.top_n(), (mt, 256))


def _token_ids(ids: list[Any], vocab_size: int | None, where: str) -> list[int]:
    if not ids:
        raise invalid(f"{where} must not be empty")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise invalid(f"{where}: token id {t!r} is outside the vocabulary [0, {vocab_size})")
    return list(ids)


_PROMPT_SHAPE = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"


def _prompts(prompt: Any, info: ValidationInfo) -> list[dict[str, Any]]:
    """The prompts of a completions request: a string, a list of strings, a
    list of token ids or a list of token-id lists (at most
    :data:`MAX_PROMPTS`, none empty, ids checked against the context's
    ``vocab_size``); one args dict each (``{"prompt": str}`` or
    ``{"prompt_tokens": [int]}``)."""
    vocab_size = (info.context or {}).get("vocab_size")
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise invalid(_PROMPT_SHAPE)
    if len(items) > MAX_PROMPTS:
        raise invalid(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}")
    out: list[dict[str, Any]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise invalid(f"prompt[{i}] must not be empty")
            out.append({"prompt": p})
        elif isinstance(p, list):
            out.append({"prompt_tokens": _token_ids(p, vocab_size, f"prompt[{i}]")})
        else:
            raise invalid(_PROMPT_SHAPE)
    return out


def _best_of(v: Any) -> Any:
    if v not in (None, 1):
        raise invalid("'best_of' must be 1 (use the best-of-n inferlet)", "unsupported_parameter")
    return v


def _refused(v: Any) -> Any:
    if v:
        raise invalid("'echo' and 'suffix' are not supported", "unsupported_parameter")
    return v


class CompletionRequest(_Request):
    """A ``/v1/completions`` body."""

    model_config = ConfigDict(extra="forbid")

    prompt: Annotated[list[dict[str, Any]], PlainValidator(_prompts)] = Field(default_factory=list, validate_default=True)
    logprobs: Annotated[int | None, integer(0, MAX_TOP_LOGPROBS[False])] = None
    best_of: Annotated[Any, PlainValidator(_best_of)] = None
    echo: Annotated[Any, PlainValidator(_refused)] = None
    suffix: Annotated[Any, PlainValidator(_refused)] = None

    @model_validator(mode="after")
    def _combinations(self) -> CompletionRequest:
        self._inferlet_args = self._build()  # checks the sampler fields against the rest
        return self

    def _build(self) -> dict[str, Any]:
        return {"model": self.model} | self._args(self.logprobs, (self.max_tokens, 16))  # the OpenAI default for completions is 16


class ParsedRequest(TypedDict):
    """A validated request (:func:`parse_request`)."""

    #: the inferlet args (for completions, without the prompt)
    args: dict[str, Any]
    #: completions: per-prompt args, ``{"prompt": str}`` or ``{"prompt_tokens": [int]}``; None for chat
    prompts: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool


def parse_request(body: Any, chat: bool, max_seq_len: int, vocab_size: int | None = None) -> ParsedRequest:
    """Validate an OpenAI request body (:class:`ChatRequest` or
    :class:`CompletionRequest`); returns ``{"args", "prompts", "stream",
    "include_usage"}``: the inferlet args, and for completions the list of
    per-prompt args (``{"prompt": str}`` or ``{"prompt_tokens": [int]}``;
    None for chat). ``max_tokens`` is checked against ``max_seq_len``, token
    ids and ``logit_bias`` keys against ``vocab_size`` when given.

    Raises:
        ApiError: 400 naming the offending parameter (:func:`.openai_errors.validation_error`).
    """
    model: type[ChatRequest | CompletionRequest] = ChatRequest if chat else CompletionRequest
    try:
        req = model.model_validate(body, context={"max_seq_len": max_seq_len, "vocab_size": vocab_size})
    except ValidationError as e:
        raise validation_error(e, UNSUPPORTED) from None
    prompts = req.prompt if isinstance(req, CompletionRequest) else None
    return {"args": req.inferlet_args(), "prompts": prompts, "stream": bool(req.stream), "include_usage": req.stream_options}
