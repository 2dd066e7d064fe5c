"""The OpenAI-compatible request protocol beside the request models
(:mod:`.openai_models`): the request body read, ``response_format``'s
shape (shared with the Responses route's ``text.format``), the tools' and
response format's grammars compiled, the prompt-length check and the
``logprobs`` objects. No routes here (:mod:`.openai_api`)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from starlette.requests import Request

from ..host.grammar import Matcher
from ..protocol import ProtocolError, parse_json
from ..sdk.chat_transcript import ChatTranscript
from ..sdk.errors import GrammarError
from ..sdk.tools import ToolFormat, detect_format, render_with, uses_tools
from .limits_config import LimitsConfig

if TYPE_CHECKING:
    from ..engine.core.engine import Engine
from .openai_errors import ApiError, bad_param


def is_json_object_text(value: Any) -> bool:
    """Whether ``value`` is a string holding a JSON object (how OpenAI
    passes a tool call's ``arguments``)."""
    try:
        return isinstance(value, str) and isinstance(json.loads(value), dict)
    except ValueError:
        return False


_tool_formats: dict[str, ToolFormat] = {}


def chat_tool_format(tokenizer: Any) -> ToolFormat:
    """The tool format of ``tokenizer``'s chat template (probed once per
    template text; see :func:`tartlet.sdk.tools.detect_format`)."""
    src = tokenizer.chat_template or ""
    fmt = _tool_formats.get(src)
    if fmt is None:
        fmt = _tool_formats[src] = detect_format(lambda m, agp, t: tokenizer.apply_chat_template(m, add_generation_prompt=agp, tools=t))
    return fmt


def check_tools(engine: Engine, args: dict[str, Any]) -> None:
    """Compile each tool's ``parameters`` schema for ``engine``'s tokenizer
    and, for a forced call, the call grammar the inferlet will use (cached,
    so the inferlet's own compile is a copy).

    Raises:
        ApiError: 400 ``invalid_json_schema`` naming ``tools[i].function.parameters``.
    """
    tools = args.get("tools")
    if not tools:
        return
    for i, t in enumerate(tools):
        try:
            Matcher.compile(engine, "json_schema", t["function"]["parameters"]).close()
        except GrammarError as e:
            raise bad_param(f"invalid tools[{i}].function.parameters: {e}", f"tools[{i}].function.parameters", "invalid_json_schema") from None
    choice = args.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        fmt = chat_tool_format(engine.tokenizer)
        text = fmt.grammar(tools, choice["name"] if isinstance(choice, dict) else None)
        try:
            Matcher.compile(engine, "grammar", text).close()
        except GrammarError as e:
            raise bad_param(f"the tools' schemas cannot be combined into a call grammar: {e}", "tools", "invalid_json_schema") from None


def format_logprobs(entries: list[dict[str, Any]] | None, chat: bool, offset: int = 0) -> dict[str, Any] | None:
    """The OpenAI ``logprobs`` object of a choice (or of a stream chunk) from
    the inferlet's entries (``{"token", "logprob", "top": [[str, float]]}``):
    chat's ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal"}``
    or completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``
    (``offset``: where the first token starts in the choice's text)."""
    if entries is None:
        return None
    if chat:
        def item(t: str, v: float) -> dict[str, Any]:
            return {"token": t, "logprob": v, "bytes": list(t.encode())}

        content = [dict(item(e["token"], e["logprob"]), top_logprobs=[item(t, v) for t, v in e["top"]]) for e in entries]
        return {"content": content, "refusal": None}
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [dict((t, v) for t, v in e["top"]) for e in entries],
        "text_offset": offsets,
    }


def prompt_length(tokenizer: Any, job: dict[str, Any]) -> int:
    """How many tokens the ``openai-completion`` inferlet fills for ``job``
    (its ``messages``, ``prompt`` or ``prompt_tokens``), computed the way
    the SDK's :class:`~tartlet.sdk.context.Context` fills them, with the same
    :class:`~tartlet.sdk.chat_transcript.ChatTranscript`: the chat template
    rendered message by message (each new part tokenized on its own, a
    rewritten part refilled), then the assistant header; BOS first where
    the model asks for one."""
    if "prompt_tokens" in job:
        return len(job["prompt_tokens"])
    bos = tokenizer.bos_token_id
    add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and bos is not None
    n = 0

    def fill(text: str) -> None:
        nonlocal n
        ids = tokenizer.encode(text)
        if add_bos and n == 0 and ids[:1] != [bos]:
            n += 1
        n += len(ids)

    if "prompt" in job:
        fill(job["prompt"])
        return n
    tools = job.get("tools") if job.get("tool_choice", "auto") != "none" else None
    fmt = chat_tool_format(tokenizer) if uses_tools(job["messages"], tools) else None
    msgs: list[dict[str, Any]] = []
    chat = ChatTranscript()  # the very bookkeeping Context uses, over a token count

    def tok_render(m: list[dict[str, Any]], agp: bool, t: list[dict[str, Any]] | None) -> str:
        text: str = tokenizer.apply_chat_template(m, add_generation_prompt=agp, tools=t)
        return text

    def render(gen_prompt: bool) -> None:
        nonlocal n
        r = render_with(tok_render, fmt, msgs, gen_prompt, tools)
        n, text = chat.refill(r, n)
        fill(text)
        chat.filled(r, n)

    for m in job["messages"]:
        msgs.append(m)
        render(False)
    if msgs[-1]["role"] != "assistant":
        render(True)
    return n


#: OpenAI's rule for ``json_schema.name``.
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def parse_response_format(rf: Any) -> dict[str, Any] | None:
    """Validate an OpenAI ``response_format`` (shape only; the schema itself
    is compiled by :func:`constraint_spec` + :meth:`Matcher.compile`).

    Returns:
        None for no constraint (absent, null or ``{"type": "text"}``);
        ``{"type": "json_object"}``; or ``{"type": "json_schema",
        "json_schema": {"name": str, "schema": dict | bool | None, "strict":
        bool}}`` (``schema`` None: any JSON value), the form the
        ``openai-completion`` inferlet takes.

    Raises:
        ApiError: 400 with ``param`` naming the bad field (unknown type,
            missing or malformed ``json_schema``, bad ``name``/``strict``).
    """
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise bad_param(f"'response_format' must be an object like {{'type': 'json_schema', ...}}, got {type(rf).__name__}", "response_format")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_param(
            f"response_format type {kind!r} is not supported (supported: {', '.join(RESPONSE_FORMAT_TYPES)})",
            "response_format.type", "unsupported_parameter",
        )
    extra = set(rf) - {"type", "json_schema"} if kind == "json_schema" else set(rf) - {"type"}
    if extra:
        raise bad_param(f"unknown response_format field(s) for type {kind!r}: {', '.join(sorted(extra))}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise bad_param("response_format type 'json_schema' needs a 'json_schema' object with 'name' and 'schema'", "response_format.json_schema")
    unknown = set(js) - {"name", "description", "schema", "strict"}
    if unknown:
        raise bad_param(f"unknown response_format.json_schema field(s): {', '.join(sorted(unknown))}", "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise bad_param(f"response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}", "response_format.json_schema.name")
    schema = js.get("schema")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise bad_param(f"response_format.json_schema.schema must be a JSON Schema object, got {type(schema).__name__}", "response_format.json_schema.schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_param(f"response_format.json_schema.strict must be a boolean, got {strict!r}", "response_format.json_schema.strict")
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": bool(strict)}}


def constraint_spec(rf: dict[str, Any]) -> tuple[str, Any]:
    """The grammar ``(kind, spec)`` for a response format returned by
    :func:`parse_response_format` (the kinds of :data:`tartlet.host.grammar.GRAMMAR_KINDS`):
    ``json_object`` is the schema ``{"type": "object"}``, ``json_schema``
    without a schema is any JSON value. The ``openai-completion`` inferlet
    applies the same mapping."""
    if rf["type"] == "json_object":
        return "json_schema", {"type": "object"}
    schema = rf["json_schema"]["schema"]
    return ("any_json", None) if schema is None else ("json_schema", schema)


def check_response_format(engine: Engine, rf: dict[str, Any]) -> None:
    """Compile ``rf``'s constraint for ``engine``'s tokenizer (cached, so the
    inferlet's own compile is a copy) and drop it.

    Raises:
        ApiError: 400 naming the problem: invalid JSON Schema, unsupported
            keyword, or a schema no output can satisfy (llguidance's message).
    """
    kind, spec = constraint_spec(rf)
    try:
        Matcher.compile(engine, kind, spec).close()
    except GrammarError as e:
        param = "response_format.json_schema.schema" if rf["type"] == "json_schema" else "response_format"
        raise bad_param(f"invalid response_format: {e}", param, "invalid_json_schema") from None


async def read_json_body(request: Request, limits: LimitsConfig) -> Any:
    """The request's JSON body, read up to ``limits.max_message_bytes``
    (checked against ``Content-Length`` first, then while streaming) and
    nested at most ``limits.max_json_depth`` deep.

    Raises:
        ApiError: 413 (too large), 400 (not UTF-8 JSON, or nested too deep).
    """
    cap = limits.max_message_bytes
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > cap):
        raise ApiError(413, f"the request body is larger than the limit of {cap} bytes ([limits] max_message_bytes)", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > cap:
            raise ApiError(413, f"the request body is larger than the limit of {cap} bytes ([limits] max_message_bytes)", code="request_too_large")
        chunks.append(chunk)
    try:
        return parse_json(b"".join(chunks), limits.max_json_depth)
    except ProtocolError as e:
        raise bad_param(f"the request body is not valid JSON: {e}", code="invalid_json") from None


def fit_context(jobs: list[dict[str, Any]], lengths: list[int], max_seq_len: int, chat: bool) -> None:
    """Check each job's prompt length (``lengths``, from
    :func:`prompt_length`) against the model's context and cap its
    ``max_tokens`` to the room left (the generation then ends with
    ``length``).

    Raises:
        ApiError: 400 ``context_length_exceeded`` (``param`` ``messages`` or
            ``prompt``) for a prompt that leaves no room for one token.
    """
    for i, (job, n) in enumerate(zip(jobs, lengths)):
        if n >= max_seq_len:
            which = "your messages" if chat else (f"prompt {i}" if len(jobs) > 1 else "your prompt")
            raise ApiError(
                400, f"This model's maximum context length is {max_seq_len} tokens. However, {which} resulted in {n} tokens. "
                "Please reduce the length of the messages or the prompt.",
                "messages" if chat else "prompt", "context_length_exceeded",
            )
        job["max_tokens"] = min(job["max_tokens"], max_seq_len - n)
