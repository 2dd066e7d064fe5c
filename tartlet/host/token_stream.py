"""The tokens of a host-side generation, handed to the inferlet as they are
sampled (:meth:`tartlet.host.api.HostApi.generate_stream`).

The passes of the generation are queued by the scheduler itself, each from
the completion of the pass before (``ForwardRequest.then``), so the model
never waits for the inferlet: the inferlet takes what has been sampled
since it last asked (one token when it keeps up, several when it lags; or
a chunk of a given size) and streams it, while the next passes run. This is the decoupling of vLLM's
engine core from its output processing, on the CPU as on a GPU: with the
per-token round trip of ``forward``, a decode step of a batch waits for
every inferlet in it to take its token and queue its next pass.

Threads: :meth:`push` and :meth:`end` run on the scheduler thread (from the
pass continuation and the chain's done callback); :meth:`next` and
:meth:`close` on the inferlet's.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future


class TokenStream:
    """A buffer of sampled token ids between the scheduler and an inferlet.

    Attributes:
        stopping: set by :meth:`close` (or the instance closing); the
            generation's continuation then queues no further pass.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: list[int] = []
        self._waiter: Future[list[int]] | None = None
        self._count = 0  # the waiter's count (see next)
        self._closer: Future[list[int]] | None = None
        self._ended = False
        self._error: BaseException | None = None
        self.stopping = False

    # -- scheduler side ------------------------------------------------------------
    def push(self, token: int) -> None:
        """A token was sampled: hand it to a waiting :meth:`next`, else keep it."""
        with self._lock:
            self._buf.append(token)
            give = self._take_waiter()
        _resolve(give)

    def end(self, error: BaseException | None) -> None:
        """The generation ended (``error``: the pass that failed, None when
        it stopped at ``max_steps``, a stop token or :meth:`close`)."""
        with self._lock:
            self._ended, self._error = True, error
            give = self._take_waiter()
            closer, self._closer = self._closer, None
            rest = self._buf if closer is not None else []
            if closer is not None:
                self._buf = []
        _resolve(give)
        # the closer is cancelled when its inferlet went away meanwhile (an
        # abort while it awaited the close): nobody takes the rest then
        if closer is not None and closer.set_running_or_notify_cancel():
            closer.set_result(rest)

    def _take_waiter(self) -> tuple[Future[list[int]], list[int] | BaseException] | None:
        """Under the lock: the waiter and what it gets (tokens, the end as
        ``[]``, or the error, reported once), if it can get something now;
        the caller resolves it after the lock. A waiter cancelled meanwhile
        is dropped and the tokens stay buffered."""
        w = self._waiter
        if w is None or not (len(self._buf) >= max(1, self._count) or self._ended):
            return None
        self._waiter = None
        if not w.set_running_or_notify_cancel():
            return None
        if self._buf:
            n = self._count or len(self._buf)
            got, self._buf = self._buf[:n], self._buf[n:]
            return w, got
        if self._error is not None:
            err, self._error = self._error, None
            return w, err
        return w, []

    # -- inferlet side -------------------------------------------------------------
    def next(self, count: int = 0) -> Future[list[int]]:
        """Future of the next tokens: with ``count`` 0, those sampled since
        the last call (at least one); with ``count`` >= 1, the next
        ``count`` (fewer only once the generation has ended: a caller that
        processes tokens in chunks wakes once a chunk while the passes go
        on). ``[]`` once the generation has ended and every token was
        taken; it fails with the error of a failed pass (once, after the
        tokens sampled before it).

        Raises:
            ValueError: a :meth:`next` is still pending, the stream was
                closed, or ``count`` is not an int >= 0.
        """
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        fut: Future[list[int]] = Future()
        with self._lock:
            if self.stopping:
                raise ValueError("the token stream was closed")
            if self._waiter is not None and not self._waiter.done():
                raise ValueError("a stream_next of this stream is still pending")
            self._waiter, self._count = fut, count
            give = self._take_waiter()
        _resolve(give)
        return fut

    def close(self) -> Future[list[int]]:
        """Stop after the pass in flight; future of the tokens sampled and
        not taken by :meth:`next` (the last one is not in the context: it
        is the caller's pending token), once no pass is left to run.
        Idempotent (a second call's future gets ``[]``)."""
        fut: Future[list[int]] = Future()
        with self._lock:
            self.stopping = True
            waiter, self._waiter = self._waiter, None
            if self._closer is not None:  # closed before: the first close gets the rest
                rest, done = [], True
            elif self._ended:
                rest, self._buf, done = self._buf, [], True
            else:
                self._closer, rest, done = fut, [], False
        if waiter is not None and waiter.set_running_or_notify_cancel():
            waiter.set_result([])
        if done:
            fut.set_result(rest)
        return fut


def _resolve(give: tuple[Future[list[int]], list[int] | BaseException] | None) -> None:
    if give is None:
        return
    fut, value = give
    if isinstance(value, BaseException):
        fut.set_exception(value)
    else:
        fut.set_result(value)
