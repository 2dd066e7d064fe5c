"""OpenAI-compatible routes: ``GET /v1/models``, ``POST /v1/chat/completions``
and ``POST /v1/completions`` (streaming with server-sent events, or not).

Each request runs the ``openai-completion`` inferlet (next to this file), so
API requests batch with every other inferlet. Greedy requests
(``temperature`` 0, the default here) give exactly the ``text-completion``
inferlet's output for the same prompt. Request and response shapes follow
the OpenAI API reference (chat.completion, chat.completion.chunk,
text_completion objects; ``data: ...`` SSE frames ending with
``data: [DONE]``). The routes and streaming are here; the request bodies'
pydantic models in :mod:`.openai_models` (fields in :mod:`.openai_fields`,
:mod:`.openai_sampling`), the rest of the protocol in :mod:`.openai_protocol`,
the error bodies in :mod:`.openai_errors`.

``response_format`` (chat and completions) constrains the output with the
SDK's constrained decoding (:mod:`tartlet.sdk.constraint`): ``{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`` gives JSON valid
against the schema, ``{"type": "json_object"}`` a JSON object, ``{"type":
"text"}`` no constraint. The schema is compiled here, before the inferlet is
launched, so an invalid or unsupported one is an HTTP 400 naming the problem
(the inferlet's compile then hits the grammar cache).

``/v1/completions`` takes ``prompt`` as a string, a list of strings, a
list of token ids or a list of token-id lists: one instance (and one choice,
``index`` in prompt order) per prompt, batched together by the engine.
``logit_bias``, ``presence_penalty`` and ``frequency_penalty`` are applied
to the logits by the inferlet (OpenAI's formulas; ``{}`` and zeros change
nothing).

Prompt length is checked before anything is launched: every prompt is
tokenized here exactly as the inferlet fills it (the chat template with its
assistant header, BOS where the model wants one), and a prompt that leaves
no room in the model's context is HTTP 400 ``context_length_exceeded``
(``param`` ``messages`` or ``prompt``; before any event when streaming);
``max_tokens`` beyond the room left is capped, the choice then ending with
``finish_reason`` ``length``. ``usage.prompt_tokens`` is that same count.

Failures: a generation over the user's KV page quota (``KvQuotaError``) is
HTTP 429 ``kv_quota_exceeded`` (type ``rate_limit_error``); one that finds
the KV cache full (``KvCacheFullError``) is HTTP 503 ``kv_cache_full`` with
``Retry-After: 1``; any other is 500 ``generation_failed``, logged with its
traceback. In a stream that has started, the error event carries the same
code. Error messages never name Python exception classes.

``n`` (1..16) gives n choices that are forks of one prefilled context: the
inferlet computes the prompt once and forks it (fork ``k`` samples with seed
``seed + k``); choice ``index`` is ``prompt * n + k``, each with its own
``finish_reason``; ``usage`` counts each prompt once and sums the completion
tokens. ``logprobs`` (chat: ``logprobs: true`` with ``top_logprobs`` 0..20;
completions: ``logprobs`` 0..5) reports each token's log probability under
the distribution sampled from (after bias, penalties, mask and temperature;
temperature 1 when greedy) in OpenAI's shapes, in stream chunks too (see
:func:`format_logprobs`).

Tool calling (chat): ``tools`` (OpenAI function tools) are rendered with
the model's own chat template, or in the Hermes format for templates that
ignore them (:mod:`tartlet.sdk.tools`); ``tool_choice`` ``auto`` (the default
with tools) parses calls out of the generated text in the model's format,
``none`` renders no tools and returns text, ``required`` and ``{"type":
"function", "function": {"name"}}`` force one call whose arguments are
generated under the tool's ``parameters`` schema (constrained decoding), so
they are always valid. Calls come back as ``message.tool_calls`` (content
null when there is none) or, streamed, as ``delta.tool_calls`` (id and name
first, then ``function.arguments`` pieces), with ``finish_reason``
``tool_calls``. Input messages may be ``role: "tool"`` (with
``tool_call_id``) and assistant messages with ``tool_calls``. Reasoning of
``<think>`` models is returned apart as ``reasoning_content`` (vLLM's and
DeepSeek's field), streamed as ``delta.reasoning_content``. Bad tools,
tool choices or tool messages are HTTP 400 naming the ``param``; forced
calls cannot be combined with ``logprobs``, nor tools with
``response_format``.

Parameters this server cannot honour (n > 16, top_logprobs > 20,
echo, suffix, best_of > 1, ...) are refused with HTTP 400 naming the
parameter, never silently ignored. A client that disconnects aborts its request's instances.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..host.state import ModelSlot
from ..protocol import ProtocolError
from ..runtime.instance import Instance, Status
from ..runtime.program import load_program
from .auth import AuthError
from .service import Service, post
from .ws import bearer

if TYPE_CHECKING:
    pass
from .openai_errors import ApiError, generation_error, launch_error
from .openai_models import parse_request
from .openai_protocol import check_response_format, check_tools, fit_context, format_logprobs, prompt_length, read_json_body

log = logging.getLogger(__name__)


PROGRAM_DIR = Path(__file__).parent / "inferlets" / "openai-completion"




_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "constraint": "stop", "tool_calls": "tool_calls"}


def _adapters(slot: ModelSlot, user: str | None) -> list[str]:
    """The adapter names ``user`` sees on ``slot``'s model (None: the served ones)."""
    return slot.adapters.names(user) if user is not None else sorted(slot.engine.adapters)


class OpenAiRoutes:
    """Route handlers bound to a :class:`Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service
        self.program = load_program(PROGRAM_DIR)

    def _user(self, request: Request) -> str:
        try:
            user = self.service.authenticate(bearer(request.headers))  # no ?key= on HTTP: URLs are logged
        except AuthError as e:
            raise ApiError(401, str(e), code="invalid_api_key", kind="authentication_error") from None
        request.state.user = user  # for the access log
        return user

    def _model_object(self, name: str, user: str) -> dict[str, Any]:
        """A served model, or ``BASE:ADAPTER`` with ``parent`` ``BASE`` (vLLM's LoRA model objects)."""
        obj = {"id": name, "object": "model", "created": int(self.service.started_at), "owned_by": "tartlet"}
        base, adapter = self._resolve(name, user)
        if adapter is not None:
            obj.update(parent=base, root=base)
        return obj

    def _served(self, user: str | None = None) -> list[str]:
        """Every model id ``user``'s requests may name: each served model,
        then ``BASE:ADAPTER`` per adapter the user sees on it (the served
        ones and its own, :mod:`tartlet.host.adapter_manager`; no user: the
        served ones only)."""
        models = self.service.state.models
        return list(models) + [f"{m}:{a}" for m, slot in models.items() for a in _adapters(slot, user)]

    def _resolve(self, name: str, user: str | None = None) -> tuple[str, str | None]:
        """``(served model, adapter or None)`` of a request's ``model``: a
        served model's name, or ``BASE:ADAPTER`` naming a LoRA adapter that
        model serves or ``user`` saved or uploaded (another user's do not
        exist here).

        Raises:
            ApiError: 404 ``model_not_found`` (the message lists the ids served).
        """
        models = self.service.state.models
        if name in models:
            return name, None
        base, _, adapter = name.rpartition(":")
        if base in models and adapter in _adapters(models[base], user):
            return base, adapter
        raise ApiError(404, f"model {name!r} is not served here (served: {', '.join(self._served(user))})", "model", "model_not_found")

    async def models(self, request: Request) -> Response:
        try:
            user = self._user(request)
        except ApiError as e:
            return e.response()
        return JSONResponse({"object": "list", "data": [self._model_object(n, user) for n in self._served(user)]})

    async def model(self, request: Request) -> Response:
        """``GET /v1/models/{model}``: the model object, or 404."""
        try:
            user = self._user(request)
            name = request.path_params["model"]
            self._resolve(name, user)
        except ApiError as e:
            return e.response()
        return JSONResponse(self._model_object(name, user))

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        insts: list[Instance] = []
        try:
            user = self._user(request)
            body = await read_json_body(request, self.service.cfg.limits)
            model = body.get("model") if isinstance(body, dict) else None
            served, adapter = self._resolve(model, user) if isinstance(model, str) else (None, None)
            slot = self.service.state.model(served)
            engine = slot.engine
            max_seq_len = engine.scheduler.max_seq_len
            req = parse_request(body, chat, max_seq_len, engine.config.vocab_size)
            model_name = req["args"]["model"]  # echoed as requested (BASE:ADAPTER with an adapter)
            if adapter is not None:  # the inferlet loads the base model and runs every pass with the adapter
                req["args"].update(model=served, adapter=adapter)
            rf = req["args"].get("response_format")
            if rf is not None:  # compile off the event loop (the first compile builds the tokenizer bridge)
                await asyncio.to_thread(check_response_format, engine, rf)
            if req["args"].get("tools"):
                await asyncio.to_thread(check_tools, engine, req["args"])
            base = req["args"]
            jobs = [dict(base)] if chat else [dict(base, **p) for p in req["prompts"] or ()]  # prompts: set for completions
            lengths = await asyncio.to_thread(lambda: [prompt_length(engine.tokenizer, j) for j in jobs])
            fit_context(jobs, lengths, max_seq_len, chat)
            queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
            loop = asyncio.get_running_loop()

            def listener(i: int) -> Callable[[str | bytes], None]:
                def put(m: str | bytes) -> None:  # the sender's thread
                    post(loop, queue.put_nowait, (i, m if isinstance(m, str) else m.decode(errors="replace")))

                def drop(_m: str | bytes) -> None:  # non-streaming: the result carries everything
                    pass

                return put if req["stream"] else drop

            try:
                await self.service.admit_launch(user)  # [limits] max_launches_per_s: one token per request
                for i, job in enumerate(jobs):
                    insts.append(self.service.launch(user, self.program, job, listener=listener(i)))
            except ProtocolError as e:
                raise launch_error(e) from None
        except ApiError as e:
            for inst in insts:
                inst.abort("the request failed")
            return e.response()
        def ended(i: int) -> Callable[[asyncio.Task[None]], None]:
            def put(_t: asyncio.Task[None]) -> None:
                post(loop, queue.put_nowait, (i, None))

            return put

        for i, inst in enumerate(insts):
            assert inst.task is not None
            inst.task.add_done_callback(ended(i))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        n = int(base.get("n", 1))
        if req["stream"]:
            stream = self._stream(insts, queue, rid, created, model_name, chat, req["include_usage"], n)
            return StreamingResponse(stream, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        # non-streaming: wait, but abort as soon as the client goes away (or one prompt fails)
        refused = await await_instances(request, insts, queue)
        if refused is not None:
            return refused
        choices, usage = [], {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
        for i, inst in enumerate(insts):
            r = inst.result
            for k, v in _usage(r).items():
                usage[k] += v
            for j, c in enumerate(r["choices"]):
                finish = _FINISH.get(c["finish_reason"], "stop")
                lp = format_logprobs(c.get("logprobs"), chat)
                if chat:
                    message = chat_message(c)
                    choices.append({"index": i * n + j, "message": message, "finish_reason": finish, "logprobs": lp})
                else:
                    choices.append({"index": i * n + j, "text": c["text"], "finish_reason": finish, "logprobs": lp})
        obj = "chat.completion" if chat else "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices, "usage": usage})

    async def _stream(
        self, insts: list[Instance], queue: asyncio.Queue[tuple[int, str | None]], rid: str, created: int, model: str, chat: bool, include_usage: bool, n: int,
    ) -> AsyncIterator[str]:
        """SSE frames of a streamed request: the inferlet's JSON messages
        (``{"i", "text", "logprobs"}`` and ``{"i", "finish_reason"}``, ``i``
        the fork) become chunks of choice ``instance * n + i``."""
        obj = "chat.completion.chunk" if chat else "text_completion"
        offsets: dict[int, int] = {}
        head = "data: " + json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": []})[:-2]  # ... "choices": [

        def chunk(
            i: int, delta: str | None, finish: str | None = None, role: bool = False, logprobs: Any = None, extra: dict[str, Any] | None = None,
        ) -> str:
            if chat:
                d: dict[str, Any] = {"role": "assistant", "content": ""} if role else ({} if delta is None else {"content": delta})
                if extra:
                    d = extra
                choice: dict[str, Any] = {"index": i, "delta": d, "finish_reason": finish, "logprobs": logprobs}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": logprobs}
            return f"{head}{json.dumps(choice)}]}}\n\n"  # = "data: " + json.dumps(body with choices [choice])

        try:
            if chat:
                yield "".join(chunk(i, None, role=True) for i in range(len(insts) * n))
            open_ = len(insts)
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            while open_:
                # every message waiting goes out in one write: fewer socket sends when the streams lag behind
                got = [await queue.get()]
                while not queue.empty():
                    got.append(queue.get_nowait())
                out: list[str] = []
                for i, msg in got:
                    if msg is not None:
                        out.append(self._frame(msg, i, n, chat, offsets, chunk))
                        continue
                    open_ -= 1
                    inst = insts[i]
                    await inst.wait()
                    if inst.status is not Status.FINISHED:
                        out.append(f"data: {json.dumps(generation_error(inst).body())}\n\n")
                        yield "".join(out)
                        return
                    for k, v in _usage(inst.result).items():
                        usage[k] += v
                if out:
                    yield "".join(out)
            if include_usage:
                body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done, or one failed): never leave any running
            for inst in insts:
                if not inst.done.is_set():
                    inst.abort("the client disconnected")

    @staticmethod
    def _frame(msg: str, i: int, n: int, chat: bool, offsets: dict[int, int], chunk: Callable[..., str]) -> str:
        """The SSE frame of inferlet message ``msg`` of instance ``i`` (see :meth:`_stream`)."""
        m = json.loads(msg)
        idx = i * n + int(m.get("i", 0))
        if "finish_reason" in m:
            return chunk(idx, None, _FINISH.get(m["finish_reason"], "stop"))
        if "reasoning" in m:
            return chunk(idx, None, extra={"reasoning_content": m["reasoning"]})
        if "tool_call" in m:
            return chunk(idx, None, extra={"tool_calls": [tool_call_delta(m["tool_call"])]})
        entries = m.get("logprobs")
        lp = format_logprobs(entries, chat, offsets.get(idx, 0))
        offsets[idx] = offsets.get(idx, 0) + sum(len(e["token"]) for e in entries or ())
        return chunk(idx, m.get("text") or "", logprobs=lp)


async def wait_disconnect(request: Request) -> None:
    """Return when the HTTP client of ``request`` has gone away (the ASGI
    ``http.disconnect`` message; the body must have been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def await_instances(request: Request, insts: list[Instance], ended: asyncio.Queue[tuple[int, str | None]]) -> Response | None:
    """A non-streaming request's wait (:func:`wait_or_disconnect`): None when
    every instance finished; else the response to send: 499 when the client
    went away (every instance aborted and awaited), or the first failed
    instance's :func:`generation_error`. Instances still running when it
    returns (a sibling failed, or the handler was cancelled) are aborted."""
    try:
        if not await wait_or_disconnect(request, insts, ended):
            for inst in insts:
                inst.abort("the client disconnected")
            for inst in insts:
                await inst.wait()
            return Response(status_code=499)
        failed = next((inst for inst in insts if inst.done.is_set() and inst.status is not Status.FINISHED), None)
        return None if failed is None else generation_error(failed).response()
    finally:
        for inst in insts:
            if not inst.done.is_set():
                inst.abort("the request ended")


async def wait_or_disconnect(request: Request, insts: list[Instance], ended: asyncio.Queue[tuple[int, str | None]]) -> bool:
    """Wait until every instance of ``insts`` has ended or one has failed
    (``ended`` receives ``(i, None)`` as instance ``i`` ends), or the client
    disconnects, whichever comes first. Returns False on a disconnect (the
    instances are left running for the caller to abort), else True. The
    disconnect is seen as the server receives it, however busy the
    instances are."""
    gone = asyncio.ensure_future(wait_disconnect(request))
    try:
        while not all(inst.done.is_set() for inst in insts):
            if any(inst.done.is_set() and inst.status is not Status.FINISHED for inst in insts):
                return True
            get = asyncio.ensure_future(ended.get())
            await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
            if not get.done():
                get.cancel()
            if gone.done():
                return False
        return True
    finally:
        gone.cancel()


def chat_message(c: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI ``message`` of one inferlet choice: content (null when
    the choice is only tool calls), ``reasoning_content`` for think-models,
    ``tool_calls``."""
    calls = c.get("tool_calls") or []
    message: dict[str, Any] = {"role": "assistant", "content": c["text"] if c["text"] or not calls else None}
    if c.get("reasoning") is not None:
        message["reasoning_content"] = c["reasoning"]
    if calls:
        message["tool_calls"] = [
            {"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": t["arguments"]}} for t in calls
        ]
    return message


def tool_call_delta(item: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI ``delta.tool_calls`` item from the inferlet's ``tool_call``
    message: the first of a call carries id, type and name."""
    fn: dict[str, Any] = {"arguments": item.get("arguments", "")}
    out: dict[str, Any] = {"index": int(item.get("index", 0))}
    if "id" in item:
        out.update(id=item["id"], type="function")
        fn = {"name": item["name"], **fn}
    out["function"] = fn
    return out


def _usage(r: dict[str, Any]) -> dict[str, int]:
    p, c = int(r["prompt_tokens"]), int(r["completion_tokens"])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
