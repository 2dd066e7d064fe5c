"""An instance's session with its client: text/bytes out, text/bytes in.

Outgoing messages go to listeners (the CLI prints them; the server forwards
them over the WebSocket). Incoming messages queue until the inferlet
receives them. ``receive`` returns a :class:`concurrent.futures.Future`, so
native (asyncio) and sandboxed (blocking) inferlets both wait on it.

Memory is bounded: one message is at most ``max_message_bytes`` (either
direction), and client messages waiting in the inbox are charged to a
per-user :class:`ByteBudget` (the server's ``[limits] max_backlog_bytes``,
shared with the output it keeps for detached clients).
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import Future
from typing import Callable

from ..sdk.errors import LimitError

Message = str | bytes
Listener = Callable[[Message], None]

#: Default largest session message, bytes (``[limits] max_session_message_bytes``).
MAX_MESSAGE_BYTES = 4 * 2**20


def message_bytes(msg: Message) -> int:
    """Size of a session or messaging message, bytes (text counted as UTF-8)."""
    if isinstance(msg, str):
        return len(msg) if msg.isascii() else len(msg.encode("utf-8", "surrogatepass"))
    return len(msg)


class ByteBudget:
    """Bytes held per user against one limit; thread-safe.

    Args:
        limit: most bytes one user may hold (None: unlimited).
        key: the config key of ``limit``, named in errors.
        what: what the bytes are, for errors (e.g. ``"session bytes waiting"``).
        reclaim: called as ``reclaim(user, need)`` (without the lock held)
            when a charge does not fit, to free bytes the user no longer
            needs (e.g. output of ended instances) before refusing.
    """

    def __init__(self, limit: int | None, key: str, what: str, reclaim: Callable[[str, int], None] | None = None) -> None:
        self.limit = limit
        self.key = key
        self.what = what
        self.reclaim = reclaim
        self._lock = threading.Lock()
        self._held: dict[str, int] = collections.defaultdict(int)

    def _try(self, user: str, n: int) -> bool:
        with self._lock:
            if self.limit is not None and self._held[user] + n > self.limit:
                return False
            self._held[user] += n
            return True

    def take(self, user: str, n: int) -> None:
        """Charge ``n`` bytes to ``user``.

        Raises:
            LimitError: the user would hold more than ``limit`` bytes (the
                message names the limit and its config key).
        """
        if self._try(user, n):
            return
        if self.reclaim is not None:
            self.reclaim(user, n)
            if self._try(user, n):
                return
        raise LimitError(
            f"{self.what} for user {user or '(local)'!r} would reach {self.held(user) + n} bytes, "
            f"more than the limit of {self.limit} ([limits] {self.key})"
        )

    def give(self, user: str, n: int) -> None:
        """Release ``n`` bytes charged to ``user``."""
        with self._lock:
            left = self._held[user] - n
            if left > 0:
                self._held[user] = left
            else:
                self._held.pop(user, None)

    def held(self, user: str) -> int:
        """Bytes ``user`` holds now."""
        with self._lock:
            return self._held.get(user, 0)


class Session:
    """Message channel between one instance and its client.

    Args:
        max_message_bytes: largest message in either direction, bytes
            (None: unlimited).
        budget: charged for client messages waiting in the inbox (None:
            unbounded inbox).
        owner: the user charged in ``budget``.
    """

    def __init__(self, max_message_bytes: int | None = MAX_MESSAGE_BYTES, budget: ByteBudget | None = None, owner: str = "") -> None:
        self.max_message_bytes = max_message_bytes
        self.budget = budget
        self.owner = owner
        self._lock = threading.Lock()
        self._inbox: collections.deque[tuple[Message, int]] = collections.deque()
        self._waiters: collections.deque[Future[Message]] = collections.deque()
        self._listeners: list[Listener] = []
        self._closed = False
        self._ended = False

    def _check_size(self, msg: Message) -> int:
        size = message_bytes(msg)
        if self.max_message_bytes is not None and size > self.max_message_bytes:
            raise LimitError(
                f"session message of {size} bytes is larger than the limit of {self.max_message_bytes} "
                "([limits] max_session_message_bytes)"
            )
        return size

    # inferlet side
    def send(self, msg: Message) -> None:
        """Deliver ``msg`` to every listener (in the caller's thread).

        Raises:
            TypeError: ``msg`` is not str or bytes.
            LimitError: ``msg`` is larger than ``max_message_bytes``, or a
                listener refused it (the server's backlog is full).
        """
        if not isinstance(msg, (str, bytes)):
            raise TypeError(f"session messages are str or bytes, got {type(msg).__name__}")
        self._check_size(msg)
        for listener in list(self._listeners):
            listener(msg)

    def receive(self) -> Future[Message]:
        """A future of the next incoming message (str or bytes)."""
        fut: Future[Message] = Future()
        size = 0
        with self._lock:
            if self._inbox:
                msg, size = self._inbox.popleft()
                fut.set_result(msg)
            elif self._closed:
                fut.set_exception(EOFError("the client closed the session"))
            else:
                self._waiters.append(fut)
        if size and self.budget is not None:
            self.budget.give(self.owner, size)
        return fut

    # client side
    def listen(self, listener: Listener) -> None:
        """Call ``listener(msg)`` for every message the inferlet sends; it may
        raise to refuse the message (the inferlet's ``send`` raises it)."""
        self._listeners.append(listener)

    def push(self, msg: Message) -> None:
        """Queue a message from the client to the inferlet.

        Raises:
            LimitError: ``msg`` is larger than ``max_message_bytes``, or the
                owner's ``budget`` cannot hold it while it waits.
        """
        size = self._check_size(msg)
        with self._lock:
            if self._ended:
                return  # the instance is gone: nobody will receive it
            while self._waiters:
                fut = self._waiters.popleft()
                if fut.set_running_or_notify_cancel():
                    fut.set_result(msg)
                    return
            if self.budget is not None:
                self.budget.take(self.owner, size)
            self._inbox.append((msg, size))

    def close(self) -> None:
        """No more client messages: pending and later receives raise EOFError."""
        with self._lock:
            self._closed = True
            waiters, self._waiters = self._waiters, collections.deque()
        for fut in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EOFError("the client closed the session"))

    def end(self) -> None:
        """The instance ended: drop messages it never received (releasing
        their budget), ignore later pushes, close."""
        with self._lock:
            self._ended = True
            dropped = sum(size for _, size in self._inbox)
            self._inbox.clear()
        if dropped and self.budget is not None:
            self.budget.give(self.owner, dropped)
        self.close()

    def pending_bytes(self) -> int:
        """Bytes of client messages waiting in the inbox."""
        with self._lock:
            return sum(size for _, size in self._inbox)
