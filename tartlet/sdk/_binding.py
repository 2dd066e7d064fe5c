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
import contextvars
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


async def wait(fut: concurrent.futures.Future[T]) -> T:
    """Await a host future (a ``concurrent.futures.Future``). One already
    resolved (a token stream that had tokens waiting, say) is read after
    one yield to the event loop, as awaiting it would, without
    ``wrap_future``'s hand-off through the loop's self-pipe."""
    if fut.done() and not fut.cancelled():
        await asyncio.sleep(0)
        return fut.result()
    return await asyncio.wrap_future(fut)
