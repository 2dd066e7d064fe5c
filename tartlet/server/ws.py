"""The ``/ws`` endpoint: one :class:`Connection` per WebSocket client,
speaking :mod:`tartlet.server.protocol`."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect

from .auth import AuthError
from .protocol import CLOSE_UNAUTHORIZED, ProtocolError
from .service import Event, Service

log = logging.getLogger(__name__)

#: Events queued for one slow client before it is disconnected.
MAX_PENDING_EVENTS = 10_000


def bearer(headers: Any, query: Any) -> str | None:
    """The API key of a request: ``Authorization: Bearer KEY`` or ``?key=``."""
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return query.get("key")


class Connection:
    """One client: reads requests, writes replies and instance events."""

    def __init__(self, service: Service, ws: WebSocket, user: str) -> None:
        self.service = service
        self.ws = ws
        self.user = user
        self.out: asyncio.Queue[Event | None] = asyncio.Queue()
        self.attached: dict[str, Any] = {}  # instance id -> subscriber
        self.launched: list[str] = []

    def emit(self, ev: Event) -> None:
        if self.out.qsize() >= MAX_PENDING_EVENTS:
            log.warning("client of user %s is too slow; disconnecting", self.user)
            self.out.put_nowait(None)
            return
        self.out.put_nowait(ev)

    async def _writer(self) -> None:
        while True:
            ev = await self.out.get()
            if ev is None:
                await self.ws.close(code=1008, reason="client too slow")
                return
            await self.ws.send_text(json.dumps(ev))

    async def run(self) -> None:
        writer = asyncio.create_task(self._writer())
        limit = self.service.cfg.limits.max_message_bytes
        try:
            while True:
                msg = await self.ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                text = msg.get("text")
                if text is None:
                    self.emit(_error(None, "bad_request", "frames must be JSON text"))
                    continue
                if len(text) > limit:
                    self.emit(_error(None, "too_large", f"message of {len(text)} bytes is larger than {limit}"))
                    continue
                try:
                    req = json.loads(text)
                except json.JSONDecodeError as e:
                    self.emit(_error(None, "bad_request", f"malformed JSON: {e}"))
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
                except Exception as e:  # never let one request kill the connection
                    log.exception("request failed")
                    self.emit(_error(rid, "internal", f"{type(e).__name__}: {e}"))
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
        t = req.get("type")
        svc, user = self.service, self.user
        if t == "ping":
            return {"type": "pong", "user": user}
        if t == "launch":
            program, sandboxed = svc.resolve(req.get("inferlet"), req.get("program"))
            await svc.prepare(program, sandboxed)  # a first sandboxed launch builds: seconds, off the loop
            inst = svc.launch(user, program, req.get("args", {}), time_limit_s=req.get("time_limit_s"), sandboxed=sandboxed)
            ch = svc.channels[inst.id]
            ch.abort_on_disconnect = bool(req.get("abort_on_disconnect", False))
            if req.get("attach", True):
                self._attach(inst.id)
            return {"type": "launched", "instance": inst.id, "program": program.name}
        if t == "upload":
            return {"type": "uploaded", "program": svc.programs.add(req.get("files"))}
        if t == "send":
            inst = svc.get(user, req.get("instance"))
            if "data_b64" in req:
                try:
                    data: str | bytes = base64.b64decode(req["data_b64"], validate=True)
                except (binascii.Error, TypeError):
                    raise ProtocolError("bad_request", "data_b64 is not valid base64") from None
            elif isinstance(req.get("data"), str):
                data = req["data"]
            else:
                raise ProtocolError("bad_request", "send needs `data` (text) or `data_b64` (bytes)")
            inst.session.push(data)
            return None
        if t == "close_input":
            svc.get(user, req.get("instance")).session.close()
            return None
        if t == "attach":
            iid = req.get("instance")
            ch = svc.channel(user, iid)
            if iid not in self.attached:
                self._attach(iid)
            return {"type": "attached", "instance": iid, "status": ch.inst.status.value}
        if t == "detach":
            iid = req.get("instance")
            sub = self.attached.pop(iid, None)
            ch = svc.channels.get(iid)
            if sub is not None and ch is not None:
                ch.detach(sub)
            return {"type": "ok"}
        if t == "abort":
            svc.get(user, req.get("instance")).abort(f"aborted by {user}")
            return {"type": "ok"}
        if t == "list":
            return {"type": "instances", "instances": svc.list(user)}
        raise ProtocolError("bad_request", f"unknown request type {t!r}")

    def _attach(self, iid: str) -> None:
        ch = self.service.channels[iid]
        sub = self.emit
        self.attached[iid] = sub
        ch.attach(sub)


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
