"""The gateway: the one HTTP and WebSocket entry point of ``tartlet serve
--replicas N`` (an ASGI app that the ``TartletGateway`` deployment serves
with uvicorn). It reads just enough of
each request to route it (:class:`~tartlet.cluster.routing.Route`), forwards
it to a replica over Ray Serve calls (:mod:`tartlet.cluster.tunnel`) and
relays the reply.

- ``/v1/chat/completions``, ``/v1/completions``: routed by the prompt's
  prefix hashes, with affinity to the OpenAI ``user`` field or an
  ``x-tartlet-session`` header when present.
- ``/ws``: one client connection may reach several replicas. Its *home*
  replica is chosen at its first request that needs one (a ``launch`` that
  names a snapshot in ``args.snapshot`` prefers the replica holding it);
  every later launch and upload goes home, so a session's instances, and
  the children they launch, run on one replica. Requests naming an instance
  (``attach``, ``send``, ``abort``, ...) go to the replica that runs it (its
  id starts with the replica's id); ``list`` asks every replica and merges.
  When a replica is lost, each of its instances this client launched or
  attached ends with ``status: failed`` and an error starting
  ``replica_lost``, and requests it had not answered get error
  ``replica_lost``; the connection stays open.
- ``/health``: every replica's health and the gateway's view; ``/metrics``:
  every replica's Prometheus text with a ``replica`` label (one replica's
  with ``?replica=ID``).
- anything else: the least loaded replica.

Every reply carries ``x-tartlet-replica`` (for ``/health`` and ``/metrics``:
``gateway``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from typing import Any, Callable

from .replica_calls import FANOUT_TIMEOUT_S, REPLICA_LOST, Receive, Send, call, header, is_replica_lost
from .routing import POWER_OF_TWO, Route, chat_prefix, text_prefix
from .tunnel import REPLICA_HEADER, wire_scope
from .ws_mux import WsMux

log = logging.getLogger(__name__)

def openai_route(path: str, body: bytes, scope: dict[str, Any]) -> Route:
    """The route of an OpenAI completion request (prefix hashes, and the
    ``user`` field or ``x-tartlet-session`` header as the session key);
    ``{}`` for a body that is not a JSON object (the replica answers the 400)."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(parsed, dict):
        return {}
    route: Route = {"prefix": chat_prefix(parsed) if path.endswith("/chat/completions") else text_prefix(parsed)}
    session = header(scope, b"x-tartlet-session") or (parsed["user"] if isinstance(parsed.get("user"), str) else None)
    if session:
        route["session"] = "s:" + session
    return route


class Gateway:
    """The gateway's ASGI app.

    Args:
        replicas: a Ray Serve deployment handle to the replica deployment
            (methods ``http_start``, ``http_cancel``, ``events``, ``http``,
            ``ws``, ``ws_frames``; every call takes ``route=``).
        live: returns the ids of the replicas currently running.
        max_body_bytes: the largest request body read (``[limits]
            max_message_bytes``); larger: 413.
        routing: ``[cluster] routing``.
        release: ``release(key)``: the request or session sent with
            ``route["hold"] = key`` ended (:func:`tartlet.cluster.router.release`).
    """

    def __init__(
        self, replicas: Any, live: Callable[[], list[str]], max_body_bytes: int, routing: str = "tartlet",
        release: Callable[[str], None] | None = None,
    ) -> None:
        self.replicas = replicas
        self.live = live
        self.max_body_bytes = max_body_bytes
        self.routing = routing
        self.release = release or (lambda key: None)
        self.id = uuid.uuid4().hex  # this gateway, to the replicas' event streams
        self.pending: dict[str, asyncio.Queue[Any]] = {}  # request key -> its events
        self.streams: dict[str, _Events] = {}  # replica -> its event stream to us
        self._tasks: set[asyncio.Task[None]] = set()
        self.seen: set[str] = set()  # every replica id this gateway has seen running

    def _background(self, response: Any) -> None:
        """Await a Ray Serve call's response off the request's path (a
        response nobody awaits may be dropped before it completes, and the
        router would count it in flight for ever); errors are logged."""

        async def wait() -> None:
            try:
                await asyncio.wait_for(response, FANOUT_TIMEOUT_S)
            except Exception as e:
                log.debug("background call failed: %s", e)

        task = asyncio.ensure_future(wait())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def events_from(self, replica: str) -> "_Events":
        """The open event stream of ``replica`` (opened now if needed)."""
        stream = self.streams.get(replica)
        if stream is None or stream.task.done():
            stream = self.streams[replica] = _Events(self, replica)
        return stream

    def policy(self, scope: dict[str, Any], route: Route) -> Route:
        """``route`` under the routing policy in force: ``[cluster] routing``,
        or the request's ``x-tartlet-routing`` header (``tartlet`` or
        ``power-of-two``; a client can only change how its own requests are
        placed)."""
        chosen = header(scope, b"x-tartlet-routing") or self.routing
        if chosen == POWER_OF_TWO and "pin" not in route:
            return {**route, "policy": POWER_OF_TWO}
        return route

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "websocket":
            await WsMux(self, scope, receive, send).run()
        else:
            await self._http(scope, receive, send)

    # -- HTTP ----------------------------------------------------------------------
    async def _read_body(self, receive: Receive) -> bytes | None:
        """The whole request body; None when the client left first.

        Raises:
            _TooLarge: more than ``max_body_bytes``.
        """
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            chunks.append(chunk)
            if not msg.get("more_body", False):
                return b"".join(chunks)

    async def _http(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path == "/health":
            await _json(send, 200, await self.health(), "gateway")
            return
        if path == "/metrics":
            await self.metrics(scope, send)
            return
        try:
            body = await self._read_body(receive)
        except _TooLarge:
            await _error(send, 413, f"request body larger than {self.max_body_bytes} bytes ([limits] max_message_bytes)", "too_large")
            return
        if body is None:
            return
        route: Route = openai_route(path, body, scope) if path in ("/v1/chat/completions", "/v1/completions") else {}
        route = self.policy(scope, route)
        pin = header(scope, REPLICA_HEADER.encode())
        if pin:
            if pin not in await self.running():
                await _error(send, 503, f"replica {pin!r} ({REPLICA_HEADER}) is not running", REPLICA_LOST, status_type="server_error")
                return
            route = {"pin": pin}
        key = uuid.uuid4().hex
        route = {**route, "hold": key}  # counted in flight on its replica until released
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.pending[key] = q
        replica = None
        watcher = asyncio.ensure_future(_disconnected(receive))
        watcher.add_done_callback(lambda _: q.put_nowait(_GONE))
        started = False
        try:
            try:
                replica = await call(self.replicas.http_start, self.id, key, wire_scope(scope), body, route=route)
            except Exception as e:
                if not is_replica_lost(e):
                    raise
                await _error(send, 503, "the replica chosen for this request was lost; retry it", REPLICA_LOST, status_type="server_error")
                return
            assert replica is not None
            stream = self.events_from(replica)
            stream.keys.add(key)
            while True:
                ev = await q.get()
                if ev is None:  # the response is complete
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if ev is _GONE:  # the client left: tell the replica (awaited in the background)
                    self._background(call(self.replicas.http_cancel, key, route={"pin": replica}))
                    return
                if isinstance(ev, BaseException):
                    log.warning("replica %s lost during %s %s: %s", replica, scope.get("method"), path, ev)
                    if not started:
                        await _error(send, 503, "the replica serving this request was lost; retry it", REPLICA_LOST, status_type="server_error")
                    else:  # mid-stream: an SSE error event, then the end
                        event = {"error": {"message": "the replica serving this request was lost", "type": "server_error", "code": REPLICA_LOST}}
                        await send({"type": "http.response.body", "body": f"data: {json.dumps(event)}\n\n".encode(), "more_body": False})
                    return
                if "start" in ev:
                    await send({"type": "http.response.start", "status": ev["start"], "headers": ev["headers"]})
                    started = True
                else:
                    await send({"type": "http.response.body", "body": ev["body"], "more_body": True})
        finally:
            watcher.cancel()
            self.pending.pop(key, None)
            self.release(key)
            if replica is not None:
                s = self.streams.get(replica)
                if s is not None:
                    s.keys.discard(key)

    async def running(self) -> list[str]:
        """Ids of the running replicas. Ray Serve builds a handle's router
        on its first call: until a request went through, one ``/health``
        call (routed anywhere) makes it, and waits for a replica."""
        ids = self.live()
        if not ids:
            try:
                await self.call_replica(None, "GET", "/health")
            except Exception as e:
                log.warning("no replica answered: %s", e)
            ids = self.live()
        self.seen.update(ids)
        return ids

    async def call_replica(self, replica: str | None, method: str, path: str, query: bytes = b"") -> tuple[int, bytes]:
        """GET ``path`` on one replica (None: any); returns (status, body).

        Raises:
            TimeoutError: no answer within :data:`FANOUT_TIMEOUT_S`.
            ray.exceptions.RayActorError: the replica is gone.
        """
        scope: dict[str, Any] = {"type": "http", "http_version": "1.1", "method": method, "scheme": "http", "path": path,
                 "raw_path": path.encode(), "query_string": query, "headers": [], "client": None, "server": None}  # fmt: skip

        async def run() -> tuple[int, bytes]:
            status, chunks = 500, []
            route: Route = {"pin": replica} if replica is not None else {}
            async for events in call(self.replicas.http.options(stream=True), scope, b"", route=route):
                for ev in events:
                    if "start" in ev:
                        status = ev["start"]
                    else:
                        chunks.append(ev["body"])
            return status, b"".join(chunks)

        return await asyncio.wait_for(run(), FANOUT_TIMEOUT_S)

    async def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded", "replicas": [{"replica", "in_flight", ...the replica's /health}]}``
        (``in_flight``: what the router counts on that replica, its own
        /health call included)."""
        ids = await self.running()
        results = await asyncio.gather(*(self.call_replica(r, "GET", "/health") for r in ids), return_exceptions=True)
        replicas: list[dict[str, Any]] = []
        from .router import load

        in_flight = load()
        for r, res in zip(ids, results):
            if isinstance(res, BaseException):
                replicas.append({"replica": r, "status": "unreachable", "error": f"{type(res).__name__}: {res}"[:300]})
            else:
                replicas.append({"replica": r, **json.loads(res[1])})
            replicas[-1]["in_flight"] = in_flight.get(r, 0)  # the router's count: streams, sessions, calls
        ok = bool(replicas) and all(x.get("status") == "ok" for x in replicas)
        return {"status": "ok" if ok else "degraded", "replicas": replicas}

    async def metrics(self, scope: dict[str, Any], send: Send) -> None:
        """Every replica's metrics, each sample labelled ``replica="ID"``
        (``?replica=ID``: that replica's own text, unlabelled)."""
        from urllib.parse import parse_qs

        want = parse_qs(scope.get("query_string", b"").decode()).get("replica")
        ids = await self.running()
        if want:
            if want[0] not in ids:
                await _error(send, 404, f"no running replica {want[0]!r} (running: {', '.join(ids) or 'none'})", "not_found")
                return
            try:
                status, body = await self.call_replica(want[0], "GET", "/metrics")
            except Exception as e:
                if not (is_replica_lost(e) or isinstance(e, TimeoutError)):
                    raise
                await _error(send, 503, f"replica {want[0]!r} did not answer ({type(e).__name__})", REPLICA_LOST, status_type="server_error")
                return
            await _send(send, status, body, "text/plain; version=0.0.4; charset=utf-8", want[0])
            return
        results = await asyncio.gather(*(self.call_replica(r, "GET", "/metrics") for r in ids), return_exceptions=True)
        texts = {r: res[1].decode() for r, res in zip(ids, results) if not isinstance(res, BaseException)}
        await _send(send, 200, merge_metrics(texts).encode(), "text/plain; version=0.0.4; charset=utf-8", "gateway")


class _TooLarge(Exception):
    """A request body over the gateway's limit."""


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text exposition of several replicas as one: each family's
    ``# HELP``/``# TYPE`` once, every sample with a ``replica`` label added
    (format: https://prometheus.io/docs/instrumenting/exposition_formats/)."""
    meta: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    order: list[str] = []
    for replica, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if family not in meta:
                    meta[family], samples[family] = [], []
                    order.append(family)
                if line not in meta[family]:
                    meta[family].append(line)
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            name, labels, rest = m.group(1), m.group(2), m.group(3)
            inner = labels[1:-1] if labels else ""
            label = f'replica="{replica}"' + ("," + inner if inner else "")
            key = family if family and name.startswith(family) else name
            if key not in samples:
                meta[key], samples[key] = [], []
                order.append(key)
            samples[key].append(f"{name}{{{label}}}{rest}")
    return "".join("\n".join(meta[f] + samples[f]) + "\n" for f in order)


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _send(send: Send, status: int, body: bytes, content_type: str, replica: str) -> None:
    headers = [[b"content-type", content_type.encode()], [b"content-length", str(len(body)).encode()], [REPLICA_HEADER.encode(), replica.encode()]]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


async def _json(send: Send, status: int, obj: Any, replica: str) -> None:
    await _send(send, status, json.dumps(obj).encode(), "application/json", replica)


async def _error(send: Send, status: int, message: str, code: str, status_type: str = "invalid_request_error") -> None:
    await _json(send, status, {"error": {"message": message, "type": status_type, "param": None, "code": code}}, "gateway")


_GONE = object()  # a request's client disconnected


class _Events:
    """One replica's event stream to this gateway: hands each ``(key,
    event)`` to the waiting request; if the stream fails (the replica died),
    every request still waiting on it gets the error."""

    def __init__(self, gw: Gateway, replica: str) -> None:
        self.gw = gw
        self.replica = replica
        self.keys: set[str] = set()
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        error: BaseException = ConnectionError(f"replica {self.replica}'s event stream ended")
        try:
            async for batch in call(self.gw.replicas.events.options(stream=True), self.gw.id, route={"pin": self.replica}):
                for key, ev in batch:
                    q = self.gw.pending.get(key)
                    if q is not None:
                        q.put_nowait(ev)
        except Exception as e:
            error = e
        finally:
            for key in self.keys:
                q = self.gw.pending.get(key)
                if q is not None:
                    q.put_nowait(error)
