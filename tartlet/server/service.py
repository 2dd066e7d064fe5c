"""What the server does, independent of transport: authenticate, launch
programs for a user, fan instance output out to attached clients, list,
abort, and forget finished instances after a while.

Runs on the server's event loop; session sends may come from any thread
(a WASM instance's), so output is handed to the loop with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import time
from pathlib import Path
from typing import Any, Callable

from ..host.errors import LimitError
from ..host.session import Session
from ..host.state import HostState
from ..runtime.config import ServerConfig
from ..runtime.instance import Instance, Status
from ..runtime.native import NativeRuntime
from ..runtime.program import Program, ProgramError
from .auth import AuthError, KeyStore
from .programs import ProgramCache
from .protocol import BACKLOG, ProtocolError

#: Finished instances stay listable (and their exit attachable) this long, seconds.
RETAIN_FINISHED_S = 600.0

Event = dict[str, Any]
Subscriber = Callable[[Event], None]


class Channel:
    """Output fan-out of one instance: subscribers get events; while none is
    attached, the last :data:`BACKLOG` events are kept."""

    def __init__(self, inst: Instance, loop: asyncio.AbstractEventLoop) -> None:
        self.inst = inst
        self.loop = loop
        self.subs: list[Subscriber] = []
        self.backlog: collections.deque[Event] = collections.deque(maxlen=BACKLOG)
        self.abort_on_disconnect = False

    def on_send(self, msg: str | bytes) -> None:
        ev: Event = {"type": "output", "instance": self.inst.id}
        if isinstance(msg, bytes):
            import base64

            ev["data_b64"] = base64.b64encode(msg).decode()
        else:
            ev["data"] = msg
        self.loop.call_soon_threadsafe(self._emit, ev)

    def _emit(self, ev: Event) -> None:
        if self.subs:
            for sub in list(self.subs):
                sub(ev)
        else:
            self.backlog.append(ev)

    def exit_event(self) -> Event:
        i = self.inst
        return {"type": "exit", "instance": i.id, "status": i.status.value, "result": _jsonable(i.result), "error": i.error}

    def attach(self, sub: Subscriber) -> None:
        while self.backlog:
            sub(self.backlog.popleft())
        self.subs.append(sub)
        if self.inst.done.is_set():
            sub(self.exit_event())

    def detach(self, sub: Subscriber) -> None:
        if sub in self.subs:
            self.subs.remove(sub)


def _jsonable(v: Any) -> Any:
    import json

    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError):
        return repr(v)


class Service:
    """The server's state: config, host state, runtime, keys, uploads.

    Args:
        cfg: the server config.
        state: loaded engines (with store, bus and HTTP fetcher set).
        auth: False to accept every client as user ``local``.
    """

    def __init__(self, cfg: ServerConfig, state: HostState, auth: bool = True) -> None:
        lim = cfg.limits
        self.cfg = cfg
        self.state = state
        self.auth = auth and cfg.auth.enabled
        self.keys = KeyStore(cfg.auth.keys_file)
        self.programs = ProgramCache(cfg.upload_dir, lim.max_upload_bytes)
        self.runtime = NativeRuntime(
            state,
            time_limit_s=lim.max_wall_time_s,
            max_pages=lim.max_pages_per_instance,
            max_instances_per_user=lim.max_instances_per_user,
            program_dirs=[Path(cfg.program_dir)],
        )
        self.channels: dict[str, Channel] = {}
        self.started_at = time.time()
        self.launched = 0
        self.limit_refusals = 0

    # -- auth ----------------------------------------------------------------------
    def authenticate(self, key: str | None) -> str:
        """The user of ``key`` (``local`` when auth is off).

        Raises:
            AuthError: missing or invalid key.
        """
        if not self.auth:
            return "local"
        return self.keys.user_of(key)

    # -- programs ------------------------------------------------------------------
    def resolve(self, inferlet: Any = None, program: Any = None) -> Program:
        """The program to launch: an installed/bundled name or an upload hash.

        Raises:
            ProtocolError: ``bad_request``, ``not_found``, ``unknown_program``,
                ``forbidden`` (uploads off, or the wasm switch is set).
        """
        if program is not None:
            if not self.cfg.programs.allow_uploads:
                raise ProtocolError("forbidden", "this server does not run uploaded programs ([programs] allow_uploads)")
            if self.cfg.programs.uploaded_runtime == "wasm":
                raise ProtocolError(
                    "forbidden", "uploaded programs must run sandboxed (uploaded_runtime = 'wasm'), "
                    "and the WASM runtime is not available yet"
                )
            return self.programs.get(program)
        if not isinstance(inferlet, str):
            raise ProtocolError("bad_request", "launch needs `inferlet` (a name) or `program` (an upload hash)")
        try:
            return self.runtime.find_program(inferlet)
        except ProgramError as e:
            raise ProtocolError("not_found", str(e)) from None

    # -- instances -----------------------------------------------------------------
    def launch(
        self, user: str, program: Program, args: Any, listener: Callable[[str | bytes], None] | None = None,
        time_limit_s: Any = None,
    ) -> Instance:
        """Start ``program`` for ``user``; its output goes to the instance's
        :class:`Channel` (and to ``listener`` when given, instead).
        ``time_limit_s`` may lower (never raise) the configured wall-time limit.

        Raises:
            ProtocolError: ``bad_request`` (args not an object, program fails
                to load), ``limit`` (too many running instances).
        """
        if not isinstance(args, dict):
            raise ProtocolError("bad_request", f"inferlet args must be a JSON object, got {type(args).__name__}")
        cap = self.cfg.limits.max_wall_time_s
        if time_limit_s is not None:
            if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or time_limit_s <= 0:
                raise ProtocolError("bad_request", f"time_limit_s must be a positive number, got {time_limit_s!r}")
            cap = min(cap, float(time_limit_s)) if cap else float(time_limit_s)
        self.prune()
        loop = asyncio.get_running_loop()
        session = Session()
        try:
            inst = self.runtime.launch(program, args, session, owner=user, time_limit_s=cap)
        except LimitError as e:
            self.limit_refusals += 1
            raise ProtocolError("limit", str(e)) from None
        except (ProgramError, TypeError) as e:
            raise ProtocolError("bad_request", str(e)) from None
        self.launched += 1
        if listener is not None:
            session.listen(listener)
        else:
            ch = Channel(inst, loop)
            session.listen(ch.on_send)
            self.channels[inst.id] = ch
            assert inst.task is not None
            inst.task.add_done_callback(lambda _t, ch=ch: ch._emit(ch.exit_event()))
        return inst

    def get(self, user: str, iid: Any) -> Instance:
        """Instance ``iid`` if ``user`` owns it.

        Raises:
            ProtocolError: ``not_found`` (absent or someone else's: the same
                answer, so ids of other users are not revealed).
        """
        inst = self.runtime.instances.get(iid) if isinstance(iid, str) else None
        if inst is None or (self.auth and inst.owner != user):
            raise ProtocolError("not_found", f"no instance {iid!r} of yours")
        return inst

    def channel(self, user: str, iid: Any) -> Channel:
        inst = self.get(user, iid)
        ch = self.channels.get(inst.id)
        if ch is None:
            raise ProtocolError("not_found", f"instance {iid!r} has no attachable output (an API request or a child)")
        return ch

    def list(self, user: str) -> list[dict[str, Any]]:
        """The user's instances (running and recently ended), oldest first."""
        self.prune()
        out = []
        for i in self.runtime.instances.values():
            if self.auth and i.owner != user:
                continue
            out.append({
                "id": i.id, "program": i.program.name, "status": i.status.value, "owner": i.owner,
                "started_at": i.started_at, "finished_at": i.finished_at, "error": i.error,
                "parent": getattr(i, "parent", None),
            })
        return out

    def prune(self) -> None:
        """Forget instances that ended more than :data:`RETAIN_FINISHED_S` ago."""
        now = time.time()
        for iid, i in list(self.runtime.instances.items()):
            if i.finished_at is not None and now - i.finished_at > RETAIN_FINISHED_S:
                del self.runtime.instances[iid]
                self.channels.pop(iid, None)

    def running(self) -> int:
        return len(self.runtime.running())

    async def shutdown(self) -> None:
        """Abort every running instance and wait for them to unwind."""
        running = self.runtime.running()
        for i in running:
            i.abort("the server is shutting down")
        for i in running:
            await i.wait()
