"""The SDK's single door to the host (native transport).

Every SDK call goes through :func:`host` (synchronous host calls) and
:func:`wait` (awaiting a host future). In native mode, the host is the
:class:`tartlet.host.api.HostApi` of the instance running in the current
asyncio task, set by the native runtime with :func:`bind`. A WASM build
replaces this module with one backed by the component's WIT imports (same
functions, blocking ``wait-any`` underneath), so inferlet code is unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # the contract only; the SDK does not import the host at run time
    from ..host.api import HostApi

T = TypeVar("T")

_host: contextvars.ContextVar[HostApi] = contextvars.ContextVar("tartlet_host")


def host() -> HostApi:
    """The host API of the running inferlet.

    Raises:
        RuntimeError: called outside an inferlet (no instance is bound).
    """
    try:
        return _host.get()
    except LookupError:
        raise RuntimeError(
            "no inferlet is running here: tartlet SDK calls must be made from an inferlet's main() "
            "(run it with `tartlet run`, or bind a host with tartlet._binding.bind)"
        ) from None


def bind(api: HostApi) -> contextvars.Token[HostApi]:
    """Make ``api`` the host of the current context (and of tasks it starts)."""
    return _host.set(api)


def unbind(token: contextvars.Token[HostApi]) -> None:
    _host.reset(token)


class _Waker:
    """Hands host futures resolved on other threads to one event loop in
    batches: the first future resolved after a drain posts the drain
    (``call_soon_threadsafe``, a write to the loop's self-pipe), the others
    join it. A decode step of 64 host token streams then wakes the loop
    once, not 64 times (``asyncio.wrap_future`` posts one callback per
    future). Futures are settled in the order they were resolved."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # weak: the loop keys this waker in _wakers
        self._lock = threading.Lock()
        self._ready: list[tuple[concurrent.futures.Future[object], asyncio.Future[object]]] = []

    def watch(self, loop: asyncio.AbstractEventLoop, cfut: concurrent.futures.Future[T]) -> asyncio.Future[T]:
        """A future of ``loop`` (this waker's) that settles as ``cfut``
        does; cancelling it cancels ``cfut`` (as ``wrap_future``)."""
        afut: asyncio.Future[T] = loop.create_future()

        def cancel(f: asyncio.Future[T]) -> None:
            if f.cancelled():
                cfut.cancel()

        afut.add_done_callback(cancel)
        cfut.add_done_callback(lambda f: self._resolved(f, afut))  # type: ignore[arg-type]
        return afut

    def _resolved(self, cfut: concurrent.futures.Future[object], afut: asyncio.Future[object]) -> None:  # any thread
        with self._lock:
            self._ready.append((cfut, afut))
            if len(self._ready) > 1:  # a drain is already posted (or held)
                return
        held: list[_Waker] | None = getattr(_held, "wakers", None)
        if held is not None:  # in hold_wakeups: posted at its end
            held.append(self)
            return
        self._post()

    def _post(self) -> None:
        loop = self._loop()
        if loop is None:  # the loop is gone: nobody waits any more
            return
        try:
            loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _drain(self) -> None:  # on the loop
        with self._lock:
            ready, self._ready = self._ready, []
        for cfut, afut in ready:
            if afut.done():  # cancelled meanwhile
                continue
            if cfut.cancelled():
                afut.cancel()
            elif (exc := cfut.exception()) is not None:
                afut.set_exception(exc)
            else:
                afut.set_result(cfut.result())


_held = threading.local()


@contextlib.contextmanager
def hold_wakeups() -> Iterator[None]:
    """On this thread, hold the loop wake-ups of the host futures resolved
    inside the block and post them when it ends: one per event loop for
    the block (the scheduler hands a step's results out in one, see
    ``Scheduler.hold_wakeups``), not one per future as soon as the loop
    has drained the last. Each wake-up is a write to the loop's self-pipe
    whose return waits for the GIL the woken loop took. Nested blocks
    join the outer one."""
    if getattr(_held, "wakers", None) is not None:
        yield
        return
    wakers: list[_Waker] = []
    _held.wakers = wakers
    try:
        yield
    finally:
        _held.wakers = None
        for w in wakers:
            w._post()


_wakers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker] = weakref.WeakKeyDictionary()
_wakers_lock = threading.Lock()


def _waker(loop: asyncio.AbstractEventLoop) -> _Waker | None:
    """The loop's :class:`_Waker` (None: the loop takes no weak reference)."""
    w = _wakers.get(loop)
    if w is None:
        with _wakers_lock:
            w = _wakers.get(loop)
            if w is None:
                w = _Waker(loop)
                try:
                    _wakers[loop] = w
                except TypeError:
                    return None
    return w


async def wait(fut: concurrent.futures.Future[T]) -> T:
    """Await a host future (a ``concurrent.futures.Future``). One already
    resolved (a token stream that had tokens waiting, say) is read after
    one yield to the event loop, as awaiting it would, without
    ``wrap_future``'s hand-off through the loop's self-pipe; the others
    are handed over in batches (:class:`_Waker`: one loop wake-up for all
    the futures a scheduler step resolves). Cancelling the wait cancels
    ``fut``.

    Raises:
        What ``fut`` raises; ``asyncio.CancelledError`` when it was cancelled.
    """
    if fut.done() and not fut.cancelled():
        await asyncio.sleep(0)
        return fut.result()
    loop = asyncio.get_running_loop()
    w = _waker(loop)
    if w is None:
        return await asyncio.wrap_future(fut)
    return await w.watch(loop, fut)
