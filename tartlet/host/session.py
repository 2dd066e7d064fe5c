"""An instance's session with its client: text/bytes out, text/bytes in.

Outgoing messages go to listeners (the CLI prints them; the server forwards
them over the WebSocket). Incoming messages queue until the inferlet
receives them. ``receive`` returns a :class:`concurrent.futures.Future`, so
native (asyncio) and sandboxed (blocking) inferlets both wait on it.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Callable

Message = str | bytes
Listener = Callable[[Message], None]


class Session:
    """Message channel between one instance and its client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inbox: collections.deque[Message] = collections.deque()
        self._waiters: collections.deque[Future] = collections.deque()
        self._listeners: list[Listener] = []
        self._closed = False

    # inferlet side
    def send(self, msg: Message) -> None:
        """Deliver ``msg`` to every listener (in the caller's thread)."""
        if not isinstance(msg, (str, bytes)):
            raise TypeError(f"session messages are str or bytes, got {type(msg).__name__}")
        for listener in list(self._listeners):
            listener(msg)

    def receive(self) -> Future:
        """A future of the next incoming message (str or bytes)."""
        fut: Future = Future()
        with self._lock:
            if self._inbox:
                fut.set_result(self._inbox.popleft())
            elif self._closed:
                fut.set_exception(EOFError("the client closed the session"))
            else:
                self._waiters.append(fut)
        return fut

    # client side
    def listen(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def push(self, msg: Message) -> None:
        """Queue a message from the client to the inferlet."""
        with self._lock:
            while self._waiters:
                fut = self._waiters.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_result(msg)
                    return
            self._inbox.append(msg)

    def close(self) -> None:
        """No more client messages: pending and later receives raise EOFError."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, collections.deque()
        for fut in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EOFError("the client closed the session"))
