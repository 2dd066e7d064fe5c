"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``
and ``POST /v1/completions`` (streaming with server-sent events, or not).

Each request runs the ``openai-completion`` inferlet (next to this file), so
API requests batch with every other inferlet. Greedy requests
(``temperature`` 0, the default here) give exactly the ``text-completion``
inferlet's output for the same prompt. Request and response shapes follow
the OpenAI API reference (chat.completion, chat.completion.chunk,
text_completion objects; ``data: ...`` SSE frames ending with
``data: [DONE]``).

``response_format`` (chat and completions) constrains the output with the
SDK's constrained decoding (:mod:`tartlet.constraint`): ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`` gives JSON valid
against the schema, ``{"type": "json_object"}`` a JSON object, ``{"type":
"text"}`` no constraint. The schema is compiled here, before the inferlet is
launched, so an invalid or unsupported one is an HTTP 400 naming the problem
(the inferlet's compile then hits the grammar cache).

Parameters this server cannot honour (tools, logprobs, n > 1, penalties,
logit_bias, ...) are refused with HTTP 400 naming the parameter, never
silently ignored. A client that disconnects aborts its request's instance.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..host.grammar import GrammarError, Matcher
from ..runtime.instance import Status
from ..runtime.program import load_program
from .auth import AuthError
from .protocol import ProtocolError, parse_json
from .service import Service
from .ws import bearer

PROGRAM_DIR = Path(__file__).parent / "inferlets" / "openai-completion"

_COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user", "ignore_eos"}
CHAT_PARAMS = _COMMON | {
    "messages", "max_completion_tokens", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
    "response_format", "metadata", "store",
}
COMPLETION_PARAMS = _COMMON | {"response_format", "prompt", "frequency_penalty", "presence_penalty", "logprobs", "echo", "best_of", "suffix"}
#: Known OpenAI parameters and why they are refused.
UNSUPPORTED = {
    "tools": "tool calling is not supported by this server (run an agent inferlet instead)",
    "tool_choice": "tool calling is not supported by this server",
    "functions": "function calling is not supported by this server",
    "function_call": "function calling is not supported by this server",
    "logit_bias": "logit_bias is not supported (write an inferlet with a logit mask instead)",
    "parallel_tool_calls": "tool calling is not supported by this server",
    "audio": "audio output is not supported", "modalities": "only text output is supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "reasoning_effort is not supported",
    "web_search_options": "web search is not supported", "service_tier": "service tiers are not supported",
}


class ApiError(Exception):
    """An OpenAI-style error response."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def response(self) -> JSONResponse:
        body = {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


def _bad(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{key}' must be a number in [{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise _bad(f"{where}.content must be a string or a list of text parts (images and audio are not supported)", where)


def parse_request(body: Any, chat: bool, max_seq_len: int) -> dict[str, Any]:
    """Validate an OpenAI request body; returns the inferlet args plus
    ``stream`` / ``include_usage`` / ``model``.

    Raises:
        ApiError: 400 naming the offending parameter.
    """
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    allowed = CHAT_PARAMS if chat else COMPLETION_PARAMS
    for key in body:
        if key in UNSUPPORTED:
            raise _bad(f"unsupported parameter '{key}': {UNSUPPORTED[key]}", key, "unsupported_parameter")
        if key not in allowed:
            raise _bad(f"unsupported parameter '{key}'", key, "unsupported_parameter")
    if body.get("n") not in (None, 1):
        raise _bad("'n' must be 1: one choice per request is supported", "n", "unsupported_parameter")
    if body.get("best_of") not in (None, 1):
        raise _bad("'best_of' must be 1 (use the best-of-n inferlet)", "best_of", "unsupported_parameter")
    for key in ("frequency_penalty", "presence_penalty"):
        if body.get(key) not in (None, 0, 0.0):
            raise _bad(f"'{key}' is not supported (only 0)", key, "unsupported_parameter")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise _bad("'logprobs' is not supported", "logprobs", "unsupported_parameter")
    if body.get("echo") or body.get("suffix"):
        raise _bad("'echo' and 'suffix' are not supported", "echo" if body.get("echo") else "suffix", "unsupported_parameter")
    rf = parse_response_format(body.get("response_format"))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("'model' is required (see GET /v1/models)", "model", "missing_required_parameter")
    args: dict[str, Any] = {"model": model}
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("'messages' must be a non-empty list", "messages")
        out = []
        for i, m in enumerate(msgs):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant"):
                raise _bad(f"{where}.role must be system, developer, user or assistant", where)
            role = "system" if m["role"] == "developer" else m["role"]
            out.append({"role": role, "content": _text(m.get("content"), where)})
        args["messages"] = out
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _bad("'prompt' must be a non-empty string (one prompt per request)", "prompt")
        args["prompt"] = prompt
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    mt = body.get(key)
    if mt is None:
        mt = 256 if chat else 16  # the OpenAI default for completions is 16
    if isinstance(mt, bool) or not isinstance(mt, int) or not 1 <= mt <= max_seq_len:
        raise _bad(f"'{key}' must be an integer in [1, {max_seq_len}], got {mt!r}", key)
    args["max_tokens"] = mt
    args["temperature"] = _number(body, "temperature", 0.0, 2.0, 0.0)
    args["top_p"] = _number(body, "top_p", 0.0, 1.0, 1.0)
    if args["top_p"] == 0.0:
        raise _bad("'top_p' must be > 0", "top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad("'seed' must be an integer", "seed")
    args["seed"] = seed
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop)):
        raise _bad("'stop' must be a string or a list of at most 4 non-empty strings", "stop")
    args["stop"] = stop
    ignore_eos = body.get("ignore_eos", False)  # vLLM's extension: generate exactly max_tokens
    if not isinstance(ignore_eos, bool):
        raise _bad("'ignore_eos' must be a boolean", "ignore_eos")
    args["ignore_eos"] = ignore_eos
    if rf is not None:
        args["response_format"] = rf
    so = body.get("stream_options") or {}
    if not isinstance(so, dict) or set(so) - {"include_usage"}:
        raise _bad("'stream_options' supports only include_usage", "stream_options")
    return {"args": args, "stream": bool(body.get("stream")), "include_usage": bool(so.get("include_usage"))}


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
        raise _bad(f"'response_format' must be an object like {{'type': 'json_schema', ...}}, got {type(rf).__name__}", "response_format")
    kind = rf.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise _bad(
            f"response_format type {kind!r} is not supported (supported: {', '.join(RESPONSE_FORMAT_TYPES)})",
            "response_format.type", "unsupported_parameter",
        )
    extra = set(rf) - {"type", "json_schema"} if kind == "json_schema" else set(rf) - {"type"}
    if extra:
        raise _bad(f"unknown response_format field(s) for type {kind!r}: {', '.join(sorted(extra))}", "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise _bad("response_format type 'json_schema' needs a 'json_schema' object with 'name' and 'schema'", "response_format.json_schema")
    unknown = set(js) - {"name", "description", "schema", "strict"}
    if unknown:
        raise _bad(f"unknown response_format.json_schema field(s): {', '.join(sorted(unknown))}", "response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _bad(f"response_format.json_schema.name must be 1-64 characters of a-z, A-Z, 0-9, _ or -, got {name!r}", "response_format.json_schema.name")
    schema = js.get("schema")
    if schema is not None and not isinstance(schema, (dict, bool)):
        raise _bad(f"response_format.json_schema.schema must be a JSON Schema object, got {type(schema).__name__}", "response_format.json_schema.schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise _bad(f"response_format.json_schema.strict must be a boolean, got {strict!r}", "response_format.json_schema.strict")
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


def check_response_format(engine: Any, rf: dict[str, Any]) -> None:
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
        raise _bad(f"invalid response_format: {e}", param, "invalid_json_schema") from None


_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "constraint": "stop"}


async def read_json_body(request: Request, limits: Any) -> Any:
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
        raise _bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None


class OpenAiRoutes:
    """Route handlers bound to a :class:`Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.program = load_program(PROGRAM_DIR)

    def _user(self, request: Request) -> str:
        try:
            return self.service.authenticate(bearer(request.headers, request.query_params))
        except AuthError as e:
            raise ApiError(401, str(e), code="invalid_api_key", kind="authentication_error") from None

    async def models(self, request: Request) -> Response:
        try:
            self._user(request)
        except ApiError as e:
            return e.response()
        created = int(self.service.started_at)
        data = [{"id": n, "object": "model", "created": created, "owned_by": "tartlet"} for n in self.service.state.models]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        try:
            user = self._user(request)
            body = await read_json_body(request, self.service.cfg.limits)
            model = body.get("model") if isinstance(body, dict) else None
            if isinstance(model, str) and model not in self.service.state.models:
                served = ", ".join(self.service.state.models)
                raise ApiError(404, f"model {model!r} is not served here (served: {served})", "model", "model_not_found")
            slot = self.service.state.model(model if isinstance(model, str) else None)
            req = parse_request(body, chat, slot.engine.scheduler.max_seq_len)
            rf = req["args"].get("response_format")
            if rf is not None:  # compile off the event loop (the first compile builds the tokenizer bridge)
                await asyncio.to_thread(check_response_format, slot.engine, rf)
            queue: asyncio.Queue[str | None] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            listener = lambda m: loop.call_soon_threadsafe(queue.put_nowait, m if isinstance(m, str) else m.decode(errors="replace"))  # noqa: E731
            try:
                inst = self.service.launch(user, self.program, req["args"], listener=listener)
            except ProtocolError as e:
                status = 429 if e.code == "limit" else 400
                raise ApiError(status, str(e), code=e.code, kind="rate_limit_error" if status == 429 else "invalid_request_error") from None
        except ApiError as e:
            return e.response()
        assert inst.task is not None
        inst.task.add_done_callback(lambda _t: loop.call_soon_threadsafe(queue.put_nowait, None))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        model_name = req["args"]["model"]
        if req["stream"]:
            stream = self._stream(inst, queue, rid, created, model_name, chat, req["include_usage"])
            return StreamingResponse(stream, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        # non-streaming: wait, but abort if the client goes away
        while not inst.done.is_set():
            try:
                await asyncio.wait_for(inst.done.wait(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    inst.abort("the client disconnected")
                    await inst.wait()
                    return Response(status_code=499)
        if inst.status is not Status.FINISHED:
            return ApiError(500, f"generation {inst.status.value}: {inst.error}", code="generation_failed", kind="server_error").response()
        r = inst.result
        usage = _usage(r)
        finish = _FINISH.get(r["finish_reason"], "stop")
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": r["text"]}, "finish_reason": finish, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": r["text"], "finish_reason": finish, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice], "usage": usage})

    async def _stream(self, inst: Any, queue: asyncio.Queue, rid: str, created: int, model: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(delta: str | None, finish: str | None = None, role: bool = False) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                choice: dict[str, Any] = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        try:
            if chat:
                yield chunk(None, role=True)
            while True:
                msg = await queue.get()
                if msg is None:
                    break
                yield chunk(msg)
            await inst.wait()
            if inst.status is not Status.FINISHED:
                err = {"error": {"message": f"generation {inst.status.value}: {inst.error}", "type": "server_error", "code": "generation_failed"}}
                yield f"data: {json.dumps(err)}\n\n"
                return
            r = inst.result
            yield chunk(None, _FINISH.get(r["finish_reason"], "stop"))
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": _usage(r)}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): never leave it running
            if not inst.done.is_set():
                inst.abort("the client disconnected")


def _usage(r: dict[str, Any]) -> dict[str, int]:
    p, c = int(r["prompt_tokens"]), int(r["completion_tokens"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
