"""Messages between inferlets: queues (push/pull) and broadcast (subscribe).

Topics are scoped by user (the instance owner): inferlets of different users
never see each other's topics. A *queue* topic delivers each pushed message
to exactly one puller (FIFO, waiting pullers first); a *broadcast* topic
delivers each message to every subscription open at the time it is sent.
Waiting calls return a :class:`concurrent.futures.Future` so native and
sandboxed inferlets both wait on them. Thread-safe.
"""

from __future__ import annotations

import collections
import itertools
import threading
from concurrent.futures import Future

Message = str | bytes

#: Largest message, bytes (text counted as UTF-8).
MAX_MESSAGE_BYTES = 1 << 20
#: Largest backlog of one queue topic or one subscription, messages.
MAX_BACKLOG = 10_000


class MessagingError(ValueError):
    """A bad topic or message, a full backlog, or an unknown subscription."""


def check(topic: str, msg: Message) -> None:
    if not isinstance(topic, str) or not topic or len(topic) > 256:
        raise MessagingError(f"a topic is a non-empty str of at most 256 characters, got {topic!r}")
    if not isinstance(msg, (str, bytes)):
        raise MessagingError(f"messages are str or bytes, got {type(msg).__name__}")
    size = len(msg.encode()) if isinstance(msg, str) else len(msg)
    if size > MAX_MESSAGE_BYTES:
        raise MessagingError(f"message of {size} bytes is larger than the limit of {MAX_MESSAGE_BYTES}")


class _Mailbox:
    """Messages waiting for takers, and takers waiting for messages."""

    def __init__(self) -> None:
        self.items: collections.deque[Message] = collections.deque()
        self.waiters: collections.deque[Future] = collections.deque()

    def put(self, msg: Message, what: str) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_result(msg)
                return
        if len(self.items) >= MAX_BACKLOG:
            raise MessagingError(f"{what} already holds {MAX_BACKLOG} undelivered messages")
        self.items.append(msg)

    def take(self) -> Future:
        fut: Future = Future()
        if self.items:
            fut.set_result(self.items.popleft())
        else:
            self.waiters.append(fut)
        return fut

    def fail_waiters(self, exc: Exception) -> None:
        waiters, self.waiters = self.waiters, collections.deque()
        for fut in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)


class MessageBus:
    """All topics of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], _Mailbox] = {}
        self._subs: dict[int, tuple[tuple[str, str], _Mailbox]] = {}
        self._by_topic: dict[tuple[str, str], set[int]] = collections.defaultdict(set)
        self._ids = itertools.count(1)

    # queue topics
    def push(self, user: str, topic: str, msg: Message) -> None:
        """Queue ``msg`` on ``topic`` for one puller.

        Raises:
            MessagingError: bad topic/message, or the backlog is full.
        """
        check(topic, msg)
        with self._lock:
            self._queues.setdefault((user, topic), _Mailbox()).put(msg, f"queue topic {topic!r}")

    def pull(self, user: str, topic: str) -> Future:
        """A future of the next message pushed on ``topic`` (FIFO)."""
        check(topic, "")
        with self._lock:
            return self._queues.setdefault((user, topic), _Mailbox()).take()

    # broadcast topics
    def subscribe(self, user: str, topic: str) -> int:
        """Open a subscription; it receives every later broadcast on ``topic``."""
        check(topic, "")
        with self._lock:
            sid = next(self._ids)
            self._subs[sid] = ((user, topic), _Mailbox())
            self._by_topic[(user, topic)].add(sid)
            return sid

    def broadcast(self, user: str, topic: str, msg: Message) -> int:
        """Deliver ``msg`` to every open subscription of ``topic``; returns
        how many received it."""
        check(topic, msg)
        with self._lock:
            sids = list(self._by_topic.get((user, topic), ()))
            for sid in sids:
                try:
                    self._subs[sid][1].put(msg, f"subscription {sid} of {topic!r}")
                except MessagingError:
                    pass  # a subscriber that never reads loses messages, others don't
            return len(sids)

    def next(self, sid: int) -> Future:
        """A future of the subscription's next message.

        Raises:
            MessagingError: unknown (or closed) subscription.
        """
        with self._lock:
            entry = self._subs.get(sid)
            if entry is None:
                raise MessagingError(f"no open subscription {sid}")
            return entry[1].take()

    def unsubscribe(self, sid: int) -> None:
        """Close a subscription; its pending ``next`` calls raise EOFError."""
        with self._lock:
            entry = self._subs.pop(sid, None)
            if entry is None:
                return
            key, box = entry
            self._by_topic[key].discard(sid)
            if not self._by_topic[key]:
                del self._by_topic[key]
        box.fail_waiters(EOFError(f"subscription {sid} was closed"))

    def cancel_pull(self, fut: Future) -> None:
        """Forget a pending pull (its instance ended) so no message is lost to it."""
        with self._lock:
            for box in self._queues.values():
                if fut in box.waiters:
                    box.waiters.remove(fut)
        fut.cancel()

    def counts(self) -> dict[str, int]:
        """``topics`` (queue topics with state) and ``subscriptions`` open."""
        with self._lock:
            return {"topics": len(self._queues), "subscriptions": len(self._subs)}
