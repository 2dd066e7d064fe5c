"""Messages between inferlets of the same user.

Queue topics: :func:`push` a message, :func:`pull` takes the oldest one
(each message goes to exactly one puller). Broadcast topics:
:func:`subscribe` opens a :class:`Subscription` that receives every
:func:`broadcast` sent after it was opened::

    sub = messaging.subscribe("news")
    messaging.broadcast("news", "hello")
    assert await sub.next() == "hello"

Messages are ``str`` or ``bytes`` of at most 1 MiB. What waits is bounded
per user (server ``[limits]``): ``max_messaging_bytes_per_user`` bytes of
undelivered messages and ``max_topics_per_user`` topics in use; a call past
them raises ``LimitError`` naming the limit. Messages pushed on a queue
topic wait for a puller after their sender ended; a subscription's
undelivered messages are dropped when it closes.
"""

from __future__ import annotations

from . import _binding


def push(topic: str, msg: str | bytes) -> None:
    """Queue ``msg`` on ``topic`` for one puller.

    Raises:
        ValueError: bad topic, non-str/bytes or oversized message, full backlog.
        LimitError: the user's undelivered messages or topics would pass
            their limit.
    """
    _binding.host().messaging_push(topic, msg)


async def pull(topic: str) -> str | bytes:
    """The next message pushed on ``topic`` (waits for one).

    Raises:
        LimitError: a new topic would pass the user's topic limit.
    """
    return await _binding.wait(_binding.host().messaging_pull(topic))


def broadcast(topic: str, msg: str | bytes) -> int:
    """Send ``msg`` to every open subscription of ``topic``; returns how many got it.

    Raises:
        LimitError: the copies waiting in subscriptions would pass the
            user's byte limit (then none is delivered).
    """
    return _binding.host().messaging_broadcast(topic, msg)


class Subscription:
    """An open subscription: ``await sub.next()`` or ``async for msg in sub``;
    ``sub.close()`` (also a context manager). Closed when the inferlet ends."""

    def __init__(self, topic: str) -> None:
        self.topic = topic
        self._h = _binding.host().messaging_subscribe(topic)
        self.closed = False

    async def next(self) -> str | bytes:
        """The next broadcast message.

        Raises:
            EOFError: the subscription was closed.
        """
        return await _binding.wait(_binding.host().messaging_next(self._h))

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> str | bytes:
        try:
            return await self.next()
        except EOFError:
            raise StopAsyncIteration from None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            _binding.host().messaging_unsubscribe(self._h)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def subscribe(topic: str) -> Subscription:
    """Subscribe to broadcasts on ``topic`` (from now on)."""
    return Subscription(topic)
