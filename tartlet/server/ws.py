"""The ``/ws`` endpoint: one :class:`Connection` per WebSocket client,
speaking :mod:`tartlet.protocol`."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Mapping

from starlette.websockets import WebSocket, WebSocketDisconnect

from ..host.session import message_bytes
from ..protocol import CLOSE_UNAUTHORIZED, ProtocolError, decode_b64, parse_json
from ..sdk.errors import LimitError
from .adapter_requests import ADAPTER_REQUESTS, Staging, adapter_request
from .auth import AuthError
from .service import Event, Service, Subscriber

log = logging.getLogger(__name__)

#: Events queued for one slow client before it is disconnected.
MAX_PENDING_EVENTS = 10_000


def bearer(headers: Mapping[str, str], query: Mapping[str, str] | None = None) -> str | None:
    """The API key of a request: ``Authorization: Bearer KEY``, else (when
    ``query`` is given: the WebSocket endpoint only, since browsers cannot
    set headers on a WebSocket) the ``?key=`` query parameter. HTTP routes
    pass no ``query``: a key in a URL ends up in proxy and access logs."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return query.get("key") if query is not None else None


def _event_bytes(ev: Event) -> int:
    """Bytes an event's payload holds (its output data; other events are small)."""
    data = ev.get("data") if "data" in ev else ev.get("data_b64")
    return message_bytes(data) if isinstance(data, str) else 0


def _field(req: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str, default: Any = None) -> Any:
    """``req[name]`` checked against ``kind`` (bools are not numbers);
    ``default`` when absent or null.

    Raises:
        ProtocolError: ``bad_request`` naming the field and the type it needs.
    """
    v = req.get(name)
    if v is None:
        return default
    if not isinstance(v, kind) or (isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise ProtocolError("bad_request", f"`{name}` must be {what}, got {type(v).__name__}")
    return v


def _instance_id(req: dict[str, Any]) -> str:
    iid: str | None = _field(req, "instance", str, "a string (an instance id)")
    if iid is None:
        raise ProtocolError("bad_request", "this request needs `instance` (an instance id)")
    return iid


class Connection:
    """One client: reads requests, writes replies and instance events.

    Events waiting to be written are bounded: more than
    :data:`MAX_PENDING_EVENTS` or ``[limits] max_backlog_bytes`` of output
    data and the client is disconnected as too slow (close code 1008); its
    instances keep running and keep their output for a later ``attach``.
    """

    def __init__(self, service: Service, ws: WebSocket, user: str) -> None:
        self.service = service
        self.ws = ws
        self.user = user
        self.out: asyncio.Queue[Event | None] = asyncio.Queue()
        self.attached: dict[str, Subscriber] = {}  # instance id -> subscriber
        self.launched: list[str] = []
        self.pending_bytes = 0
        self.max_pending_bytes = service.cfg.limits.max_backlog_bytes
        self.too_slow = False
        self.adapter_staging: Staging = {}  # adapter uploads sent in pieces (adapter_requests.py)

    def emit(self, ev: Event) -> None:
        if self.too_slow:
            return
        size = _event_bytes(ev)
        if self.out.qsize() >= MAX_PENDING_EVENTS or self.pending_bytes + size > self.max_pending_bytes:
            log.warning("client of user %s is too slow; disconnecting", self.user)
            self.too_slow = True
            self.close()  # detach now: later output is kept for a reattach, within the user's budget
            self.out.put_nowait(None)
            return
        self.pending_bytes += size
        self.out.put_nowait(ev)

    async def _writer(self) -> None:
        while True:
            ev = await self.out.get()
            if ev is None:
                await self.ws.close(code=1008, reason="client too slow")
                return
            try:
                text = json.dumps(ev)
            except (TypeError, ValueError, RecursionError):
                text = json.dumps(_error(ev.get("id"), "internal", "the server could not encode a reply"))
            self.pending_bytes -= _event_bytes(ev)
            await self.ws.send_text(text)

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer())
        lim = self.service.cfg.limits
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                text = msg.get("text")
                if text is None:
                    self.emit(_error(None, "bad_request", "frames must be JSON text"))
                    continue
                if len(text) > lim.max_message_bytes:  # uvicorn's ws_max_size closes on larger frames first
                    self.emit(_error(None, "too_large", f"message of {len(text)} characters is larger than {lim.max_message_bytes} bytes"))
                    continue
                try:
                    req = parse_json(text, lim.max_json_depth)
                except ProtocolError as e:
                    self.emit(_error(e.request_id, e.code, str(e)))
                    continue
                rid = req.get("id") if isinstance(req, dict) else None
                try:
                    if not isinstance(req, dict):
                        raise ProtocolError("bad_request", "a request is a JSON object with a `type`")
                    reply = await self.handle(req)
                    if reply is not None:
                        self.emit({**reply, "id": rid})
                except ProtocolError as e:
                    self.emit(_error(rid, e.code, str(e)))
                except LimitError as e:
                    self.emit(_error(rid, "limit", str(e)))
                except Exception as e:  # never let one request kill the connection
                    log.exception("request failed")
                    self.emit(_error(rid, "internal", f"internal error ({type(e).__name__}); the server log has details"))
        except WebSocketDisconnect:
            pass
        finally:
            self.close()
            writer.cancel()

    def close(self) -> None:
        """Detach from every instance; abort those launched to die with us."""
        for iid, sub in self.attached.items():
            ch = self.service.channels.get(iid)
            if ch is not None:
                ch.detach(sub)
                if ch.abort_on_disconnect:
                    ch.inst.abort("the client disconnected")
        self.attached.clear()

    # -- requests ------------------------------------------------------------------
    async def handle(self, req: dict[str, Any]) -> Event | None:
        """Answer one request (a dict). Every field is type-checked here or
        in the service; a wrong one is ``bad_request`` naming it.

        Raises:
            ProtocolError: the error to send back.
            LimitError: a session limit (sent back as ``limit``).
        """
        t = _field(req, "type", str, "a string such as 'launch'")
        svc, user = self.service, self.user
        if t == "ping":
            return {"type": "pong", "user": user}
        if t == "launch":
            inferlet = _field(req, "inferlet", str, "a string (an inferlet name)")
            program_hash = _field(req, "program", str, "a string (an upload hash 'sha256:...')")
            args = _field(req, "args", dict, "a JSON object", {})
            time_limit = _field(req, "time_limit_s", (int, float), "a number of seconds")
            attach = _field(req, "attach", bool, "true or false", True)
            abort_on_disconnect = _field(req, "abort_on_disconnect", bool, "true or false", False)
            logs = _field(req, "logs", bool, "true or false", False)
            program, sandboxed = svc.resolve(inferlet, program_hash)
            await svc.admit_launch(user)  # [limits] max_launches_per_s: waits for the user's turn, or `limit`
            program = await svc.prepare(program, sandboxed, user)  # a first sandboxed launch builds: seconds, off the loop
            inst = svc.launch(user, program, args, time_limit_s=time_limit, sandboxed=sandboxed, logs=logs)
            ch = svc.channels[inst.id]
            ch.abort_on_disconnect = abort_on_disconnect
            if attach:
                self._attach(inst.id)
            return {"type": "launched", "instance": inst.id, "program": program.name}
        if t == "upload":
            return {"type": "uploaded", "program": svc.programs.add(req.get("files"))}
        if t in ADAPTER_REQUESTS:  # tartlet adapter add/list/remove
            return await adapter_request(svc, user, req, self.adapter_staging)
        if t == "send":
            inst = svc.get(user, _instance_id(req))
            svc.take_rate(user, "message")  # [limits] max_messages_per_s
            if req.get("data_b64") is not None:
                data: str | bytes = decode_b64(req.get("data_b64"), "`data_b64`")
            else:
                data = _field(req, "data", str, "a string")
                if data is None:
                    raise ProtocolError("bad_request", "send needs `data` (text) or `data_b64` (bytes)")
            limit = svc.cfg.limits.max_session_message_bytes
            if message_bytes(data) > limit:
                raise ProtocolError(
                    "too_large", f"session message of {message_bytes(data)} bytes is larger than the limit of {limit} "
                    "([limits] max_session_message_bytes)"
                )  # fmt: skip
            inst.session.push(data)
            return None
        if t == "close_input":
            svc.get(user, _instance_id(req)).session.close()
            return None
        if t == "attach":
            iid = _instance_id(req)
            ch = svc.channel(user, iid)
            dropped = 0 if iid in self.attached else self._attach(iid)
            return {"type": "attached", "instance": iid, "status": ch.inst.status.value, "dropped": dropped}
        if t == "detach":
            iid = _instance_id(req)
            svc.get(user, iid)  # not_found for an id that is not one of the user's instances
            sub = self.attached.pop(iid, None)
            attached_to = svc.channels.get(iid)
            if sub is not None and attached_to is not None:
                attached_to.detach(sub)
            return {"type": "ok"}
        if t == "abort":
            svc.get(user, _instance_id(req)).abort(f"aborted by {user}")
            return {"type": "ok"}
        if t == "list":
            return {"type": "instances", "instances": svc.list(user)}
        raise ProtocolError("bad_request", f"unknown request type {t!r:.80}")

    def _attach(self, iid: str) -> int:
        """Stream ``iid``'s output to this client; returns the messages dropped meanwhile."""
        ch = self.service.channels[iid]
        sub = self.emit
        self.attached[iid] = sub
        return ch.attach(sub)


def _error(rid: Any, code: str, message: str) -> Event:
    return {"type": "error", "id": rid, "code": code, "message": message}


async def ws_endpoint(ws: WebSocket) -> None:
    service: Service = ws.app.state.service
    await ws.accept()
    try:
        user = service.authenticate(bearer(ws.headers, ws.query_params))
    except AuthError as e:
        await ws.send_text(json.dumps(_error(None, "unauthorized", str(e))))
        await ws.close(code=CLOSE_UNAUTHORIZED, reason="unauthorized")
        return
    await Connection(service, ws, user).run()
