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
import contextvars
import hashlib
import itertools
import json
import logging
import re
import uuid
from typing import Any, Awaitable, Callable

from .routing import POWER_OF_TWO, ReplicaGone, Route, chat_prefix, text_prefix
from .tunnel import REPLICA_HEADER, wire_scope

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Seconds a call to one replica for ``/health``, ``/metrics`` or ``list`` may take.
FANOUT_TIMEOUT_S = 30.0
#: What a lost replica's instances and unanswered requests report.
REPLICA_LOST = "replica_lost"


def is_replica_lost(e: BaseException) -> bool:
    """Whether ``e`` (raised by a Ray Serve call) means the replica died or
    cannot be reached (Ray's actor errors), not that the request failed."""
    import ray.exceptions

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaGone))


def call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method.remote(*args, **kwargs)`` under a fresh Ray Serve internal
    request id. Ray Serve 2.60 gives every handle call made while serving one
    incoming request that request's internal id, and its request router
    indexes pending calls by that id: of two calls in flight at once (the
    health fan-out, a WebSocket session's stream and its frames) the second
    was never assigned a replica. (Sets a private context field of the
    pinned Ray version, in a copied context.)"""

    def go() -> Any:
        from ray.serve import context

        context._set_request_context(_internal_request_id=uuid.uuid4().hex)
        return method.remote(*args, **kwargs)

    return contextvars.copy_context().run(go)


def _header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


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
    session = _header(scope, b"x-tartlet-session") or (parsed["user"] if isinstance(parsed.get("user"), str) else None)
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
        chosen = _header(scope, b"x-tartlet-routing") or self.routing
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
        pin = _header(scope, REPLICA_HEADER.encode())
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


class _Tunnel:
    """One replica's end of a client connection: its stream of events and
    an ordered sender of the client's frames."""

    def __init__(self, mux: "WsMux", replica: str | None, route: Route) -> None:
        self.mux = mux
        self.replica = replica
        self.ready = asyncio.get_running_loop().create_future()  # the replica id, once the stream named it
        self.frames: asyncio.Queue[str] = asyncio.Queue()
        self.pending: set[Any] = set()  # request ids sent, not answered
        self.instances: set[str] = set()  # instances launched or attached through it, not ended
        self.lost = False
        mux.all_tunnels.append(self)
        self.key = uuid.uuid4().hex  # the session counts in flight on its replica until closed
        self.stream = call(mux.gw.replicas.ws.options(stream=True), mux.conn, mux.wire, route={**route, "hold": self.key})
        self.reader = asyncio.ensure_future(self._read())
        self.writer: asyncio.Future[None] | None = None

    async def _read(self) -> None:
        try:
            async for events in self.stream:
                for ev in events:
                    if ev["type"] == "tartlet.replica":
                        self.replica = ev["replica"]
                        self.ready.set_result(ev["replica"])
                        self.writer = asyncio.ensure_future(self._write())
                    elif ev["type"] == "websocket.send":
                        await self.mux.from_replica(self, ev.get("text"))
                    elif ev["type"] == "websocket.close":
                        await self.mux.close(ev.get("code", 1000), ev.get("reason", ""))
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:
            from ray.serve.exceptions import RequestCancelledError

            if isinstance(e, RequestCancelledError):  # closed by this side
                return
            if not is_replica_lost(e):
                log.exception("WebSocket tunnel failed")
            await self.mux.lost(self, e)
        finally:
            if not self.ready.done():
                self.ready.set_exception(ConnectionError("the replica closed the session before it started"))

    async def _write(self) -> None:
        while True:
            frames = [await self.frames.get()]
            while not self.frames.empty():
                frames.append(self.frames.get_nowait())
            try:
                ok = await call(self.mux.gw.replicas.ws_frames, self.mux.conn, frames, route={"pin": self.replica})
            except Exception as e:
                await self.mux.lost(self, e)
                return
            if not ok:
                await self.mux.lost(self, ConnectionError("the replica no longer holds this session"))
                return

    def close(self) -> None:
        self.mux.gw.release(self.key)
        self.reader.cancel()
        if self.writer is not None:
            self.writer.cancel()
        self.stream.cancel()


class WsMux:
    """One client WebSocket, fanned out to the replicas it needs (see the
    module docstring)."""

    def __init__(self, gw: Gateway, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self.gw = gw
        self.scope = scope
        self.receive = receive
        self._send = send
        self.conn = uuid.uuid4().hex
        self.wire = wire_scope(scope)
        self.tunnels: dict[str, _Tunnel] = {}
        self.home: _Tunnel | None = None
        self.pin = _header(scope, REPLICA_HEADER.encode())  # a client's choice of home replica
        # snapshot names are per user: the key's hash stands for the user (the replicas check the key)
        self.user_key = hashlib.sha256((_header(scope, b"authorization") or "").encode()).hexdigest()[:16]
        self.all_tunnels: list[_Tunnel] = []  # every tunnel opened, to close with the connection
        self.closed = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._internal = itertools.count(1)
        self._fanouts: dict[str, tuple[asyncio.Future[dict[str, Any]], str]] = {}

    async def send_event(self, ev: dict[str, Any]) -> None:
        if self.closed.is_set():
            return
        async with self._send_lock:
            await self._send({"type": "websocket.send", "text": json.dumps(ev)})

    async def close(self, code: int, reason: str = "") -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        async with self._send_lock:
            try:
                await self._send({"type": "websocket.close", "code": code, "reason": reason})
            except Exception:
                pass

    async def run(self) -> None:
        msg = await self.receive()
        if msg["type"] != "websocket.connect":
            return
        # a connection may reach several replicas: the handshake names the one the client pinned, else the gateway
        await self._send({"type": "websocket.accept", "headers": [[REPLICA_HEADER.encode(), (self.pin or "gateway").encode()]]})
        try:
            reader = asyncio.ensure_future(self._client_frames())
            closed = asyncio.ensure_future(self.closed.wait())
            await asyncio.wait([reader, closed], return_when=asyncio.FIRST_COMPLETED)
            reader.cancel()
            closed.cancel()
        finally:
            for t in self.all_tunnels:
                t.close()

    async def _client_frames(self) -> None:
        while True:
            msg = await self.receive()
            if msg["type"] == "websocket.disconnect":
                self.closed.set()
                return
            text = msg.get("text")
            if text is None:
                text = "\x00binary"  # not JSON: the replica answers bad_request
            await self.forward(text)

    # -- routing of client requests ---------------------------------------------------
    async def _open(self, replica: str | None, route: Route) -> _Tunnel | None:
        """A new tunnel (to ``replica``, or where the router puts ``route``);
        None when it could not start."""
        t = _Tunnel(self, replica, {"pin": replica} if replica is not None else self.gw.policy(self.scope, route))
        try:
            rid = await asyncio.wait_for(asyncio.shield(t.ready), FANOUT_TIMEOUT_S * 4)
        except Exception:
            t.close()
            return None
        old = self.tunnels.get(rid)
        if old is None or old.lost:
            self.tunnels[rid] = t
        return t

    async def tunnel(self, replica: str | None, route: Route | None = None, home: bool = False) -> _Tunnel | None:
        """The tunnel for a request: to ``replica`` when given; else, with
        ``home``, this connection's home (chosen now by ``route`` if there
        is none yet), else any open one. None when that replica is gone or
        none could be reached."""
        route = route or {}
        if replica is not None:
            t = self.tunnels.get(replica)
            if t is not None and not t.lost:
                return t
            if replica not in await self.gw.running():
                return None
            return await self._open(replica, {})
        if self.home is not None and not self.home.lost:
            return self.home
        if self.pin and self.home is None:
            if self.pin not in await self.gw.running():
                return None
            t = await self._open(self.pin, {})
            self.home = t
            return t
        if not (home and route.get("snapshot")):  # no locality to look for: reuse an open tunnel
            for t in self.tunnels.values():
                if not t.lost:
                    if home:
                        self.home = t
                    return t
        t = await self._open(None, route)
        if home:
            self.home = t
        return t

    async def forward(self, text: str) -> None:
        try:
            req = json.loads(text)
        except (ValueError, RecursionError):
            req = None
        if not isinstance(req, dict):
            t = await self.tunnel(None)  # any replica answers bad_request
            if t is not None:
                t.frames.put_nowait(text)
            return
        kind, rid, iid = req.get("type"), req.get("id"), req.get("instance")
        if kind == "list":
            await self.list_all(rid)
            return
        replica = None
        route: Route = {}
        if isinstance(iid, str) and "-" in iid:
            replica = iid.split("-", 1)[0]
        elif kind == "launch":
            args = req.get("args")
            if isinstance(args, dict) and isinstance(args.get("snapshot"), str):
                route = {"snapshot": self.user_key + "/" + args["snapshot"]}
        t = await self.tunnel(replica, route, home=kind in ("launch", "upload"))
        if t is None:
            if replica is not None and replica not in self.gw.seen:  # no replica ever had that id
                await self.send_event({"type": "error", "id": rid, "code": "not_found", "message": f"no instance {iid!r} of yours"})
            elif isinstance(iid, str):
                await self.send_event({"type": "error", "id": rid, "code": REPLICA_LOST,
                                       "message": f"the replica running instance {iid!r} was lost"})  # fmt: skip
            else:
                await self.send_event({"type": "error", "id": rid, "code": "unavailable", "message": "no replica is available; retry"})
            return
        if rid is not None:
            t.pending.add(rid)
        if kind == "attach" and isinstance(iid, str):
            t.instances.add(iid)
        t.frames.put_nowait(text)

    async def list_all(self, rid: Any) -> None:
        """``list`` on every running replica, merged (oldest first)."""
        futs = []
        for replica in await self.gw.running():
            t = await self.tunnel(replica)
            if t is None:
                continue
            key = f"__tartlet_gateway_{next(self._internal)}"
            fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
            self._fanouts[key] = (fut, replica)
            t.frames.put_nowait(json.dumps({"type": "list", "id": key}))
            futs.append((key, fut))
        instances: list[dict[str, Any]] = []
        try:
            for key, fut in futs:
                try:
                    ev = await asyncio.wait_for(fut, FANOUT_TIMEOUT_S)
                except Exception:
                    continue
                if ev.get("type") == "error":
                    await self.send_event({**ev, "id": rid})
                    return
                instances.extend(ev.get("instances", []))
        finally:
            for key, _ in futs:
                self._fanouts.pop(key, None)
        instances.sort(key=lambda i: i.get("started_at") or 0)
        await self.send_event({"type": "instances", "instances": instances, "id": rid})

    # -- events from replicas ---------------------------------------------------------
    async def from_replica(self, t: _Tunnel, text: str | None) -> None:
        if text is None:
            return
        try:
            ev = json.loads(text)
        except ValueError:
            return
        rid = ev.get("id")
        if isinstance(rid, str) and rid in self._fanouts:
            fut, _ = self._fanouts[rid]
            if not fut.done():
                fut.set_result(ev)
            return
        kind = ev.get("type")
        if kind == "launched" and isinstance(ev.get("instance"), str):
            t.instances.add(ev["instance"])
        elif kind == "exit":
            t.instances.discard(ev.get("instance"))
        if rid is not None and kind not in ("output", "exit"):
            t.pending.discard(rid)
        await self.send_event(ev)

    async def lost(self, t: _Tunnel, e: BaseException) -> None:
        """Replica of ``t`` lost: end its instances and unanswered requests
        with ``replica_lost``."""
        if t.lost:
            return
        t.lost = True
        msg = f"{REPLICA_LOST}: replica {t.replica} was lost ({type(e).__name__})"
        log.warning("WebSocket session lost replica %s: %s", t.replica, e)
        for iid in sorted(t.instances):
            await self.send_event({"type": "exit", "instance": iid, "status": "failed", "result": None, "error": msg})
        for rid in list(t.pending):
            await self.send_event({"type": "error", "id": rid, "code": REPLICA_LOST, "message": msg})
        for key, (fut, replica) in self._fanouts.items():
            if replica == t.replica and not fut.done():
                fut.set_exception(ConnectionError(msg))
        t.instances.clear()
        t.pending.clear()
        t.close()
