"""The OpenAI-compatible request protocol: what ``/v1/chat/completions``
and ``/v1/completions`` (and the Responses routes, for their shared parts)
accept and how each parameter is checked (an HTTP 400 naming the ``param``),
the prompt-length check, tools and ``response_format``. No routes here
(:mod:`.openai_api`)."""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, TypedDict

from starlette.requests import Request

from ..host.grammar import Matcher
from ..protocol import ProtocolError, parse_json
from ..sdk.chat_transcript import ChatTranscript
from ..sdk.errors import GrammarError
from ..sdk.tools import ToolFormat, ToolSpecError, detect_format, normalize_tools, render_with, tool_names, uses_tools
from .limits_config import LimitsConfig

if TYPE_CHECKING:
    from ..engine.core.engine import Engine
from .openai_errors import ApiError, bad_param
from .openai_sampling import SAMPLER_FIELDS, parse_sampler_fields

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos"} | SAMPLER_FIELDS


CHAT_PARAMS = _COMMON | {
    "messages", "max_completion_tokens", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
    "response_format", "metadata", "store", "logit_bias", "tools", "tool_choice", "parallel_tool_calls",
}


COMPLETION_PARAMS = _COMMON | {
    "response_format", "prompt", "frequency_penalty", "presence_penalty", "logprobs", "echo", "best_of", "suffix", "logit_bias",
}


#: Tool-calling parameters (chat only).
TOOL_PARAMS = {"tools", "tool_choice", "parallel_tool_calls"}


#: Known OpenAI parameters and why they are refused.
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


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad_param(f"'{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad_param(f"{where}.content must be a string or a list of text parts (images and audio are not supported)", where)


class ParsedRequest(TypedDict):
    """A validated request (:func:`parse_request`)."""

    #: the inferlet args (for completions, without the prompt)
    args: dict[str, Any]
    #: completions: per-prompt args, ``{"prompt": str}`` or ``{"prompt_tokens": [int]}``; None for chat
    prompts: list[dict[str, Any]] | None
    stream: bool
    include_usage: bool


def parse_request(body: Any, chat: bool, max_seq_len: int, vocab_size: int | None = None) -> ParsedRequest:
    """Validate an OpenAI request body; returns ``{"args", "prompts",
    "stream", "include_usage"}``: the inferlet args, and for completions the
    list of per-prompt args (``{"prompt": str}`` or ``{"prompt_tokens":
    [int]}``; None for chat). Token ids and ``logit_bias`` keys are checked
    against ``vocab_size`` when given.

    Raises:
        ApiError: 400 naming the offending parameter.
    """
    if not isinstance(body, dict):
        raise bad_param("the request body must be a JSON object")
    allowed = CHAT_PARAMS if chat else COMPLETION_PARAMS
    for key in body:
        if key in UNSUPPORTED and not (chat and key in TOOL_PARAMS):
            raise bad_param(f"unsupported parameter '{key}': {UNSUPPORTED[key]}", key, "unsupported_parameter")
        if key not in allowed:
            raise bad_param(f"unsupported parameter '{key}'", key, "unsupported_parameter")
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N):
        raise bad_param(f"'n' must be an integer in [1, {MAX_N}], got {n!r}", "n")
    if body.get("best_of") not in (None, 1):
        raise bad_param("'best_of' must be 1 (use the best-of-n inferlet)", "best_of", "unsupported_parameter")
    top_n = parse_logprobs(body, chat)
    if body.get("echo") or body.get("suffix"):
        raise bad_param("'echo' and 'suffix' are not supported", "echo" if body.get("echo") else "suffix", "unsupported_parameter")
    rf = parse_response_format(body.get("response_format"))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("'model' is required (see GET /v1/models)", "model", "missing_required_parameter")
    args: dict[str, Any] = {"model": model}
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise bad_param("'messages' must be a non-empty list", "messages")
        args["messages"] = parse_messages(msgs)
        prompts = None
        parse_tools(body, args)
        forced = isinstance(args.get("tool_choice"), dict) or args.get("tool_choice") == "required"
        if forced and top_n is not None:
            raise bad_param("'logprobs' cannot be combined with a forced tool call (tool_choice required or named)", "logprobs", "unsupported_parameter")
        if rf is not None and args.get("tools") and args.get("tool_choice") != "none":
            raise bad_param("'response_format' cannot be combined with 'tools' unless tool_choice is 'none'", "response_format", "unsupported_parameter")
    else:
        prompts = parse_prompts(body.get("prompt"), vocab_size)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(key)
    if mt is None:
        mt = 256 if chat else 16  # the OpenAI default for completions is 16
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= max_seq_len:
        raise bad_param(f"'{key}' must be an integer in [1, {max_seq_len}], got {mt!r}", key)
    args["max_tokens"] = mt
    args["temperature"] = _number(body, "temperature", 0.0, 2.0, 0.0)
    args["top_p"] = _number(body, "top_p", 0.0, 1.0, 1.0)
    if args["top_p"] == 0.0:
        raise bad_param("'top_p' must be > 0", "top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_param("'seed' must be an integer", "seed")
    args["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop)):
        raise bad_param("'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    args["stop"] = stop
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: generate exactly max_tokens
    if not isinstance(ignore_eos, bool):
        raise bad_param("'ignore_eos' must be a boolean", "ignore_eos")
    args["ignore_eos"] = ignore_eos
    if rf is not None:
        args["response_format"] = rf
    for key in ("presence_penalty", "frequency_penalty"):
        v = _number(body, key, -2.0, 2.0, 0.0)
        if v:
            args[key] = v
    bias = parse_logit_bias(body.get("logit_bias"), vocab_size)
    if bias:
        args["logit_bias"] = bias
    if n is not None and n > 1:
        args["n"] = n
    if top_n is not None:
        args["logprobs"] = top_n
    parse_sampler_fields(body, args)  # llama.cpp's min_p, typical_p, mirostat, dry_*, xtc_*
    so = body.get("stream_options") or {}
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise bad_param("'stream_options' supports only include_usage", "stream_options")
    return {"args": args, "prompts": prompts, "stream": bool(body.get("stream")), "include_usage": bool(so.get("include_usage"))}


def parse_messages(msgs: list[Any]) -> list[dict[str, Any]]:
    """Chat messages in the inferlet's shape: ``developer`` becomes
    ``system``; an assistant message may carry ``tool_calls`` (then its
    content may be null), a ``tool`` message needs ``tool_call_id``.

    Raises:
        ApiError: 400 naming the message (``messages[i]...``).
    """
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_param(f"{where}.role must be system, developer, user, assistant or tool", f"{where}.role")
        role = "system" if m["role"] == "developer" else m["role"]
        calls = m.get("tool_calls") if role == "assistant" else None
        if calls is not None:
            if not isinstance(calls, list):
                raise bad_param(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
            msg: dict[str, Any] = {"role": role, "content": None if m.get("content") is None else _text(m["content"], where)}
            if calls:
                msg["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            elif msg["content"] is None:
                msg["content"] = ""
        else:
            msg = {"role": role, "content": _text(m.get("content"), where)}
        if role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise bad_param(f"{where}.tool_call_id is required for role 'tool' (the id of the call it answers)", f"{where}.tool_call_id")
            msg["tool_call_id"] = cid
        out.append(msg)
    return out


def is_json_object_text(value: Any) -> bool:
    """Whether ``value`` is a string holding a JSON object (how OpenAI
    passes a tool call's ``arguments``)."""
    try:
        return isinstance(value, str) and isinstance(json.loads(value), dict)
    except ValueError:
        return False


def _tool_call(c: Any, where: str) -> dict[str, Any]:
    if not isinstance(c, dict) or c.get("type", "function") != "function" or not isinstance(c.get("function"), dict):
        raise bad_param(f"{where} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", where)
    fn = c["function"]
    cid = c.get("id")
    if not isinstance(cid, str) or not cid:
        raise bad_param(f"{where}.id must be a non-empty string", f"{where}.id")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_param(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if not is_json_object_text(args):
        raise bad_param(f"{where}.function.arguments must be a JSON object as a string, got {args!r:.80}", f"{where}.function.arguments")
    return {"id": cid, "type": "function", "function": {"name": fn["name"], "arguments": args}}


def parse_tools(body: dict[str, Any], args: dict[str, Any]) -> None:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` into
    ``args`` (``tools``: normalized list; ``tool_choice``: ``auto``,
    ``none``, ``required`` or ``{"name": str}``).

    Raises:
        ApiError: 400 naming the parameter (``tools[0].function.name``, ``tool_choice``, ...).
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad_param("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_param("'tool_choice' is only allowed when 'tools' are specified", "tool_choice")
        return
    try:
        args["tools"] = normalize_tools(tools)
    except ToolSpecError as e:
        raise bad_param(str(e), e.param) from None
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or set(choice) - {"type", "function"}:
            raise bad_param("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}", "tool_choice")
        if fn["name"] not in tool_names(args["tools"]):
            raise bad_param(f"tool_choice names {fn['name']!r}, which is not in 'tools' ({', '.join(tool_names(args['tools']))})", "tool_choice")
        choice = {"name": fn["name"]}
    elif choice not in ("none", "auto", "required"):
        raise bad_param(f"'tool_choice' must be 'none', 'auto', 'required' or a named function, got {choice!r}", "tool_choice")
    args["tool_choice"] = choice


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


#: The most prompts one ``/v1/completions`` request may carry.
MAX_PROMPTS = 64


#: The most choices (``n``) one request may ask for.
MAX_N = 16


#: The most alternatives per token: ``top_logprobs`` (chat) and ``logprobs`` (completions).
MAX_TOP_LOGPROBS = {True: 20, False: 5}


def parse_logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many alternatives per token to report, or None for no logprobs:
    chat's ``logprobs`` (bool) and ``top_logprobs`` (0..20, needs
    ``logprobs``), completions' ``logprobs`` (0..5).

    Raises:
        ApiError: 400 naming the bad parameter.
    """
    cap = MAX_TOP_LOGPROBS[chat]
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if chat:
        if lp is not None and not isinstance(lp, bool):
            raise bad_param(f"'logprobs' must be a boolean, got {lp!r}", "logprobs")
        if top is not None:
            if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= cap:
                raise bad_param(f"'top_logprobs' must be an integer in [0, {cap}], got {top!r}", "top_logprobs")
            if not lp:
                raise bad_param("'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
        return (top or 0) if lp else None
    if lp is None:
        return None
    if isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= cap:
        raise bad_param(f"'logprobs' must be an integer in [0, {cap}], got {lp!r}", "logprobs")
    return lp


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


def _token_ids(ids: list[Any], vocab_size: int | None, where: str) -> list[int]:
    if not ids:
        raise bad_param(f"{where} must not be empty", "prompt")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            raise bad_param(f"{where}: token id {t!r} is outside the vocabulary [0, {vocab_size})", "prompt")
    return list(ids)


def parse_prompts(prompt: Any, vocab_size: int | None) -> list[dict[str, Any]]:
    """The prompts of a completions request: a string, a list of strings, a
    list of token ids or a list of token-id lists; one args dict each
    (``{"prompt": str}`` or ``{"prompt_tokens": [int]}``).

    Raises:
        ApiError: 400 (``param`` ``prompt``) for any other shape, an empty
            prompt, an id outside the vocabulary or more than
            :data:`MAX_PROMPTS` prompts.
    """
    shape = "'prompt' must be a string, a list of strings, a list of token ids or a list of token-id lists"
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt:
        items = prompt
    else:
        raise bad_param(shape, "prompt")
    if len(items) > MAX_PROMPTS:
        raise bad_param(f"at most {MAX_PROMPTS} prompts per request, got {len(items)}", "prompt")
    out: list[dict[str, Any]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if not p:
                raise bad_param(f"prompt[{i}] must not be empty", "prompt")
            out.append({"prompt": p})
        elif isinstance(p, list):
            out.append({"prompt_tokens": _token_ids(p, vocab_size, f"prompt[{i}]")})
        else:
            raise bad_param(shape, "prompt")
    return out


def parse_logit_bias(bias: Any, vocab_size: int | None) -> dict[str, float]:
    """OpenAI's ``logit_bias``: token id (a decimal string in JSON) -> bias
    in [-100, 100]; zero biases are dropped.

    Raises:
        ApiError: 400 (``param`` ``logit_bias``) for a bad key or value.
    """
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise bad_param("'logit_bias' must be an object mapping token ids to biases in [-100, 100]", "logit_bias")
    out = {}
    for k, v in bias.items():
        if not (isinstance(k, str) and k.isdigit()) or (vocab_size is not None and int(k) >= vocab_size):
            raise bad_param(f"logit_bias key {k!r} is not a token id in [0, {vocab_size})", "logit_bias")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not -100 <= v <= 100:
            raise bad_param(f"logit_bias[{k!r}] must be a number in [-100, 100], got {v!r}", "logit_bias")
        if v:
            out[str(int(k))] = float(v)
    return out


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
