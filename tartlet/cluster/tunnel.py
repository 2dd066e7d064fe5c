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
        self._outboxes: dict[str, asyncio.Queue[tuple[str, dict[str, Any] | None]]] = {}  # gateway id -> events
        self._requests: dict[str, tuple[str, asyncio.Event]] = {}  # request key -> (gateway id, disconnect)

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

    def _event(self, msg: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
        """One ASGI HTTP message as a wire event (None: nothing to send), and
        whether the response is complete."""
        if msg["type"] == "http.response.start":
            headers = [[bytes(k), bytes(v)] for k, v in msg.get("headers", [])]
            headers.append([REPLICA_HEADER.encode(), self.replica_id.encode()])
            return {"start": msg["status"], "headers": headers}, False
        if msg["type"] == "http.response.body":
            return ({"body": bytes(msg["body"])} if msg.get("body") else None), not msg.get("more_body", False)
        return None, False

    def _start(self, scope: dict[str, Any], body: bytes, out: asyncio.Queue[dict[str, Any] | None]) -> tuple[asyncio.Task[None], asyncio.Event]:
        """Run the app for one request; its ASGI messages go to ``out`` (then
        None); setting the returned event is the client's disconnect."""
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        return asyncio.ensure_future(self._run(dict(scope), receive, out)), gone

    async def http(self, scope: dict[str, Any], body: bytes) -> AsyncIterator[list[dict[str, Any]]]:
        """Serve one HTTP request on a stream of its own; yields lists of
        ``{"start", "headers"}`` and ``{"body"}`` events. Closing the stream
        early (the client went away) is an ``http.disconnect`` to the app.
        (The gateway's own calls: /health, /metrics; client requests use
        :meth:`http_start`.)"""
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task, gone = self._start(scope, body, out)
        try:
            while True:
                events = []
                done = False
                for msg in await _drain(out):
                    ev, end = self._event(msg) if msg is not None else (None, True)
                    if ev is not None:
                        events.append(ev)
                    done = done or end
                if events:
                    yield events
                if done:
                    return
        finally:
            gone.set()
            await self._finish(task)

    # -- HTTP multiplexed: every request of one gateway on one event stream --------------
    def http_start(self, gateway: str, key: str, scope: dict[str, Any], body: bytes) -> str:
        """Start request ``key`` of ``gateway``; its events go to that
        gateway's :meth:`events` stream, as ``(key, event)`` and ``(key,
        None)`` at the end. Returns this replica's id. One stream per gateway
        carries every request's events, so a decode step's tokens for many
        streams cross Ray in one item, not one each."""
        box = self._outbox(gateway)
        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        task, gone = self._start(scope, body, out)
        self._requests[key] = (gateway, gone)

        async def pump() -> None:
            try:
                while True:
                    msg = await out.get()
                    ev, end = self._event(msg) if msg is not None else (None, True)
                    if ev is not None:
                        box.put_nowait((key, ev))
                    if end:
                        break
            finally:
                box.put_nowait((key, None))
                self._requests.pop(key, None)
                await self._finish(task)

        asyncio.ensure_future(pump())
        return self.replica_id

    def http_cancel(self, key: str) -> None:
        """Request ``key``'s client went away: an ``http.disconnect`` to the app."""
        entry = self._requests.get(key)
        if entry is not None:
            entry[1].set()

    def _outbox(self, gateway: str) -> asyncio.Queue[tuple[str, dict[str, Any] | None]]:
        box = self._outboxes.get(gateway)
        if box is None:
            box = self._outboxes[gateway] = asyncio.Queue()
        return box

    async def events(self, gateway: str) -> AsyncIterator[list[tuple[str, dict[str, Any] | None]]]:
        """``gateway``'s events of every request it started here, batched:
        each item holds what was ready. When the stream closes (the gateway
        went away), that gateway's requests still running see a disconnect."""
        box = self._outbox(gateway)
        try:
            while True:
                batch = [await box.get()]
                while not box.empty():
                    batch.append(box.get_nowait())
                yield batch
        finally:
            self._outboxes.pop(gateway, None)
            for g, gone in list(self._requests.values()):
                if g == gateway:
                    gone.set()

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
