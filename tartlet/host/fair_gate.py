"""Per-user queues in front of an engine's scheduler: a user's forward
passes wait behind their own, not everyone's (issue 40).

The scheduler shares each round's *token* budget between users
(``max_batch_tokens``), but decode steps are one token each: a user with
80 sequences decoding puts 80 rows in every round next to another user's 8,
and on a CPU a round's time grows with its rows, so the small user's
latency grows with the big user's load. The gate bounds the passes a user
has in the scheduler (queued or running; a decode continuation counts as
one until its last step) while other users have work:

    cap(user) = max(MIN_SHARE, the largest demand among the other users)

where a user's demand is its passes in the scheduler plus those waiting
here, and a user that had work in the last :data:`ACTIVE_S` seconds counts
with its peak demand of that time (a closed-loop client between two
requests still counts). Max-min fairness of concurrency: the small user is
never held; the big one is held to the small one's level (at least
``MIN_SHARE``); a user alone, or users of equal demand, are not held at all.
Without auth every request is one user's and nothing is ever held.

Order. A held pass waits in its user's FIFO; a later pass or command that
touches a sequence with held work waits behind it in the same FIFO, so each
sequence sees its passes and commands (fork, truncate, free, ...) in the
order they were made. Passes and commands are handed to the scheduler by
one thread at a time (whoever finds the hand-off free drains everything
releasable), never while this gate's lock is held: the scheduler resolves
futures, whose callbacks come here, with its own lock held.
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from ..engine.core.requests import ForwardRequest, check_pass
from ..engine.core.scheduler import Scheduler
from ..engine.core.sequence import Sequence

T = TypeVar("T")

#: Passes a user may always have in the scheduler, whatever others do.
MIN_SHARE = 4
#: Seconds a user counts as active (with its peak demand) after its last work.
ACTIVE_S = 1.0


class _Held:
    """One pass or command waiting in its user's FIFO."""

    __slots__ = ("req", "fn", "touches", "future")

    def __init__(self, req: ForwardRequest | None, fn: Callable[[], Any] | None, touches: tuple[Sequence, ...],
                 future: Future[Any] | None) -> None:  # fmt: skip
        self.req, self.fn, self.touches, self.future = req, fn, touches, future


class FairGate:
    """Per-user FIFOs of forward passes (and the commands ordered behind
    them) in front of ``scheduler``; :meth:`submit` and :meth:`command` take
    the place of the scheduler's own.

    Args:
        scheduler: the engine's scheduler.
        min_share: passes a user may always have in the scheduler (>= 1).
        active_s: seconds a user with no work still counts, at its peak demand.
    """

    def __init__(self, scheduler: Scheduler, min_share: int = MIN_SHARE, active_s: float = ACTIVE_S) -> None:
        self.scheduler = scheduler
        self.min_share = max(1, min_share)
        self.active_s = active_s
        self._lock = threading.Lock()
        self._handoff = threading.Lock()
        self._inflight: dict[str, int] = collections.Counter()  # passes in the scheduler
        self._fifo: dict[str, collections.deque[_Held]] = {}  # held work per user
        self._held_passes: dict[str, int] = collections.Counter()
        self._held_seqs: dict[int, int] = collections.Counter()  # id(seq) -> held items touching it
        self._seq_user: dict[int, str] = {}  # id(seq) -> the user whose FIFO holds its work
        self._peak: dict[str, tuple[int, float]] = {}  # user -> (peak demand, since when)
        #: passes held here at least once (a measure of the gate at work)
        self.held_total = 0

    # -- the scheduler's interface -------------------------------------------------
    def submit(self, req: ForwardRequest) -> Future[list[object]]:
        """Queue a forward pass for ``req.user``; returns its future (the
        request's own).

        Raises:
            ValueError: empty input, or an output index outside the input
                (at once, as the scheduler's ``submit``).
        """
        check_pass(req.tokens, req.outputs)
        user = req.user
        with self._lock:
            direct = (not self._fifo.get(user) and id(req.seq) not in self._held_seqs
                      and self._inflight[user] < self._cap(user, time.monotonic()))  # fmt: skip
            if direct:
                self._inflight[user] += 1
            else:
                self._hold(user, _Held(req, None, (req.seq,), None))
                self._held_passes[user] += 1
                self.held_total += 1
            self._note(user)
            others_held = any(self._fifo.values())
        if direct:
            self._send_pass(user, req)
        if others_held:  # held work may go now (this user's demand may raise the others' caps)
            self._drive()
        return req.future

    def command(self, fn: Callable[[], T], *touches: Sequence) -> Future[T]:
        """Queue ``fn`` to run on the scheduler thread, after the passes (held
        here or queued there) of the sequences in ``touches``; returns its
        future."""
        with self._lock:
            owner = next((self._seq_user[id(s)] for s in touches if id(s) in self._seq_user), None)
            if owner is not None:
                outer: Future[T] = Future()
                self._hold(owner, _Held(None, fn, touches, outer))
        if owner is None:
            return self.scheduler.command(fn, *touches)
        self._drive()
        return outer

    def held(self, user: str) -> int:
        """Passes of ``user`` waiting here now."""
        with self._lock:
            return self._held_passes[user]

    def inflight(self, user: str) -> int:
        """Passes of ``user`` in the scheduler now."""
        with self._lock:
            return self._inflight[user]

    # -- internals (the lock held unless said) --------------------------------------
    def _hold(self, user: str, item: _Held) -> None:
        self._fifo.setdefault(user, collections.deque()).append(item)
        for s in item.touches:
            self._held_seqs[id(s)] += 1
            self._seq_user[id(s)] = user

    def _demand(self, user: str, now: float) -> int:
        """Passes of ``user`` here and in the scheduler, or its peak of the
        last ``active_s`` seconds when higher."""
        d = self._inflight[user] + self._held_passes[user]
        peak, at = self._peak.get(user, (0, 0.0))
        return max(d, peak) if now - at < self.active_s else d

    def _note(self, user: str) -> None:
        """Track ``user``'s peak demand: a new peak, or the demand now once the
        peak is ``active_s`` old; forget an idle user."""
        now = time.monotonic()
        d = self._inflight[user] + self._held_passes[user]
        peak, at = self._peak.get(user, (0, 0.0))
        if d >= peak or now - at >= self.active_s:
            peak, at = d, now
            self._peak[user] = (d, now)
        if not d and not peak and not self._fifo.get(user):
            for table in (self._peak, self._fifo, self._inflight, self._held_passes):
                table.pop(user, None)

    def _cap(self, user: str, now: float) -> float:
        others = [self._demand(u, now) for u in self._peak if u != user]
        others = [d for d in others if d > 0]
        return max(self.min_share, max(others)) if others else float("inf")

    def _take_releasable(self) -> list[tuple[str, _Held]]:
        """Pop from the FIFOs every head that may go to the scheduler now."""
        out: list[tuple[str, _Held]] = []
        now = time.monotonic()
        for user, fifo in list(self._fifo.items()):
            while fifo:
                head = fifo[0]
                if head.req is not None:
                    if self._inflight[user] >= self._cap(user, now):
                        break
                    self._inflight[user] += 1
                    self._held_passes[user] -= 1
                out.append((user, fifo.popleft()))
        return out

    def _releasable(self) -> bool:
        now = time.monotonic()
        return any(fifo and (fifo[0].req is None or self._inflight[u] < self._cap(u, now)) for u, fifo in self._fifo.items())

    # -- hand-off (no gate lock held) ---------------------------------------------------
    def _drive(self) -> None:
        """Hand every releasable held item to the scheduler, in FIFO order;
        returns at once when another thread is doing it (it will see ours)."""
        while True:
            if not self._handoff.acquire(blocking=False):
                return
            try:
                while True:
                    with self._lock:
                        batch = self._take_releasable()
                    if not batch:
                        break
                    for user, item in batch:
                        self._send(user, item)
            finally:
                self._handoff.release()
            with self._lock:
                if not self._releasable():
                    return

    def _send(self, user: str, item: _Held) -> None:
        try:
            if item.req is not None:
                self._send_pass(user, item.req)
            else:
                assert item.fn is not None and item.future is not None
                _chain(self._command(item.fn, item.touches), item.future)
        finally:
            with self._lock:
                for s in item.touches:
                    self._held_seqs[id(s)] -= 1
                    if not self._held_seqs[id(s)]:
                        del self._held_seqs[id(s)]
                        self._seq_user.pop(id(s), None)

    def _command(self, fn: Callable[[], Any], touches: tuple[Sequence, ...]) -> Future[Any]:
        try:
            return self.scheduler.command(fn, *touches)
        except RuntimeError as e:  # the scheduler stopped meanwhile
            fut: Future[Any] = Future()
            fut.set_exception(e)
            return fut

    def _send_pass(self, user: str, req: ForwardRequest) -> None:
        """Give ``req`` to the scheduler (counted in flight already)."""

        def done(_: Future[list[object]]) -> None:
            with self._lock:
                self._inflight[user] -= 1
                self._note(user)
                held = any(self._fifo.values())
            if held:  # (runs on the scheduler thread for most passes: nothing more when nothing waits)
                self._drive()

        try:
            self.scheduler.submit(req)
        except RuntimeError as e:  # the scheduler stopped meanwhile
            if not req.future.done():
                req.future.set_exception(e)
        req.future.add_done_callback(done)


def _chain(inner: Future[T], outer: Future[T]) -> None:
    """Resolve ``outer`` as ``inner`` resolves."""

    def copy(f: Future[T]) -> None:
        if f.cancelled():
            outer.cancel()
        elif (e := f.exception()) is not None:
            outer.set_exception(e)
        else:
            outer.set_result(f.result())

    inner.add_done_callback(copy)
