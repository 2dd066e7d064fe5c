"""ASGI over Ray Serve calls: a replica runs today's server app
(:func:`tartlet.server.app.build_app`) for requests the gateway forwards,
and streams the app's ASGI messages back.

No Ray import here: the replica deployment (:mod:`tartlet.cluster.deployments`)
calls these methods from its Ray Serve handlers, and tests can drive them
directly.

Wire format (plain, picklable values):

- an HTTP request: the ASGI ``scope`` items the app reads (:func:`wire_scope`)
  and the whole body (the gateway reads it first, bounded by ``[limits]
  max_message_bytes``); the reply is a stream of lists of events,
  ``{"start": status, "headers": [[name, value], ...]}`` then
  ``{"body": bytes}`` ...; the replica adds ``x-tartlet-replica``.
- a WebSocket session: one stream of lists of ASGI ``websocket.send`` /
  ``websocket.close`` messages (its first item is
  ``[{"type": "tartlet.replica", "replica": ID}]``), and the client's frames
  sent in order by separate calls (:meth:`ReplicaTunnel.ws_frames`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

log = logging.getLogger(__name__)

ASGIApp = Callable[..., Awaitable[None]]  # (scope, receive, send)

#: Scope keys forwarded to a replica.
SCOPE_KEYS = ("type", "http_version", "method", "scheme", "path", "raw_path", "query_string", "root_path", "headers", "client", "server", "subprotocols")
#: Seconds a forwarded request's handler may take to unwind after its client left.
UNWIND_S = 10.0
#: The header naming the replica that served a request.
REPLICA_HEADER = "x-tartlet-replica"


def wire_scope(scope: dict[str, Any]) -> dict[str, Any]:
    """The picklable part of an ASGI ``scope`` (headers as ``(bytes, bytes)`` pairs)."""
    out = {k: scope[k] for k in SCOPE_KEYS if k in scope}
    out["headers"] = [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])]
    out["root_path"] = ""
    for k in ("client", "server"):
        if out.get(k) is not None:
            out[k] = tuple(out[k])
    return out


async def _drain(out: asyncio.Queue[dict[str, Any] | None]) -> list[dict[str, Any] | None]:
    """Wait for one message, then take every message already queued."""
    batch = [await out.get()]
    while not out.empty():
        batch.append(out.get_nowait())
    return batch


class ReplicaTunnel:
    """Runs ``app`` for forwarded requests.

    Args:
        app: the replica's ASGI app.
        replica_id: this replica's id (sent back in :data:`REPLICA_HEADER`).
    """

    def __init__(self, app: ASGIApp, replica_id: str) -> None:
        self.app = app
        self.replica_id = replica_id
        self._sockets: dict[str, asyncio.Queue[dict[str, Any]]] = {}

    async def _run(self, scope: dict[str, Any], receive: Any, out: asyncio.Queue[dict[str, Any] | None]) -> None:
        try:
            await self.app(scope, receive, out.put)
        except Exception:
            log.exception("forwarded %s %s failed", scope.get("type"), scope.get("path"))
        finally:
            out.put_nowait(None)

    async def _finish(self, task: asyncio.Task[None]) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(task), UNWIND_S)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            task.cancel()

    async def http(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[list[dict[str, Any]]]:
        """Serve one HTTP request; yields lists of ``{"start", "headers"}``
        and ``{"body"}`` events. Closing the stream early (the client went
        away) is an ``http.disconnect`` to the app."""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(self._run(dict(scope), receive, out))
        try:
            while True:
                events = []
                done = False
                for msg in await _drain(out):
                    if msg is None:
                        done = True
                    elif msg["type"] == "http.response.start":
                        headers = [[bytes(k), bytes(v)] for k, v in msg.get("headers", [])]
                        headers.append([REPLICA_HEADER.encode(), self.replica_id.encode()])
                        events.append({"start": msg["status"], "headers": headers})
                    elif msg["type"] == "http.response.body":
                        if msg.get("body"):
                            events.append({"body": bytes(msg["body"])})
                        if not msg.get("more_body", False):
                            done = True
                if events:
                    yield events
                if done:
                    return
        finally:
            gone.set()
            await self._finish(task)

    async def ws(self, conn: str, scope: dict[str, Any]) -> AsyncIterator[list[dict[str, Any]]]:
        """Run one WebSocket session ``conn``; yields lists of the app's
        ``websocket.send`` / ``websocket.close`` messages, the first list
        naming this replica. Closing the stream is a disconnect."""
        inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        inbox.put_nowait({"type": "websocket.connect"})
        self._sockets[conn] = inbox
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task = asyncio.ensure_future(self._run(dict(scope), inbox.get, out))
        try:
            yield [{"type": "tartlet.replica", "replica": self.replica_id}]
            while True:
                events = []
                done = False
                for msg in await _drain(out):
                    if msg is None or msg["type"] == "websocket.close":
                        done = True
                    if msg is not None and msg["type"] in ("websocket.send", "websocket.close"):
                        events.append(msg)
                if events:
                    yield events
                if done:
                    return
        finally:
            self._sockets.pop(conn, None)
            inbox.put_nowait({"type": "websocket.disconnect", "code": 1000})
            await self._finish(task)

    def ws_frames(self, conn: str, frames: list[str]) -> bool:
        """Hand the client's text ``frames`` to session ``conn``, in order;
        False when the session is not (or no longer) open here."""
        inbox = self._sockets.get(conn)
        if inbox is None:
            return False
        for text in frames:
            inbox.put_nowait({"type": "websocket.receive", "text": text})
        return True

    async def close(self) -> None:
        """Disconnect every open session."""
        for inbox in list(self._sockets.values()):
            with contextlib.suppress(Exception):
                inbox.put_nowait({"type": "websocket.disconnect", "code": 1001})
