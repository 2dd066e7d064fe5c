"""The OpenAI Responses API's shapes: request validation (Responses items ->
the chat messages the ``openai-responses`` inferlet renders) and the
response objects and stream events it answers with. No I/O here: the route
is :mod:`tartlet.server.responses_api`.

Input items understood (OpenAI's Responses reference): a string (one user
message); ``{"role": "user" | "system" | "developer" | "assistant",
"content": str | [{"type": "input_text" | "output_text", "text"}]}`` (with or
without ``"type": "message"``); ``{"type": "function_call", "call_id",
"name", "arguments"}`` (consecutive calls become one assistant message with
``tool_calls``); ``{"type": "function_call_output", "call_id", "output"}``
(a ``tool`` message). Tools are ``{"type": "function", "name",
"description", "parameters", "strict"}``; ``tool_choice`` is ``"auto"``,
``"none"``, ``"required"`` or ``{"type": "function", "name"}``;
``text.format`` is ``{"type": "text" | "json_object"}`` or ``{"type":
"json_schema", "name", "schema", "strict"}``. Anything else is an HTTP 400
naming the parameter (the body is the pydantic model :class:`ResponsesBody`;
the items, tools and ``text`` are checked by this module's parsers).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, NamedTuple, TypedDict

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, ValidationError

from .openai_errors import PARAM, ApiError, bad_param, validation_error
from .openai_fields import boolean, checked_by, integer, invalid, non_empty_string, nucleus, number
from .openai_models import parse_tools
from .openai_protocol import is_json_object_text, parse_response_format


class ResponsesRequest(TypedDict):
    """A validated ``POST /v1/responses`` body (:func:`parse_request`)."""

    model: str
    #: chat messages of this request's input (after the previous response's conversation)
    messages: list[dict[str, Any]]
    instructions: str | None
    #: inferlet args besides messages and snapshots: tools, tool_choice, max_tokens, ignore_eos, temperature, top_p, seed, response_format
    args: dict[str, Any]
    #: the request's tools in the Responses shape (echoed in the response object)
    tools: list[dict[str, Any]]
    tool_choice: Any
    text_format: dict[str, Any]
    stream: bool
    store: bool
    previous_response_id: str | None
    metadata: dict[str, str]
    #: this request's ``input`` as Responses items with ids (``GET /v1/responses/{id}/input_items``)
    input_items: list[dict[str, Any]]


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise bad_param(f"{where}.content[{j}] must be an input_text or output_text part (images, files and audio are not supported)",
                           f"{where}.content")
            out.append(part["text"])
        return "".join(out)
    raise bad_param(f"{where}.content must be a string or a list of text parts", f"{where}.content")


def input_messages(items: Any) -> list[dict[str, Any]]:
    """Chat messages of a Responses ``input`` (a string or a list of items).

    Raises:
        ApiError: 400 naming the item (``input[i]...``).
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad_param("'input' must be a string or a non-empty list of items", "input")
    out: list[dict[str, Any]] = []
    for i, it in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad_param(f"{where} must be an object", where)
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_param(f"{where}.role must be user, system, developer or assistant", f"{where}.role")
            out.append({"role": "system" if role == "developer" else role, "content": _content_text(it.get("content"), where)})
        elif kind == "function_call":
            cid, name, arguments = it.get("call_id"), it.get("name"), it.get("arguments", "{}")
            if not isinstance(cid, str) or not cid or not isinstance(name, str) or not name:
                raise bad_param(f"{where} (function_call) needs 'call_id' and 'name' strings", where)
            if not is_json_object_text(arguments):
                raise bad_param(f"{where}.arguments must be a JSON object as a string", f"{where}.arguments")
            call = {"id": cid, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            cid, output = it.get("call_id"), it.get("output")
            if not isinstance(cid, str) or not cid:
                raise bad_param(f"{where}.call_id must be a non-empty string", f"{where}.call_id")
            if not isinstance(output, str):
                output = json.dumps(output)
            out.append({"role": "tool", "content": output, "tool_call_id": cid})
        else:
            raise bad_param(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output)", f"{where}.type",
                       "unsupported_parameter")
    return out


def input_item_objects(items: Any) -> list[dict[str, Any]]:
    """A validated ``input`` (:func:`input_messages` accepted it) as the
    items ``GET /v1/responses/{id}/input_items`` lists, in OpenAI's shapes:
    messages with ``input_text`` parts (``output_text`` for assistant
    messages), ``function_call`` and ``function_call_output`` items, each
    with an ``id`` (the client's, else a new one) and ``status``."""
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    out = []
    for it in items:
        kind = it.get("type", "message")
        if kind == "message":
            part = "output_text" if it["role"] == "assistant" else "input_text"
            content = it["content"]
            parts = ([{"type": part, "text": content}] if isinstance(content, str)
                     else [{"type": p["type"] if p["type"] != "text" else part, "text": p["text"]} for p in content])
            out.append({"type": "message", "id": it.get("id") or new_id("msg"), "role": it["role"], "content": parts,
                        "status": "completed"})
        elif kind == "function_call":
            out.append(function_call_item(it.get("id") or new_id("fc"), it["call_id"], it["name"], it.get("arguments", "{}")))
        else:
            output = it["output"] if isinstance(it["output"], str) else json.dumps(it["output"])
            out.append({"type": "function_call_output", "id": it.get("id") or new_id("fco"), "call_id": it["call_id"],
                        "output": output, "status": "completed"})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_param("'tools' must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_param(f"tools[{i}].type must be 'function' (built-in tools are not supported)", f"tools[{i}].type", "unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t and t[k] is not None}
        out.append({"type": "function", "function": fn})
    return out


def _text_format(text: Any) -> dict[str, Any] | None:
    """The chat ``response_format`` of ``text.format`` (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_param("'text' must be {'format': {...}}", "text")
    fmt = text.get("format")
    if fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"):
        return None
    if not isinstance(fmt, dict):
        raise bad_param("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        js = {k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}
        rf = {"type": "json_schema", "json_schema": js}
    else:
        rf = dict(fmt)
    try:
        return parse_response_format(rf)
    except ApiError as e:
        e.param = (e.param or "").replace("response_format.json_schema", "text.format").replace("response_format", "text.format")
        raise


def _null_only(*allowed: Any) -> PlainValidator:
    """A field accepted only null or at its default (what SDKs send)."""

    def check(v: Any) -> Any:
        if v not in allowed:
            raise invalid(f"{PARAM} is not supported", "unsupported_parameter")
        return v

    return PlainValidator(check)


class _Input(NamedTuple):
    #: the chat messages of ``input``
    messages: list[dict[str, Any]]
    #: ``input`` as Responses items with ids (``GET /v1/responses/{id}/input_items``)
    items: list[dict[str, Any]]


def _input(items: Any) -> _Input:
    return _Input(input_messages(items), input_item_objects(items))


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and (choice.get("type") != "function" or not isinstance(choice.get("name"), str)):
        raise invalid("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")
    return choice


def _instructions(v: Any) -> str | None:
    if v is not None and not isinstance(v, str):
        raise invalid(f"{PARAM} must be a string")
    return v


def _response_id(v: Any) -> str | None:
    if v is not None and (not isinstance(v, str) or not v):
        raise invalid(f"{PARAM} must be a response id")
    return v


def _metadata(v: Any) -> dict[str, str]:
    metadata = v or {}
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(isinstance(k, str) and isinstance(x, str) for k, x in metadata.items()):
        raise invalid(f"{PARAM} must map at most 16 string keys to strings")
    return metadata


class ResponsesBody(BaseModel):
    """A ``POST /v1/responses`` body (:mod:`.openai_fields`): any key not
    here is a 400 ``unsupported_parameter``, and so is a value other than
    null or the default for ``include``, ``truncation``, ``service_tier``,
    ``top_logprobs`` and ``reasoning``; ``user``, ``prompt_cache_key``,
    ``safety_identifier`` and ``stream_options`` are accepted and unused."""

    model_config = ConfigDict(extra="forbid")

    model: Annotated[str, non_empty_string("is required (see GET /v1/models)", "missing_required_parameter")] = Field(
        "", validate_default=True,
    )
    input: Annotated[_Input, checked_by(_input)] = Field(None, validate_default=True)
    instructions: Annotated[str | None, PlainValidator(_instructions)] = None
    #: the chat shape (``{"type": "function", "function": {...}}``), checked with ``tool_choice`` by :func:`.openai_models.parse_tools`
    tools: Annotated[list[dict[str, Any]], checked_by(_tools)] = Field(default_factory=list)
    tool_choice: Annotated[Any, PlainValidator(_tool_choice)] = None
    parallel_tool_calls: Any = None
    #: the chat ``response_format`` of ``text.format`` (None: plain text)
    text: Annotated[dict[str, Any] | None, checked_by(_text_format)] = None
    max_output_tokens: Annotated[int | None, integer(1, hi_from="max_seq_len")] = None
    #: the chat route's (vLLM's) extension: generate exactly max_output_tokens
    ignore_eos: Annotated[bool | None, boolean] = None
    temperature: Annotated[float | None, number(0.0, 2.0)] = None
    top_p: Annotated[float | None, nucleus()] = None
    seed: Annotated[int | None, integer()] = None
    previous_response_id: Annotated[str | None, PlainValidator(_response_id)] = None
    store: Annotated[bool | None, boolean] = None
    stream: Annotated[bool | None, boolean] = None
    metadata: Annotated[dict[str, str], PlainValidator(_metadata)] = Field(default_factory=dict)
    include: Annotated[Any, _null_only(None, [])] = None
    truncation: Annotated[Any, _null_only(None, "disabled")] = None
    service_tier: Annotated[Any, _null_only(None, "auto", "default")] = None
    top_logprobs: Annotated[Any, _null_only(None, 0)] = None
    reasoning: Annotated[Any, _null_only(None, {})] = None
    user: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    stream_options: Any = None


def parse_request(body: Any, max_seq_len: int) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body (:class:`ResponsesBody`, its
    tools as the chat route's, :func:`.openai_models.parse_tools`).

    Raises:
        ApiError: 400 naming the parameter (:func:`.openai_errors.validation_error`).
    """
    try:
        b = ResponsesBody.model_validate(body, context={"max_seq_len": max_seq_len})
    except ValidationError as e:
        raise validation_error(e) from None
    choice = b.tool_choice
    chat_choice = {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice
    args: dict[str, Any] = {}
    parse_tools({"tools": b.tools or None, "tool_choice": chat_choice, "parallel_tool_calls": b.parallel_tool_calls}, args)
    rf = b.text
    if rf is not None:
        if args.get("tools") and args.get("tool_choice") != "none":
            raise bad_param("'text.format' cannot be combined with 'tools' unless tool_choice is 'none'", "text.format", "unsupported_parameter")
        args["response_format"] = rf
    args["max_tokens"] = b.max_output_tokens if b.max_output_tokens is not None else 256
    args["ignore_eos"] = bool(b.ignore_eos)
    args["temperature"] = b.temperature if b.temperature is not None else 0.0
    args["top_p"] = b.top_p if b.top_p is not None else 1.0
    args["seed"] = b.seed
    text_format = {"type": "text"} if rf is None else body["text"]["format"]
    return {
        "model": b.model, "messages": b.input.messages, "instructions": b.instructions, "args": args,
        "tools": [dict(t, strict=t.get("strict", True)) for t in (body.get("tools") or [])],
        "tool_choice": choice if choice is not None else "auto", "text_format": text_format,
        "stream": bool(b.stream), "store": b.store is not False,
        "previous_response_id": b.previous_response_id, "metadata": b.metadata, "input_items": b.input.items,
    }


def new_id(prefix: str) -> str:
    """``prefix_`` + 48 hex digits (``resp``, ``msg``, ``fc``)."""
    return f"{prefix}_{uuid.uuid4().hex}{uuid.uuid4().hex[:16]}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments, "status": status}


def response_object(
    rid: str, req: ResponsesRequest, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
    created: float | None = None, incomplete: str | None = None,
) -> dict[str, Any]:
    """The ``response`` object (OpenAI's shape) of request ``req``."""
    return {
        "id": rid, "object": "response", "created_at": int(created or time.time()), "status": status,
        "error": None, "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": req["instructions"], "max_output_tokens": req["args"]["max_tokens"], "model": req["model"],
        "output": output, "parallel_tool_calls": True, "previous_response_id": req["previous_response_id"],
        "reasoning": {"effort": None, "summary": None}, "store": req["store"],
        "temperature": req["args"]["temperature"], "text": {"format": req["text_format"]},
        "tool_choice": req["tool_choice"], "tools": req["tools"], "top_p": req["args"]["top_p"],
        "truncation": "disabled", "usage": usage, "user": None, "metadata": req["metadata"],
    }


def usage_object(prompt: int, cached: int, completion: int) -> dict[str, Any]:
    """``usage``: ``input_tokens`` (the whole prompt), of which
    ``input_tokens_details.cached_tokens`` came from the previous
    response's snapshot (not computed again)."""
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def sse(event: dict[str, Any]) -> str:
    """One server-sent event: ``event: TYPE`` + ``data: JSON``."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
