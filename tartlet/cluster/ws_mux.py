"""One client WebSocket of the gateway fanned out to the replicas it needs
(:class:`WsMux`; the rules are in :mod:`tartlet.cluster.gateway`'s
docstring): its home replica, a tunnel per replica it reached, instance ids
routed by their replica prefix, ``list`` merged across replicas, and what a
lost replica's instances and requests report."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import logging
import uuid
from typing import TYPE_CHECKING, Any

from .replica_calls import FANOUT_TIMEOUT_S, REPLICA_LOST, Receive, Send, call, header, is_replica_lost
from .routing import Route
from .tunnel import REPLICA_HEADER, wire_scope

if TYPE_CHECKING:
    from .gateway import Gateway

log = logging.getLogger(__name__)


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
            if not ok:  # the replica ended the session: its stream brings the close (e.g. unauthorized) first
                try:
                    await asyncio.wait_for(asyncio.shield(self.reader), FANOUT_TIMEOUT_S)
                except Exception:
                    pass
                if not self.mux.closed.is_set():
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
        self.pin = header(scope, REPLICA_HEADER.encode())  # a client's choice of home replica
        # snapshot names are per user: the key's hash stands for the user (the replicas check the key)
        self.user_key = hashlib.sha256((header(scope, b"authorization") or "").encode()).hexdigest()[:16]
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
