"""OpenAI Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

Each request runs the bundled ``openai-responses`` inferlet (next to this
file, like the chat route's ``openai-completion``), so it batches with every
other inferlet. Shapes and validation live in
:mod:`tartlet.server.responses_protocol`; stored responses in
:mod:`tartlet.server.responses_store`.

``store`` (default true) keeps the response for ``GET`` and for a later
request's ``previous_response_id``, with a KV snapshot of the whole
conversation (the reply included, rendered by the chat template; saved
without a model call, its last few tokens, the reply's closing markup, kept
in the record as ``snapshot_pending``): the next turn opens that snapshot
and prefills only those tokens and its new items.
``usage.input_tokens_details.cached_tokens`` says how many prompt tokens came
from it (``input_tokens - cached_tokens`` were computed). A conversation
whose start changed (new ``instructions`` or ``tools``) is filled from
scratch. Stored responses belong to their user (another user's id is 404),
expire after ``[responses] ttl_s`` and survive a restart (records in
``<data_dir>/responses``, snapshots persisted by the host).

Streaming sends OpenAI's typed events (``event: TYPE`` + ``data: JSON``, each
with a ``sequence_number``): ``response.created``, ``response.in_progress``,
then per output item ``response.output_item.added``, for a message
``response.content_part.added``, ``response.output_text.delta`` ...,
``response.output_text.done``, ``response.content_part.done``, for a
function call ``response.function_call_arguments.delta`` ...,
``response.function_call_arguments.done``, then ``response.output_item.done``
(each item is done before the next is added; several calls are several
``function_call`` items, their arguments streamed in pieces as generated);
finally ``response.completed`` (or ``response.incomplete`` when
``max_output_tokens`` cut it; ``error`` when the generation failed). A
client that disconnects aborts the request.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..protocol import ProtocolError
from ..runtime.instance import Instance, Status
from ..runtime.program import load_program
from ..sdk.errors import SnapshotError
from .openai_api import await_instances
from .openai_errors import ApiError, generation_error, launch_error
from .openai_protocol import check_response_format, check_tools, fit_context, prompt_length, read_json_body
from .responses_protocol import (
    ResponsesRequest,
    function_call_item,
    message_item,
    new_id,
    parse_request,
    response_object,
    sse,
    usage_object,
)
from .responses_store import ResponseStore, snapshot_name
from .service import post

if TYPE_CHECKING:
    from .openai_api import OpenAiRoutes

PROGRAM_DIR = Path(__file__).parent / "inferlets" / "openai-responses"


class ResponsesRoutes:
    """Route handlers of the Responses API, next to ``oa`` (auth, models)."""

    def __init__(self, oa: "OpenAiRoutes") -> None:
        self.oa = oa
        self.service = oa.service
        self.program = load_program(PROGRAM_DIR)
        cfg = self.service.cfg
        self.store = ResponseStore(Path(cfg.data_dir) / "responses", cfg.responses.ttl_s, cfg.responses.max_per_user, self._drop_snapshot)

    def _drop_snapshot(self, user: str, name: str) -> None:
        for slot in self.service.state.models.values():
            try:
                slot.snapshots.delete(user, name)
            except SnapshotError:
                pass

    def _not_found(self, rid: str) -> ApiError:
        return ApiError(404, f"No response found with id '{rid}'.", "response_id", "response_not_found")

    async def get(self, request: Request) -> Response:
        try:
            user = self.oa._user(request)
            rid = request.path_params["response_id"]
            rec = await asyncio.to_thread(self.store.get, user, rid)
            if rec is None:
                raise self._not_found(rid)
        except ApiError as e:
            return e.response()
        return JSONResponse(rec["response"])

    async def delete(self, request: Request) -> Response:
        try:
            user = self.oa._user(request)
            rid = request.path_params["response_id"]
            if not await asyncio.to_thread(self.store.delete, user, rid):
                raise self._not_found(rid)
        except ApiError as e:
            return e.response()
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    async def input_items(self, request: Request) -> Response:
        """``GET /v1/responses/{id}/input_items``: the input items of a
        stored response (its request's ``input``, not earlier turns), as
        OpenAI lists them: ``{"object": "list", "data", "first_id",
        "last_id", "has_more"}``; query ``limit`` (1-100, default 20),
        ``order`` (``desc``, the default, or ``asc``), ``after`` (an item id:
        the items after it in that order)."""
        try:
            user = self.oa._user(request)
            rid = request.path_params["response_id"]
            q = request.query_params
            order = q.get("order", "desc")
            if order not in ("asc", "desc"):
                raise ApiError(400, "'order' must be 'asc' or 'desc'", "order", "invalid_value")
            try:
                limit = int(q.get("limit", "20"))
            except ValueError:
                limit = 0
            if not 1 <= limit <= 100:
                raise ApiError(400, "'limit' must be an integer in [1, 100]", "limit", "invalid_value")
            rec = await asyncio.to_thread(self.store.get, user, rid)
            if rec is None:
                raise self._not_found(rid)
            items = list(rec.get("input_items") or [])
            if order == "desc":
                items.reverse()
            after = q.get("after")
            if after is not None:
                at = next((i for i, it in enumerate(items) if it.get("id") == after), None)
                if at is None:
                    raise ApiError(400, f"'after' names no input item of response '{rid}'", "after", "invalid_value")
                items = items[at + 1:]
        except ApiError as e:
            return e.response()
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    async def create(self, request: Request) -> Response:
        try:
            user = self.oa._user(request)
            body = await read_json_body(request, self.service.cfg.limits)
            model = body.get("model") if isinstance(body, dict) else None
            if isinstance(model, str) and model not in self.service.state.models:
                raise ApiError(404, f"model {model!r} is not served here (served: {', '.join(self.service.state.models)})", "model", "model_not_found")
            engine = self.service.state.model(model if isinstance(model, str) else None).engine
            req = parse_request(body, engine.scheduler.max_seq_len)
            args = await self._conversation(user, req)
            if args.get("response_format") is not None:
                await asyncio.to_thread(check_response_format, engine, args["response_format"])
            if args.get("tools"):
                await asyncio.to_thread(check_tools, engine, args)
            n = await asyncio.to_thread(prompt_length, engine.tokenizer, args)
            fit_context([args], [n], engine.scheduler.max_seq_len, chat=True)
            rid = new_id("resp")
            if req["store"]:
                args["save"] = snapshot_name(rid)
            queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()
            loop = asyncio.get_running_loop()
            recorded: list[str] = []  # non-streamed: the inferlet's messages, turned into items as a stream's are

            def put(m: str | bytes) -> None:  # the sender's thread
                post(loop, queue.put_nowait, (0, m if isinstance(m, str) else m.decode(errors="replace")))

            def record(m: str | bytes) -> None:
                recorded.append(m if isinstance(m, str) else m.decode(errors="replace"))

            try:
                inst = self.service.launch(user, self.program, args, listener=put if req["stream"] else record)
            except ProtocolError as e:
                raise launch_error(e) from None
        except ApiError as e:
            return e.response()
        assert inst.task is not None
        inst.task.add_done_callback(lambda _t: post(loop, queue.put_nowait, (0, None)))
        turn = _Turn(self, user, rid, req, args, inst, recorded)
        if req["stream"]:
            return StreamingResponse(turn.events(queue), media_type="text/event-stream", headers={"cache-control": "no-cache"})
        refused = await await_instances(request, [inst], queue)
        if refused is not None:
            return refused
        return JSONResponse(await turn.finish())

    async def _conversation(self, user: str, req: ResponsesRequest) -> dict[str, Any]:
        """The inferlet args: the whole conversation (the previous
        response's, then this input), and the previous response's snapshot
        when the conversation still starts with what it holds.

        Raises:
            ApiError: 404 for an unknown ``previous_response_id``.
        """
        args: dict[str, Any] = dict(req["args"], model=req["model"])
        system = [{"role": "system", "content": req["instructions"]}] if req["instructions"] is not None else []
        render_tools = args.get("tools") if args.get("tool_choice", "auto") != "none" else None
        prev = req["previous_response_id"]
        if prev is None:
            args["messages"] = system + req["messages"]
            return args
        rec = await asyncio.to_thread(self.store.get, user, prev)
        if rec is None:
            raise ApiError(404, f"Previous response with id '{prev}' not found.", "previous_response_id", "previous_response_not_found")
        hist = rec["messages"]
        head = hist
        if system:  # instructions are not carried over: this request's replace the stored ones
            head = system + (hist[1:] if hist and hist[0]["role"] == "system" else hist)
        args["messages"] = head + req["messages"]
        if rec.get("snapshot") and head == hist and rec.get("render_tools") == render_tools:
            args["snapshot"], args["snapshot_messages"] = rec["snapshot"], len(hist)
            args["snapshot_pending"] = rec.get("snapshot_pending") or []
        return args


class _Turn:
    """One request's output items, built from the inferlet's messages: as
    they come (streaming) or, for a non-streamed request, from the same
    messages recorded, so both give the same output (items in the order
    generated: text, calls, text after calls in a message of its own)."""

    def __init__(self, routes: ResponsesRoutes, user: str, rid: str, req: ResponsesRequest, args: dict[str, Any], inst: Instance,
                 recorded: list[str] | None = None) -> None:
        self.routes, self.user, self.rid, self.req, self.args, self.inst = routes, user, rid, req, args, inst
        self.recorded = recorded if recorded is not None else []
        self.created = time.time()
        self.output: list[dict[str, Any]] = []
        self.seq = 0
        self._open: dict[str, Any] | None = None  # the item being generated
        self._calls: dict[int, dict[str, Any]] = {}  # tool call index -> its function_call item

    def _event(self, kind: str, **fields: Any) -> str:
        ev = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(ev)

    def _on_message(self, m: dict[str, Any]) -> list[str]:
        """The events of one inferlet message (``{"text"}`` or ``{"tool_call"}``)."""
        out: list[str] = []
        if m.get("text"):
            msg = self._open if self._open is not None and self._open["type"] == "message" else None
            if msg is None:
                out += self._close()
                msg = message_item(new_id("msg"), "", "in_progress")
                msg["text"] = ""
                self.output.append(msg)
                self._open = msg
                idx = len(self.output) - 1
                out.append(self._event("response.output_item.added", output_index=idx, item=_public(msg)))
                out.append(self._event("response.content_part.added", item_id=msg["id"], output_index=idx,
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            msg["text"] += m["text"]
            out.append(self._event("response.output_text.delta", item_id=msg["id"], output_index=self.output.index(msg),
                                   content_index=0, delta=m["text"], logprobs=[]))
        elif "tool_call" in m:
            d = m["tool_call"]
            index = int(d.get("index", 0))
            if "id" in d:
                out += self._close()
                item = function_call_item(new_id("fc"), d["id"], d["name"], "", "in_progress")
                self._calls[index] = item
                self.output.append(item)
                self._open = item
                out.append(self._event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)))
            item = self._calls[index]
            if d.get("arguments"):
                item["arguments"] += d["arguments"]
                out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                       output_index=self.output.index(item), delta=d["arguments"]))
        return out

    def _close(self) -> list[str]:
        """Close the item being generated: its ``done`` events."""
        item, self._open = self._open, None
        if item is None:
            return []
        if item["type"] == "message":
            return self._close_message(item)
        item["status"] = "completed"
        idx = self.output.index(item)
        return [
            self._event("response.function_call_arguments.done", item_id=item["id"], output_index=idx, arguments=item["arguments"]),
            self._event("response.output_item.done", output_index=idx, item=dict(item)),
        ]

    def _end(self) -> list[str]:
        """Close the last item; an empty message when nothing was generated."""
        out = self._close()
        if not self.output:
            empty = message_item(new_id("msg"), "")
            self.output.append(empty)
            out.append(self._event("response.output_item.added", output_index=0, item=dict(empty, status="in_progress", content=[])))
            out.append(self._event("response.output_item.done", output_index=0, item=empty))
        return out

    async def finish(self, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The final response object (stored when asked); without
        ``output``, built from the recorded messages."""
        r = self.inst.result
        if output is None:
            for raw in self.recorded:
                self._on_message(json.loads(raw))
            self._end()
            output = [_public(i) for i in self.output]
        usage = usage_object(int(r["prompt_tokens"]), int(r["cached_tokens"]), int(r["completion_tokens"]))
        cut = r["finish_reason"] == "length"
        obj = response_object(self.rid, self.req, "incomplete" if cut else "completed", output, usage, self.created,
                              "max_output_tokens" if cut else None)
        if self.req["store"]:
            render_tools = self.args.get("tools") if self.args.get("tool_choice", "auto") != "none" else None
            rec = {"id": self.rid, "created": self.created, "response": obj, "messages": self.args["messages"] + [r["assistant"]],
                   "render_tools": render_tools, "snapshot": snapshot_name(self.rid) if r.get("saved") else None,
                   "snapshot_pending": r.get("pending") or [],
                   "input_items": self.req["input_items"]}
            await asyncio.to_thread(self.routes.store.put, self.user, rec)
        elif r.get("saved"):
            self.routes._drop_snapshot(self.user, snapshot_name(self.rid))
        return obj

    async def events(self, queue: asyncio.Queue[tuple[int, str | None]]) -> AsyncIterator[str]:
        """The typed SSE events of a streamed request."""
        inst = self.inst
        try:
            yield self._event("response.created", response=response_object(self.rid, self.req, "in_progress", [], None, self.created))
            yield self._event("response.in_progress", response=response_object(self.rid, self.req, "in_progress", [], None, self.created))
            while True:
                _, raw = await queue.get()
                if raw is None:
                    break
                for ev in self._on_message(json.loads(raw)):
                    yield ev
            await inst.wait()
            if inst.status is not Status.FINISHED:
                err = generation_error(inst).body()["error"]
                yield self._event("error", code=err["code"], message=err["message"], param=None)
                return
            for ev in self._end():
                yield ev
            obj = await self.finish([_public(i) for i in self.output])
            yield self._event("response.completed" if obj["status"] == "completed" else "response.incomplete", response=obj)
        finally:
            if not inst.done.is_set():
                inst.abort("the client disconnected")

    def _close_message(self, msg: dict[str, Any]) -> list[str]:
        idx = self.output.index(msg)
        text = msg["text"]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        msg["status"], msg["content"] = "completed", [part]
        return [
            self._event("response.output_text.done", item_id=msg["id"], output_index=idx, content_index=0, text=text, logprobs=[]),
            self._event("response.content_part.done", item_id=msg["id"], output_index=idx, content_index=0, part=part),
            self._event("response.output_item.done", output_index=idx, item=_public(msg)),
        ]


def _public(item: dict[str, Any]) -> dict[str, Any]:
    """``item`` without the stream's bookkeeping (``text`` of an open message)."""
    return {k: v for k, v in item.items() if k != "text" or item.get("type") != "message"}
