"""What the server does, independent of transport: authenticate, launch
programs for a user, fan instance output out to attached clients, list,
abort, and forget finished instances after a while.

Runs on the server's event loop; session sends may come from any thread
(a WASM instance's), so output is handed to the loop with :func:`post`
(``call_soon_threadsafe`` from another thread, ``call_soon`` from the
loop's own: a native inferlet's).

Memory held for clients is bounded per user (``[limits] max_backlog_bytes``,
one :class:`~tartlet.host.session.ByteBudget`): an output message is charged
when the inferlet sends it and released when it is handed to a connection
(or dropped); client messages are charged while they wait in the inbox.
Builds of uploaded programs are counted per user (``max_builds_per_user``)
and as running instances (``max_instances_per_user``).
"""

from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ..host.redact import redact
from ..host.redact import register as register_path
from ..host.session import ByteBudget, Session, message_bytes
from ..host.state import HostState
from ..protocol import BACKLOG, ProtocolError
from ..runtime.base import RuntimeOptions
from ..runtime.instance import Instance
from ..runtime.native import NativeRuntime
from ..runtime.program import Program, check_name
from ..sdk.errors import LimitError, ProgramError
from .auth import key_store
from .config import ServerConfig
from .programs import ProgramCache

if TYPE_CHECKING:  # imported on first use: it loads wasmtime
    from ..runtime.wasm import WasmRuntime

Event = dict[str, Any]
Subscriber = Callable[[Event], None]


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop`` soon, from any thread: ``call_soon``
    when called on the loop's own thread (a native inferlet's session
    send), else ``call_soon_threadsafe``, whose wake-up of the loop (a
    write to its self-pipe, and the read that drains it) costs two system
    calls per message. Both append to the same FIFO, so calls keep their
    order whichever way they come."""
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:  # no loop runs on this thread
        here = False
    if here:
        loop.call_soon(fn, *args)
    else:
        loop.call_soon_threadsafe(fn, *args)


class Channel:
    """Output fan-out of one instance: subscribers get events; while none is
    attached, the last :data:`BACKLOG` events are kept, their bytes charged
    to the owner in ``budget``.

    Args:
        inst: the instance.
        loop: the server's event loop.
        budget: the per-user budget of bytes waiting for clients (None:
            unbounded).
    """

    def __init__(self, inst: Instance, loop: asyncio.AbstractEventLoop, budget: ByteBudget | None = None) -> None:
        self.inst = inst
        self.loop = loop
        self.budget = budget
        self.subs: list[Subscriber] = []
        self.backlog: collections.deque[tuple[Event, int]] = collections.deque()
        self.abort_on_disconnect = False
        #: output messages lost to the backlog limits since the last attach
        self.dropped = 0
        self._lock = threading.Lock()

    def on_send(self, msg: str | bytes) -> None:
        """Session listener (the sender's thread).

        Raises:
            LimitError: the owner's bytes waiting for clients would pass
                ``budget`` (raised into the sending inferlet).
        """
        size = message_bytes(msg)
        if self.budget is not None:
            self.budget.take(self.inst.owner, size)
        ev: Event = {"type": "output", "instance": self.inst.id}
        if isinstance(msg, bytes):
            import base64

            ev["data_b64"] = base64.b64encode(msg).decode()
        else:
            ev["data"] = msg
        post(self.loop, self._emit, ev, size)

    def on_log(self, stream: str, line: str) -> None:
        """``InstanceStdio`` sink (any thread): a ``log`` event
        ``{"instance", "stream", "data"}`` for the client, charged to the
        owner's budget like output (bounded per instance by the stdio)."""
        size = len(line.encode("utf-8", "replace"))
        if self.budget is not None:
            self.budget.take(self.inst.owner, size)
        post(self.loop, self._emit, {"type": "log", "instance": self.inst.id, "stream": stream, "data": line}, size)

    def _give(self, size: int) -> None:
        if size and self.budget is not None:
            self.budget.give(self.inst.owner, size)

    def _emit(self, ev: Event, size: int = 0) -> None:
        with self._lock:
            subs = list(self.subs)
            if not subs:
                self.backlog.append((ev, size))
                if len(self.backlog) > BACKLOG:
                    _, old = self.backlog.popleft()
                    self.dropped += 1
                    self._give(old)
                return
        for sub in subs:
            sub(ev)
        self._give(size)

    def drop_backlog(self) -> int:
        """Drop the kept output (counted in :attr:`dropped`); returns the
        bytes released. Callable from any thread."""
        with self._lock:
            freed = sum(size for _, size in self.backlog)
            self.dropped += sum(1 for ev, _ in self.backlog if ev["type"] == "output")
            self.backlog.clear()
        self._give(freed)
        return freed

    def exit_event(self) -> Event:
        i = self.inst
        error = None if i.error is None else redact(i.error)  # no server paths to clients
        return {"type": "exit", "instance": i.id, "status": i.status.value, "result": _jsonable(i.result), "error": error}

    def attach(self, sub: Subscriber) -> int:
        """Replay the kept output to ``sub`` and stream to it from now on;
        returns how many output messages were dropped meanwhile."""
        with self._lock:
            kept, self.backlog = self.backlog, collections.deque()
            dropped, self.dropped = self.dropped, 0
            self.subs.append(sub)
        for ev, size in kept:
            if ev["type"] != "exit":  # the exit event is sent once, below
                sub(ev)
            self._give(size)
        if self.inst.done.is_set():
            sub(self.exit_event())
        return dropped

    def detach(self, sub: Subscriber) -> None:
        with self._lock:
            if sub in self.subs:
                self.subs.remove(sub)


def _seconds(value: Any) -> float:
    """A client's ``time_limit_s`` as a finite, positive float.

    Raises:
        ProtocolError: ``bad_request`` for a bool, a non-number, zero or
            less, NaN or infinity (JSON parsing lets ``NaN`` and
            ``Infinity`` through), or a number too large for a float.
    """
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    try:
        seconds = float(value) if ok else math.nan
    except OverflowError:
        seconds = math.inf
    if not (math.isfinite(seconds) and seconds > 0):
        raise ProtocolError("bad_request", f"time_limit_s must be a positive, finite number of seconds, got {value!r:.40}")
    return seconds


def _jsonable(v: Any) -> Any:
    import json
    import reprlib

    try:
        json.dumps(v)
        return v
    except (TypeError, ValueError, RecursionError):
        return reprlib.repr(v)


class Service:
    """The server's state: config, host state, runtime, keys, uploads.

    Args:
        cfg: the server config.
        state: loaded engines (with store, bus and HTTP fetcher set).
        auth: False to accept every client as user ``local``.
        shared: the snapshot and adapter folders are shared with other
            replicas (``tartlet serve --replicas``): a snapshot save returns
            once its file is written, and snapshots and users' adapters
            saved, saved again or deleted elsewhere are seen there.
    """

    def __init__(self, cfg: ServerConfig, state: HostState, auth: bool = True, shared: bool = False) -> None:
        lim = cfg.limits
        self.cfg = cfg
        self.state = state
        self._register_paths()
        self.auth = auth and cfg.auth.enabled
        # per-user rates keep users apart; without auth there is one user, whose rate is the server's capacity
        # (an OpenAI request is a launch: 20/s would cap a --no-auth server's requests), as pool_fraction_per_user
        if not self.auth:
            state.rates = None
        self.keys = key_store(cfg)  # [store] url: PostgreSQL, shared by replicas; else the keys file
        self.programs = ProgramCache(cfg.upload_dir, lim.max_upload_bytes)
        #: bytes of session messages waiting, per user (output kept for clients + inboxes)
        self.session_budget = ByteBudget(lim.max_backlog_bytes, "max_backlog_bytes", "session messages waiting", self._reclaim)
        self._builds: dict[str, int] = collections.defaultdict(int)  # builds running, per user
        self._building: dict[str, asyncio.Future[Program]] = {}  # build key -> the build (shared by concurrent launches)
        common = RuntimeOptions(
            time_limit_s=lim.max_wall_time_s, max_pages=lim.max_pages_per_instance,
            max_instances_per_user=lim.max_instances_per_user, program_dirs=[Path(cfg.program_dir)],
        )  # fmt: skip
        self.runtime = NativeRuntime(state, **common)
        self.runtime.capture_stdio = True  # what instances print: the server log, and clients asking for it
        # ended instances stay listable (and their exit attachable) for a while, bounded (InstanceTable)
        self.runtime.instances.on_drop = self._instance_dropped
        self._common = common
        # KV quotas per user and instance; named snapshots persisted in the data dir
        self.snapshots_restored = state.configure_kv(lim.kv_limits(self.auth), cfg.snapshot_dir, shared=shared)
        # users' LoRA adapters (saved by inferlets, uploaded): quota, and their folders in [adapters] dir
        mb = lim.max_adapter_mb_per_user
        self.adapters_restored = state.configure_adapters(None if mb is None else int(mb * 2**20), cfg.adapter_dir, shared=shared)
        self._sandbox: WasmRuntime | None = None  # created on first use (it shares the instance table)
        self.channels: dict[str, Channel] = {}
        self.started_at = time.time()
        #: this replica's id under ``tartlet serve --replicas`` (None: a single server)
        self.replica_id: str | None = None
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
    def sandbox(self) -> WasmRuntime:
        """The WASM runtime for sandboxed programs (shares the native
        runtime's instance table, so per-user limits count both)."""
        if self._sandbox is None:
            from ..runtime.wasm import WasmLimits, WasmRuntime

            p = self.cfg.programs
            self._sandbox = WasmRuntime(
                self.state, limits=WasmLimits(memory_mb=p.sandbox_memory_mb, cpu_time_s=p.sandbox_cpu_time_s),
                instances=self.runtime.instances, max_memory_mb_per_user=self.cfg.limits.max_sandbox_memory_mb_per_user,
                max_cpu_per_user=self.cfg.limits.max_sandbox_cpu_per_user, **self._common,
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
            found = self.runtime.find_program(inferlet)  # a name that is not plain (a path, too long): not found either
        except ProgramError as e:
            component = Path(self.cfg.program_dir) / f"{inferlet}.wasm"
            try:
                is_component = check_name(inferlet) is not None and component.is_file()
            except (ProgramError, OSError):
                is_component = False
            if is_component:
                return Program(inferlet, component.parent, component, {}), True
            raise ProtocolError("not_found", redact(str(e))) from None
        return found, runtimes.installed_runtime == "wasm"

    async def prepare(self, program: Program, sandboxed: bool, user: str = "local") -> Program:
        """Build and compile a sandboxed program (cached) on a worker thread,
        so the event loop keeps serving meanwhile; nothing for native ones.
        Returns what to launch: for a sandboxed program, its built component
        (so the launch does not look for a build again, on the event loop:
        a change of the SDK source in between would build there, for
        seconds, stalling every connection), else ``program``.

        A build that is not cached yet counts for ``user`` until it ends
        (even if the client goes away): at most ``[limits]
        max_builds_per_user`` at once, and each as a running instance
        against ``max_instances_per_user``. Concurrent launches of the same
        program share one build, counted once.

        Raises:
            ProtocolError: ``limit`` (too many builds or instances),
                ``bad_request`` (the build or compile failed: the message has
                the error, with server paths replaced by placeholders).
        """
        if not sandboxed:
            return program
        from ..runtime import builder
        from ..runtime.wasm_engine import WasmLoadError

        try:
            key = None if program.entry.suffix == ".wasm" else await asyncio.to_thread(builder.pending_build, program)
            if key is None:  # built already (or a component): compiling is cached too, or quick to redo
                return await asyncio.to_thread(self.sandbox.prepare, program)
            build = self._building.get(key)
            if build is None:
                self._check_build_slot(user)
                self.take_rate(user, "build")
                build = asyncio.ensure_future(asyncio.to_thread(self.sandbox.prepare, program))
                self._building[key] = build
                self._builds[user] += 1

                def done(_: Any, key: str = key, user: str = user) -> None:
                    self._building.pop(key, None)
                    self._builds[user] -= 1
                    if not self._builds[user]:
                        del self._builds[user]

                build.add_done_callback(done)
            return await asyncio.shield(build)
        except (ProgramError, builder.BuildError, WasmLoadError) as e:
            raise ProtocolError("bad_request", redact(str(e))) from None

    def take_rate(self, user: str, kind: str) -> None:
        """Take a token of ``user``'s ``kind`` rate (:mod:`tartlet.host.rate_limits`).

        Raises:
            ProtocolError: ``limit``, naming the rate's key.
        """
        rates = self.state.rates
        if rates is None:
            return
        try:
            rates.take(user, kind)
        except LimitError as e:
            self.limit_refusals += 1
            raise ProtocolError("limit", str(e)) from None

    async def admit_launch(self, user: str) -> None:
        """Wait for ``user``'s turn to launch (``[limits] max_launches_per_s``):
        at once while the user is within the rate, else until a token comes
        back; the requests of one connection are answered in order, so a
        user who floods launches waits behind their own launches only.

        Raises:
            ProtocolError: ``limit`` when the wait would be longer than
                ``[limits] max_rate_wait_s``.
        """
        rates = self.state.rates
        if rates is None:
            return
        try:
            wait = rates.wait_for(user, "launch", self.cfg.limits.max_rate_wait_s)
        except LimitError as e:
            self.limit_refusals += 1
            raise ProtocolError("limit", str(e)) from None
        if wait > 0:
            await asyncio.sleep(wait)

    def _check_build_slot(self, user: str) -> None:
        lim = self.cfg.limits
        builds = self._builds.get(user, 0)
        if builds >= lim.max_builds_per_user:
            self.limit_refusals += 1
            raise ProtocolError(
                "limit", f"user {user!r} already runs {builds} program build(s), the limit ([limits] max_builds_per_user); "
                "launch again when it is done"
            )  # fmt: skip
        cap = lim.max_instances_per_user
        if cap is not None and len(self.runtime.running(user)) + builds >= cap:
            self.limit_refusals += 1
            raise ProtocolError(
                "limit", f"user {user!r} already runs {cap} instances and builds, the limit (max_instances_per_user)"
            )

    def _register_paths(self) -> None:
        from .. import paths

        for path, label in (
            (self.cfg.upload_dir, "<upload>"), (self.cfg.data_dir, "<data>"), (self.cfg.program_dir, "<programs>"),
            (self.cfg.snapshot_dir, "<snapshots>"), (self.cfg.adapter_dir, "<adapters>"), (paths.cache_dir(), "<cache>"),
        ):  # fmt: skip
            register_path(path, label)

    def _reclaim(self, user: str, need: int) -> None:
        """Free ``need`` bytes of ``user``'s budget if possible: drop the kept
        output of the user's ended instances, oldest first (any thread)."""
        ended = [ch for ch in list(self.channels.values()) if ch.inst.owner == user and ch.inst.finished_at is not None]
        freed = 0
        for ch in sorted(ended, key=lambda c: c.inst.finished_at or 0.0):
            freed += ch.drop_backlog()
            if freed >= need:
                return

    # -- instances -----------------------------------------------------------------
    def launch(
        self, user: str, program: Program, args: Any, listener: Callable[[str | bytes], None] | None = None,
        time_limit_s: Any = None, sandboxed: bool = False, logs: bool = False,
    ) -> Instance:
        """Start ``program`` for ``user``; its output goes to the instance's
        :class:`Channel` (and to ``listener`` when given, instead).
        ``time_limit_s`` may lower (never raise) the configured wall-time limit.
        ``sandboxed`` runs it as a WASM component (call :meth:`prepare`
        first, or the build blocks the event loop). What it prints always
        goes to the server log (``tartlet.inferlet``); with ``logs`` also to
        its channel as ``log`` events.

        Raises:
            ProtocolError: ``bad_request`` (args not an object, program fails
                to load), ``limit`` (too many running instances).
        """
        if not isinstance(args, dict):
            raise ProtocolError("bad_request", f"inferlet args must be a JSON object, got {type(args).__name__}")
        cap_n = self.cfg.limits.max_instances_per_user
        if cap_n is not None and self._builds.get(user, 0) and len(self.runtime.running(user)) + self._builds[user] >= cap_n:
            self.limit_refusals += 1
            raise ProtocolError("limit", f"user {user!r} already runs {cap_n} instances and builds, the limit (max_instances_per_user)")
        cap = self.cfg.limits.max_wall_time_s
        if time_limit_s is not None:
            limit = _seconds(time_limit_s)
            cap = min(cap, limit) if cap else limit
        self.prune()
        loop = asyncio.get_running_loop()
        lim = self.cfg.limits
        session = Session(lim.max_session_message_bytes, self.session_budget, user)
        try:
            runtime = self.sandbox if sandboxed else self.runtime
            inst = runtime.launch(program, args, session, owner=user, time_limit_s=cap)
        except LimitError as e:
            self.limit_refusals += 1
            raise ProtocolError("limit", str(e)) from None
        except (ProgramError, TypeError) as e:
            raise ProtocolError("bad_request", redact(str(e))) from None
        except RuntimeError as e:  # WasmInstanceError, WasmLoadError, BuildError
            raise ProtocolError("bad_request", redact(str(e))) from None
        self.launched += 1
        assert inst.task is not None
        if listener is not None:
            session.listen(listener)
            inst.task.add_done_callback(lambda _t: session.end())
        else:
            ch = Channel(inst, loop, self.session_budget)
            session.listen(ch.on_send)
            if logs:
                inst.stdio.sink = ch.on_log
            self.channels[inst.id] = ch

            def ended(_t: Any, ch: Channel = ch) -> None:
                session.end()  # client messages it never received are dropped
                ch._emit(ch.exit_event())

            inst.task.add_done_callback(ended)
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
                "started_at": i.started_at, "finished_at": i.finished_at, "error": None if i.error is None else redact(i.error),
                "parent": i.parent, "runtime": i.runtime,
            })
        return out

    def prune(self) -> None:
        """Forget ended instances past the table's bounds
        (:class:`~tartlet.runtime.instance_table.InstanceTable`: 10 minutes,
        256 per user, 2,048 in all)."""
        self.runtime.instances.prune()

    def _instance_dropped(self, iid: str) -> None:
        ch = self.channels.pop(iid, None)
        if ch is not None:
            ch.drop_backlog()

    def running(self) -> int:
        return self.runtime.instances.running_count()

    async def shutdown(self) -> None:
        """Abort every running instance and wait for them to unwind."""
        running = self.runtime.running()
        for i in running:
            i.abort("the server is shutting down")
        for i in running:
            await i.wait()
