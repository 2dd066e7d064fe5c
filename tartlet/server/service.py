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
        common = dict(
            time_limit_s=lim.max_wall_time_s, max_pages=lim.max_pages_per_instance,
            max_instances_per_user=lim.max_instances_per_user, program_dirs=[Path(cfg.program_dir)],
        )  # fmt: skip
        self.runtime = NativeRuntime(state, **common)
        self._common = common
        self._sandbox: Any = None  # the WasmRuntime, created on first use (it shares the instance table)
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
    @property
    def sandbox(self) -> Any:
        """The WASM runtime for sandboxed programs (shares the native
        runtime's instance table, so per-user limits count both)."""
        if self._sandbox is None:
            from ..runtime.wasm import WasmLimits, WasmRuntime

            p = self.cfg.programs
            self._sandbox = WasmRuntime(
                self.state, limits=WasmLimits(memory_mb=p.sandbox_memory_mb, cpu_time_s=p.sandbox_cpu_time_s),
                instances=self.runtime.instances, **self._common,
            )  # fmt: skip
        return self._sandbox

    def resolve(self, inferlet: Any = None, program: Any = None) -> tuple[Program, bool]:
        """The program to launch — an installed/bundled name, an installed
        ``.wasm`` component, or an upload hash — and whether it runs
        sandboxed (``[programs] uploaded_runtime`` / ``installed_runtime``;
        components always are).

        Raises:
            ProtocolError: ``bad_request``, ``not_found``, ``unknown_program``,
                ``forbidden`` (uploads off).
        """
        runtimes = self.cfg.programs
        if program is not None:
            if not runtimes.allow_uploads:
                raise ProtocolError("forbidden", "this server does not run uploaded programs ([programs] allow_uploads)")
            return self.programs.get(program), runtimes.uploaded_runtime == "wasm"
        if not isinstance(inferlet, str):
            raise ProtocolError("bad_request", "launch needs `inferlet` (a name) or `program` (an upload hash)")
        try:
            found = self.runtime.find_program(inferlet)
        except ProgramError as e:
            component = Path(self.cfg.program_dir) / f"{inferlet}.wasm"
            if "/" not in inferlet and "\\" not in inferlet and not inferlet.startswith(".") and component.is_file():
                return Program(inferlet, component.parent, component, {}), True
            raise ProtocolError("not_found", str(e)) from None
        return found, runtimes.installed_runtime == "wasm"

    async def prepare(self, program: Program, sandboxed: bool) -> None:
        """Build and compile a sandboxed program (cached) on a worker thread,
        so the event loop keeps serving meanwhile; nothing for native ones.

        Raises:
            ProtocolError: ``bad_request`` (the build or compile failed: the
                message has the error).
        """
        if not sandboxed:
            return
        from ..runtime.builder import BuildError
        from ..runtime.wasm_engine import WasmLoadError

        try:
            await asyncio.to_thread(self.sandbox.prepare, program)
        except (ProgramError, BuildError, WasmLoadError) as e:
            raise ProtocolError("bad_request", str(e)) from None

    # -- instances -----------------------------------------------------------------
    def launch(
        self, user: str, program: Program, args: Any, listener: Callable[[str | bytes], None] | None = None,
        time_limit_s: Any = None, sandboxed: bool = False,
    ) -> Instance:
        """Start ``program`` for ``user``; its output goes to the instance's
        :class:`Channel` (and to ``listener`` when given, instead).
        ``time_limit_s`` may lower (never raise) the configured wall-time limit.
        ``sandboxed`` runs it as a WASM component (call :meth:`prepare`
        first, or the build blocks the event loop).

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
            runtime = self.sandbox if sandboxed else self.runtime
            inst = runtime.launch(program, args, session, owner=user, time_limit_s=cap)
        except LimitError as e:
            self.limit_refusals += 1
            raise ProtocolError("limit", str(e)) from None
        except (ProgramError, TypeError) as e:
            raise ProtocolError("bad_request", str(e)) from None
        except RuntimeError as e:  # WasmInstanceError, WasmLoadError, BuildError
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
                "parent": getattr(i, "parent", None), "runtime": i.runtime,
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
