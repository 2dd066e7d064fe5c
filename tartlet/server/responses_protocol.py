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
naming the parameter.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, TypedDict

from .openai_errors import ApiError, bad_param
from .openai_protocol import is_json_object_text, parse_response_format, parse_tools

#: Request fields accepted. Those in IGNORED are accepted and have no effect here.
FIELDS = {
    "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "stream", "store",
    "previous_response_id", "max_output_tokens", "temperature", "top_p", "seed", "user", "metadata",
    "include", "truncation", "service_tier", "top_logprobs", "prompt_cache_key", "safety_identifier", "stream_options",
    "reasoning", "ignore_eos",
}
#: Accepted with any value but null or their default only (what SDKs send by default).
NULL_ONLY: dict[str, tuple[Any, ...]] = {"include": (None, []), "truncation": (None, "disabled"), "service_tier": (None, "auto", "default"),
             "top_logprobs": (None, 0), "reasoning": (None, {})}


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


def parse_request(body: Any, max_seq_len: int) -> ResponsesRequest:
    """Validate a ``POST /v1/responses`` body.

    Raises:
        ApiError: 400 naming the parameter.
    """
    if not isinstance(body, dict):
        raise bad_param("the request body must be a JSON object")
    for k, v in body.items():
        if k not in FIELDS:
            raise bad_param(f"unsupported parameter '{k}'", k, "unsupported_parameter")
        if k in NULL_ONLY and v not in NULL_ONLY[k]:
            raise bad_param(f"'{k}' is not supported", k, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_param("'model' is required (see GET /v1/models)", "model", "missing_required_parameter")
    messages = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_param("'instructions' must be a string", "instructions")
    args: dict[str, Any] = {}
    chat_tools = _tools(body.get("tools"))
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_param("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")
        chat_choice: Any = {"type": "function", "function": {"name": choice["name"]}}
    else:
        chat_choice = choice
    parse_tools({"tools": chat_tools or None, "tool_choice": chat_choice, "parallel_tool_calls": body.get("parallel_tool_calls")}, args)
    rf = _text_format(body.get("text"))
    if rf is not None:
        if args.get("tools") and args.get("tool_choice") != "none":
            raise bad_param("'text.format' cannot be combined with 'tools' unless tool_choice is 'none'", "text.format", "unsupported_parameter")
        args["response_format"] = rf
    mt = body.get("max_output_tokens")
    if mt is None:
        mt = 256
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= max_seq_len:
        raise bad_param(f"'max_output_tokens' must be an integer in [1, {max_seq_len}], got {mt!r}", "max_output_tokens")
    args["max_tokens"] = mt
    ignore_eos = body.get("ignore_eos", False)  # the chat route's (vLLM's) extension: generate exactly max_output_tokens
    if not isinstance(ignore_eos, bool):
        raise bad_param("'ignore_eos' must be a boolean", "ignore_eos")
    args["ignore_eos"] = ignore_eos
    for key, lo, hi, default in (("temperature", 0.0, 2.0, 0.0), ("top_p", 0.0, 1.0, 1.0)):
        v = body.get(key)
        if v is None:
            v = default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi or (key == "top_p" and v == 0):
            raise bad_param(f"'{key}' must be a number in [{lo:g}, {hi:g}]" + (" above 0" if key == "top_p" else ""), key)
        args[key] = float(v)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad_param("'seed' must be an integer", "seed")
    args["seed"] = seed
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not prev):
        raise bad_param("'previous_response_id' must be a response id", "previous_response_id")
    store = body.get("store", True)
    stream = body.get("stream", False)
    if not isinstance(store, bool) or not isinstance(stream, bool):
        raise bad_param("'store' and 'stream' must be booleans", "store" if not isinstance(store, bool) else "stream")
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > 16 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise bad_param("'metadata' must map at most 16 string keys to strings", "metadata")
    text_format = {"type": "text"} if rf is None else body["text"]["format"]
    return {
        "model": model, "messages": messages, "instructions": instructions, "args": args,
        "tools": [dict(t, strict=t.get("strict", True)) for t in (body.get("tools") or [])],
        "tool_choice": choice if choice is not None else "auto", "text_format": text_format, "stream": stream, "store": store,
        "previous_response_id": prev, "metadata": metadata, "input_items": input_item_objects(body["input"]),
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
