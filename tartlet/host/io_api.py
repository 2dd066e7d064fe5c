"""Host calls for I/O beyond the client session: messaging between
inferlets, the key-value store, HTTP, sandboxed code runs, and child
inferlets.

Mixed into :class:`tartlet.host.api.HostApi`, which gives it, at
construction, the instance's ``owner`` (its user: scopes messaging topics,
store keys and code runs) and ``runtime`` (a :class:`ChildLauncher`, the
runtime that launched the instance: launches children). Everything an
instance opened here (subscriptions, pending pulls, running children, code
runs) is closed by :meth:`IoHostMixin.close_io` when the instance ends.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from ..sdk.errors import HttpError, InvalidHandleError

if TYPE_CHECKING:
    from .code_sandbox import CodeSandbox, SandboxResult
    from .http import HttpResponse
    from .messaging import Message
    from .state import HostState
    from .store import KVStore


class ChildInstance(Protocol):
    """What the host reads of a child inferlet: a
    :class:`tartlet.runtime.instance.Instance` (a layer above)."""

    @property
    def id(self) -> str: ...
    @property
    def status(self) -> enum.Enum: ...
    @property
    def result(self) -> Any: ...
    @property
    def error(self) -> str | None: ...
    @property
    def task(self) -> asyncio.Task[Any] | None: ...
    @property
    def output(self) -> list[str]: ...
    def abort(self, reason: str = ...) -> None: ...


class ChildLauncher(Protocol):
    """What launches an instance's children: the runtime that launched the
    instance (:class:`tartlet.runtime.base.BaseRuntime`, a layer above)."""

    def launch_child(self, parent: Any, name: str, args: dict[str, Any]) -> ChildInstance:
        """Start inferlet ``name`` for ``parent`` (a HostApi); returns its
        :class:`~tartlet.runtime.instance.Instance`."""
        ...


class ChildResult(TypedDict):
    """The result of :meth:`IoHostMixin.child_wait`."""

    id: str
    status: str
    result: Any
    error: str | None
    output: list[str]


class IoHostMixin:
    """I/O host calls over ``state`` (the bus, store, HTTP fetcher, code
    sandbox), scoped by ``owner``; :meth:`_init_io` sets them up."""

    state: HostState
    owner: str
    runtime: ChildLauncher | None

    def _init_io(self) -> None:
        """Empty I/O tables (called by ``HostApi.__init__``)."""
        self._subs: set[int] = set()  # subscription ids
        self._pulls: set[Future[Message]] = set()  # pending messaging pulls
        self._children: dict[int, ChildInstance] = {}  # child handle -> Instance
        self._child_ids = itertools.count(1)
        self._code_runs: set[Future[SandboxResult]] = set()  # queued or running code_run calls

    def _rate(self, kind: str) -> None:
        """Take a token of the owner's ``kind`` rate (:mod:`.rate_limits`;
        nothing when the host has no rate limits).

        Raises:
            LimitError: the owner goes past that rate.
        """
        rates = getattr(self.state, "rates", None)
        if rates is not None:
            rates.take(self.owner, kind)

    # -- messaging -------------------------------------------------------------------
    def messaging_push(self, topic: str, msg: str | bytes) -> None:
        """Queue ``msg`` on ``topic`` for exactly one puller.

        Raises:
            MessagingError: bad topic or message, full topic backlog.
            LimitError: the owner's waiting bytes or topics would pass
                ``[limits] max_messaging_bytes_per_user`` / ``max_topics_per_user``,
                or the owner goes past ``max_messages_per_s`` (a rate).
        """
        self._rate("message")
        self.state.bus.push(self.owner, topic, msg)

    def messaging_pull(self, topic: str) -> Future[Message]:
        """Future of the next message pushed on ``topic``."""
        fut = self.state.bus.pull(self.owner, topic)
        pulls = self._pulls
        if not fut.done():
            pulls.add(fut)
            fut.add_done_callback(pulls.discard)
        return fut

    def messaging_broadcast(self, topic: str, msg: str | bytes) -> int:
        """Send ``msg`` to every subscriber of ``topic``; returns how many.

        Raises:
            MessagingError: bad topic or message.
            LimitError: the copies waiting in subscriptions would pass the
                owner's ``max_messaging_bytes_per_user`` (none is delivered),
                or the owner goes past ``max_messages_per_s`` (a rate).
        """
        self._rate("message")
        return self.state.bus.broadcast(self.owner, topic, msg)

    def messaging_subscribe(self, topic: str) -> int:
        """Open a subscription to ``topic``; returns its handle.

        Raises:
            MessagingError: bad topic.
            LimitError: too many topics, or the owner goes past
                ``[limits] max_messages_per_s`` (a rate).
        """
        self._rate("message")
        sid = self.state.bus.subscribe(self.owner, topic)
        self._subs.add(sid)
        return sid

    def messaging_next(self, sid: int) -> Future[Message]:
        """Future of the subscription's next message.

        Raises:
            InvalidHandleError: not a subscription of this instance.
        """
        if sid not in self._subs:
            raise InvalidHandleError(f"no subscription with handle {sid!r}")
        return self.state.bus.next(sid)

    def messaging_unsubscribe(self, sid: int) -> None:
        subs = self._subs
        if sid in subs:
            subs.discard(sid)
            self.state.bus.unsubscribe(sid)

    # -- store ---------------------------------------------------------------------
    def _store(self) -> KVStore:
        st = self.state
        if st.store is None:
            from .store import Store

            st.store = Store(":memory:")
        return st.store

    def store_get(self, key: str) -> str | None:
        """The owner's value of ``key`` or None."""
        return self._store().get(self.owner, key)

    def store_set(self, key: str, value: str) -> None:
        """Set the owner's ``key`` (persistent when the server has a store file)."""
        self._store().set(self.owner, key, value)

    def store_delete(self, key: str) -> bool:
        return self._store().delete(self.owner, key)

    def store_keys(self, prefix: str = "") -> list[str]:
        return self._store().keys(self.owner, prefix)

    # -- http ------------------------------------------------------------------------
    def http_fetch(self, url: str, method: str = "GET", headers: dict[str, str] | None = None, body: bytes | str | None = None) -> Future[HttpResponse]:
        """Future of ``{"status", "headers", "body"}`` (see :mod:`tartlet.host.http`).

        Raises:
            HttpError: HTTP is off, or the request is refused.
        """
        fetcher = self.state.http
        if fetcher is None:
            raise HttpError("HTTP from inferlets is disabled on this host (configure [http] allow_hosts)")
        return fetcher.fetch(url, method, headers, body)

    def mcp_servers(self) -> dict[str, str]:
        """The MCP servers configured on this host, ``{name: endpoint URL}``
        (``[mcp.servers.NAME] url``; each URL is on every instance's HTTP
        allowlist). The SDK's :mod:`tartlet.sdk.mcp` speaks to them over
        :meth:`http_fetch`."""
        return dict(self.state.mcp_servers)

    # -- sandboxed code ----------------------------------------------------------------
    def code_run(self, code: str, setup: str = "", time_limit_s: float | None = None, memory_mb: int | None = None) -> Future[SandboxResult]:
        """Run Python ``code`` (after ``setup``, whose output is discarded) in
        a fresh WebAssembly sandbox of the host (:mod:`tartlet.host.code_sandbox`):
        no files, no sockets, at most ``time_limit_s`` seconds of wall time
        and ``memory_mb`` MiB of memory (defaults and maxima: the host's).

        Returns:
            Future of ``{"status", "stdout", "error", "truncated",
            "elapsed_ms"}`` (``status``: ok, error, timeout, memory, crashed).

        Raises:
            ValueError: non-string code, or limits outside the host's bounds.
            RuntimeError: running code is disabled on this host.
            LimitError: the owner has ``[code] max_pending_per_user`` runs
                queued or running.

        Runs of the instance still queued or running when it ends are
        stopped (a running one's worker process is killed).
        """
        sandbox: CodeSandbox | None = getattr(self.state, "code_sandbox", None)
        if sandbox is None:
            raise RuntimeError("running code is disabled on this host ([code] enabled = false)")
        fut = sandbox.run(code, setup, time_limit_s, memory_mb, owner=self.owner)
        runs = self._code_runs
        runs.add(fut)
        fut.add_done_callback(runs.discard)
        return fut

    # -- child inferlets -------------------------------------------------------------
    def child_launch(self, name: str, args: dict[str, Any] | None = None) -> int:
        """Launch inferlet ``name`` (bundled or installed) as a child of this
        instance, same owner and limits; returns a child handle. Children
        still running when the parent ends are aborted.

        Raises:
            RuntimeError: no runtime can launch children here.
            tartlet.runtime.program.ProgramError: unknown name.
            LimitError: the owner runs too many instances, or goes past
                ``[limits] max_launches_per_s`` (a rate, checked by the
                runtime once the name is found).
        """
        if self.runtime is None:
            raise RuntimeError("this host cannot launch child inferlets (no runtime)")
        child = self.runtime.launch_child(self, name, args or {})
        h = next(self._child_ids)
        self._children[h] = child
        return h

    def _child(self, h: int) -> ChildInstance:
        child = self._children.get(h)
        if child is None:
            raise InvalidHandleError(f"no child inferlet with handle {h!r}")
        return child

    def child_wait(self, h: int) -> Future[ChildResult]:
        """Future of ``{"id", "status", "result", "error", "output"}`` once
        the child ends (``output``: its session sends, text only)."""
        child = self._child(h)
        fut: Future[ChildResult] = Future()

        def finish(_: Any = None) -> None:
            if not fut.done():
                fut.set_result({
                    "id": child.id, "status": child.status.value, "result": child.result,
                    "error": child.error, "output": list(child.output),
                })

        task = child.task
        if task is None or task.done():
            finish()
        else:  # this may be a WASM instance's thread: asyncio callbacks are added on the loop
            task.get_loop().call_soon_threadsafe(task.add_done_callback, finish)
        return fut

    def child_abort(self, h: int) -> None:
        self._child(h).abort("aborted by its parent")

    def child_id(self, h: int) -> str:
        return self._child(h).id

    # -- end -------------------------------------------------------------------------
    def close_io(self) -> None:
        """Close subscriptions, forget pending pulls, abort running children."""
        bus = self.state.bus
        for sid in list(self._subs):
            bus.unsubscribe(sid)
        self._subs.clear()
        for fut in list(self._pulls):
            bus.cancel_pull(fut)
        self._pulls.clear()
        for child in self._children.values():
            child.abort("its parent ended")
        for run in list(self._code_runs):
            run.cancel()  # queued runs are dropped; a running one's worker process is killed
