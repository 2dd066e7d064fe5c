"""Per-user rate limits: one token bucket per user and kind of work.

Kinds (the ``[limits]`` key of each rate):

==========  ========================  ==============================================
kind        rate key                  what takes a token
==========  ========================  ==============================================
launch      ``max_launches_per_s``    a client's launch, a child launch
build       ``max_builds_per_min``    a build of an uploaded program (not cached yet)
alloc       ``max_allocs_per_s``      context fork, snapshot save, open, take
message     ``max_messages_per_s``    messaging push, broadcast, subscribe; a
                                      client's ``send``
==========  ========================  ==============================================

A bucket holds ``rate * burst_s`` tokens (at least one) and refills at
``rate`` per second, so in any ``T`` seconds a user gets at most
``max(1, rate * burst_s) + rate * T`` tokens, those taken ahead by
:meth:`RateLimits.wait_for` included (their waits space them at the rate). A host call or request that finds no token raises
:class:`~tartlet.sdk.errors.LimitError` naming the key (:meth:`RateLimits.take`);
a client's launch may instead wait for its token (:meth:`RateLimits.wait_for`),
so a user who floods launches only slows down their own launches: each
user's buckets are their own.
"""

from __future__ import annotations

import threading
import time

from ..sdk.errors import LimitError

#: kind -> (config key, seconds the rate is per)
KINDS: dict[str, tuple[str, float]] = {
    "launch": ("max_launches_per_s", 1.0),
    "build": ("max_builds_per_min", 60.0),
    "alloc": ("max_allocs_per_s", 1.0),
    "message": ("max_messages_per_s", 1.0),
}
#: kind -> what its tokens pay for, in messages
NOUNS = {"launch": "launches", "build": "builds", "alloc": "allocating calls", "message": "messages"}
#: Buckets kept per kind before idle full ones are forgotten.
MAX_BUCKETS = 10_000


class RateLimits:
    """Token buckets per (user, kind).

    Args:
        rates: ``{kind: rate}`` in the unit of the kind's key (per second,
            or per minute for ``build``); a missing or None rate is unlimited.
        burst_s: seconds' worth of tokens a bucket holds (at least one token).

    Raises:
        ValueError: an unknown kind, a rate or ``burst_s`` not positive.
    """

    def __init__(self, rates: dict[str, float | None], burst_s: float = 2.0) -> None:
        if not burst_s > 0:
            raise ValueError(f"burst_s must be positive, got {burst_s!r}")
        self._per_s: dict[str, float] = {}
        for kind, rate in rates.items():
            if kind not in KINDS:
                raise ValueError(f"unknown rate kind {kind!r} (known: {', '.join(KINDS)})")
            if rate is None:
                continue
            if not rate > 0:
                raise ValueError(f"rate of {kind!r} must be positive, got {rate!r}")
            self._per_s[kind] = rate / KINDS[kind][1]
        self.burst_s = float(burst_s)
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # (user, kind) -> (tokens, at)
        self._lock = threading.Lock()

    def _capacity(self, kind: str) -> float:
        return max(1.0, self._per_s[kind] * self.burst_s)

    def _claim(self, user: str, kind: str, max_wait_s: float) -> float:
        """Take a token of ``user``'s ``kind`` bucket, going into debt for at
        most ``max_wait_s`` seconds' worth; returns how long the caller must
        wait before acting (0: now), or -1 when the wait would be longer
        (nothing taken)."""
        rate = self._per_s.get(kind)
        if rate is None:
            return 0.0
        now = time.monotonic()
        with self._lock:
            tokens, at = self._buckets.get((user, kind), (self._capacity(kind), now))
            tokens = min(self._capacity(kind), tokens + (now - at) * rate)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / rate
            if wait > max_wait_s:
                self._buckets[(user, kind)] = (tokens, now)
                return -1.0
            self._buckets[(user, kind)] = (tokens - 1, now)
            if len(self._buckets) > MAX_BUCKETS:
                self._forget_full(now)
        return wait

    def _forget_full(self, now: float) -> None:
        """Drop buckets that have refilled (they start full again anyway)."""
        for (user, kind), (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self._per_s[kind] >= self._capacity(kind):
                del self._buckets[(user, kind)]

    def _error(self, user: str, kind: str) -> LimitError:
        key, per = KINDS[kind]
        rate = self._per_s[kind] * per
        return LimitError(
            f"user {user or '(local)'!r} goes past the rate limit of {rate:g} {NOUNS[kind]} per "
            f"{'minute' if per == 60 else 'second'} ([limits] {key}); slow down and retry"
        )

    def take(self, user: str, kind: str) -> None:
        """Take one token now.

        Raises:
            LimitError: ``user``'s ``kind`` bucket is empty (the message
                names the rate's key).
        """
        if self._claim(user, kind, 0.0) < 0:
            raise self._error(user, kind)

    def wait_for(self, user: str, kind: str, max_wait_s: float) -> float:
        """Take one token, possibly ahead of time; returns the seconds the
        caller must wait before acting (0: act now). Tokens taken ahead are
        paid back as the bucket refills, so waiters of one user are spaced
        at the rate.

        Raises:
            LimitError: the wait would be longer than ``max_wait_s`` seconds.
        """
        wait = self._claim(user, kind, max_wait_s)
        if wait < 0:
            raise self._error(user, kind)
        return wait
