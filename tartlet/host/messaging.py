"""Messages between inferlets: queues (push/pull) and broadcast (subscribe).

Topics are scoped by user (the instance owner): inferlets of different users
never see each other's topics. A *queue* topic delivers each pushed message
to exactly one puller (FIFO, waiting pullers first); a *broadcast* topic
delivers each message to every subscription open at the time it is sent.
Waiting calls return a :class:`concurrent.futures.Future` so native and
sandboxed inferlets both wait on them. Thread-safe.

Memory is bounded per user: waiting messages (in queue topics and in
subscriptions; a broadcast counts once per subscription that holds it) may
take ``max_user_bytes`` in all, and ``max_user_topics`` topics may hold
state at once (a queue topic with waiting messages or pullers, a broadcast
topic with subscriptions). A push, broadcast, pull or subscribe past them
raises :class:`~tartlet.sdk.errors.LimitError` naming the limit; nothing
else is affected. A topic with no state left is forgotten. Messages queued
on a queue topic belong to the user, not to the instance that pushed them:
they wait for a puller after their sender ended (within the byte limit);
a subscription's messages are dropped when it closes (its instance ended).
"""

from __future__ import annotations

import collections
import itertools
import threading
from concurrent.futures import Future
from typing import Protocol

from ..sdk.errors import LimitError, MessagingError
from .session import message_bytes

Message = str | bytes

#: Largest message, bytes (text counted as UTF-8).
MAX_MESSAGE_BYTES = 1 << 20
#: Largest backlog of one queue topic or one subscription, messages.
MAX_BACKLOG = 10_000
#: Default bytes of waiting messages per user (``[limits] max_messaging_bytes_per_user``).
MAX_USER_BYTES = 64 * 2**20
#: Default topics with state per user (``[limits] max_topics_per_user``).
MAX_USER_TOPICS = 1024


def check(topic: str, msg: Message) -> int:
    """Validate ``topic`` and ``msg``; returns the message's size in bytes.

    Raises:
        MessagingError: a topic that is not a str of 1-256 characters, a
            message that is not str or bytes or larger than 1 MiB.
    """
    if not isinstance(topic, str) or not topic or len(topic) > 256:
        raise MessagingError(f"a topic is a non-empty str of at most 256 characters, got {topic!r:.300}")
    if not isinstance(msg, (str, bytes)):
        raise MessagingError(f"messages are str or bytes, got {type(msg).__name__}")
    size = message_bytes(msg)
    if size > MAX_MESSAGE_BYTES:
        raise MessagingError(f"message of {size} bytes is larger than the limit of {MAX_MESSAGE_BYTES}")
    return size


class _Mailbox:
    """Messages waiting for takers (with their sizes), and takers waiting
    for messages. Used under the bus lock."""

    def __init__(self) -> None:
        self.items: collections.deque[tuple[Message, int]] = collections.deque()
        self.waiters: collections.deque[Future[Message]] = collections.deque()

    def hand_over(self, msg: Message) -> bool:
        """Give ``msg`` to the first live waiter; False when none waits."""
        while self.waiters:
            fut = self.waiters.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_result(msg)
                return True
        return False

    def idle(self) -> bool:
        return not self.items and not self.waiters

    def fail_waiters(self, exc: Exception) -> None:
        waiters, self.waiters = self.waiters, collections.deque()
        for fut in waiters:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)


class MessageBus:
    """All topics of one server.

    Args:
        max_user_bytes: bytes of waiting messages one user may hold (None:
            unlimited).
        max_user_topics: topics with state one user may have (None:
            unlimited).
    """

    def __init__(self, max_user_bytes: int | None = MAX_USER_BYTES, max_user_topics: int | None = MAX_USER_TOPICS) -> None:
        self.max_user_bytes = max_user_bytes
        self.max_user_topics = max_user_topics
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], _Mailbox] = {}
        self._subs: dict[int, tuple[tuple[str, str], _Mailbox]] = {}
        self._by_topic: dict[tuple[str, str], set[int]] = {}
        self._topics: dict[str, set[str]] = collections.defaultdict(set)
        self._bytes: dict[str, int] = collections.defaultdict(int)
        self._ids = itertools.count(1)

    # -- accounting (under the lock) -----------------------------------------------
    def _open_topic(self, user: str, topic: str) -> None:
        topics = self._topics[user]
        if topic in topics:
            return
        if self.max_user_topics is not None and len(topics) >= self.max_user_topics:
            raise LimitError(
                f"user {user or '(local)'!r} already has {len(topics)} messaging topics in use, the limit "
                "([limits] max_topics_per_user); let pullers drain queues or close subscriptions"
            )
        topics.add(topic)

    def _maybe_forget(self, key: tuple[str, str]) -> None:
        box = self._queues.get(key)
        if box is not None and box.idle():
            del self._queues[key]
            box = None
        if box is None and key not in self._by_topic:
            user, topic = key
            self._topics[user].discard(topic)
            if not self._topics[user]:
                del self._topics[user]

    def _charge(self, user: str, n: int) -> None:
        if self.max_user_bytes is not None and self._bytes[user] + n > self.max_user_bytes:
            have = self._bytes[user]
            if not have:
                del self._bytes[user]
            raise LimitError(
                f"messages waiting for user {user or '(local)'!r} would take {have + n} bytes, more than the limit "
                f"of {self.max_user_bytes} ([limits] max_messaging_bytes_per_user); let pullers and subscribers catch up"
            )
        self._bytes[user] += n

    def _release(self, user: str, n: int) -> None:
        left = self._bytes[user] - n
        if left > 0:
            self._bytes[user] = left
        else:
            self._bytes.pop(user, None)

    def _queue_box(self, key: tuple[str, str]) -> _Mailbox:
        box = self._queues.get(key)
        if box is None:
            self._open_topic(*key)
            box = self._queues[key] = _Mailbox()
        return box

    def _take(self, key: tuple[str, str], box: _Mailbox) -> Future[Message]:
        fut: Future[Message] = Future()
        if box.items:
            msg, size = box.items.popleft()
            self._release(key[0], size)
            fut.set_result(msg)
        else:
            box.waiters.append(fut)
        return fut

    # -- queue topics ----------------------------------------------------------------
    def push(self, user: str, topic: str, msg: Message) -> None:
        """Queue ``msg`` on ``topic`` for one puller.

        Raises:
            MessagingError: bad topic/message, or the topic already holds
                :data:`MAX_BACKLOG` messages.
            LimitError: the user's waiting messages would pass
                ``max_user_bytes``, or a new topic would pass ``max_user_topics``.
        """
        size = check(topic, msg)
        key = (user, topic)
        with self._lock:
            box = self._queue_box(key)
            try:
                if box.hand_over(msg):
                    return
                if len(box.items) >= MAX_BACKLOG:
                    raise MessagingError(f"queue topic {topic!r} already holds {MAX_BACKLOG} undelivered messages")
                self._charge(user, size)
                box.items.append((msg, size))
            finally:
                self._maybe_forget(key)

    def pull(self, user: str, topic: str) -> Future[Message]:
        """A future of the next message pushed on ``topic`` (FIFO).

        Raises:
            MessagingError: bad topic.
            LimitError: a new topic would pass ``max_user_topics``.
        """
        check(topic, "")
        key = (user, topic)
        with self._lock:
            fut = self._take(key, self._queue_box(key))
            self._maybe_forget(key)
            return fut

    # -- broadcast topics ------------------------------------------------------------
    def subscribe(self, user: str, topic: str) -> int:
        """Open a subscription; it receives every later broadcast on ``topic``.

        Raises:
            MessagingError: bad topic.
            LimitError: a new topic would pass ``max_user_topics``.
        """
        check(topic, "")
        key = (user, topic)
        with self._lock:
            self._open_topic(user, topic)
            sid = next(self._ids)
            self._subs[sid] = (key, _Mailbox())
            self._by_topic.setdefault(key, set()).add(sid)
            return sid

    def broadcast(self, user: str, topic: str, msg: Message) -> int:
        """Deliver ``msg`` to every open subscription of ``topic``; returns
        how many received it (a subscription already holding
        :data:`MAX_BACKLOG` messages misses it).

        Raises:
            MessagingError: bad topic/message.
            LimitError: the copies that would wait in subscriptions would
                pass ``max_user_bytes`` (then no subscription gets it).
        """
        size = check(topic, msg)
        with self._lock:
            sids = list(self._by_topic.get((user, topic), ()))
            boxes = [self._subs[sid][1] for sid in sids]
            waiting = [b for b in boxes if not b.waiters and len(b.items) < MAX_BACKLOG]
            self._charge(user, size * len(waiting))
            charged = len(waiting)
            for box in boxes:
                if box.hand_over(msg):
                    continue
                if len(box.items) >= MAX_BACKLOG:
                    continue  # a subscriber that never reads loses messages, others don't
                if charged:
                    box.items.append((msg, size))
                    charged -= 1
            if charged:  # a waiter went away (cancelled) after the count: nothing more to keep
                self._release(user, size * charged)
            return len(sids)

    def next(self, sid: int) -> Future[Message]:
        """A future of the subscription's next message.

        Raises:
            MessagingError: unknown (or closed) subscription.
        """
        with self._lock:
            entry = self._subs.get(sid)
            if entry is None:
                raise MessagingError(f"no open subscription {sid}")
            return self._take(*entry)

    def unsubscribe(self, sid: int) -> None:
        """Close a subscription: its waiting messages are dropped and its
        pending ``next`` calls raise EOFError."""
        with self._lock:
            entry = self._subs.pop(sid, None)
            if entry is None:
                return
            key, box = entry
            self._release(key[0], sum(size for _, size in box.items))
            box.items.clear()
            sids = self._by_topic.get(key)
            if sids is not None:
                sids.discard(sid)
                if not sids:
                    del self._by_topic[key]
            self._maybe_forget(key)
        box.fail_waiters(EOFError(f"subscription {sid} was closed"))

    def cancel_pull(self, fut: Future[Message]) -> None:
        """Forget a pending pull (its instance ended) so no message is lost to it."""
        with self._lock:
            for key, box in list(self._queues.items()):
                if fut in box.waiters:
                    box.waiters.remove(fut)
                    self._maybe_forget(key)
        fut.cancel()

    def usage(self, user: str) -> dict[str, int]:
        """``bytes`` of waiting messages and ``topics`` with state of ``user``."""
        with self._lock:
            return {"bytes": self._bytes.get(user, 0), "topics": len(self._topics.get(user, ()))}

    def counts(self) -> dict[str, int]:
        """``topics`` (queue topics with state) and ``subscriptions`` open."""
        with self._lock:
            return {"topics": len(self._queues), "subscriptions": len(self._subs)}


class Bus(Protocol):
    """What the host needs of a message bus: :class:`MessageBus` (one
    process) or :class:`tartlet.host.pg_messaging.PgMessageBus` (replicas
    sharing a PostgreSQL database), with the semantics documented on
    :class:`MessageBus`."""

    def push(self, user: str, topic: str, msg: Message) -> None: ...
    def pull(self, user: str, topic: str) -> Future[Message]: ...
    def subscribe(self, user: str, topic: str) -> int: ...
    def broadcast(self, user: str, topic: str, msg: Message) -> int: ...
    def next(self, sid: int) -> Future[Message]: ...
    def unsubscribe(self, sid: int) -> None: ...
    def cancel_pull(self, fut: Future[Message]) -> None: ...
    def usage(self, user: str) -> dict[str, int]: ...
    def counts(self) -> dict[str, int]: ...
