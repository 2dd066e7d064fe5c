"""The scheduler: one thread owns the model and runs every forward pass.

Everything else submits work to it, from any thread:

* **forward requests** (:class:`ForwardRequest`): tokens to append to a
  sequence, with optional positions, attention masks and output slots;
* **commands**: small KV edits (fork, truncate, mask, free, ...) that must be
  ordered with respect to the forward passes of the sequences they touch.

Both resolve a :class:`concurrent.futures.Future`, which native inferlets
await through ``asyncio.wrap_future`` and sandboxed ones block on.

Each round the loop drains the queue in FIFO order: commands run at once
unless they touch a sequence that already has a forward pass in the batch
being built (then the round stops there, which keeps per-sequence order);
forward requests join the batch under a token budget (``max_batch_tokens``),
long prefills being split into chunks across rounds (chunked prefill). The
batch then runs as one model call and each request's future resolves with its
slot results.

Batching needs requests to arrive together: after a round, the loop waits up
to ``batch_wait_s`` for the sequences it just served to submit their next
step, so concurrent decoders land in the same batch.

Pool pressure. A request that cannot get KV pages because the pool is full
(not because of its owner's quota, which fails it at once) waits in the
queue, with everything later that touches its sequence, while other
sequences run and free pages; later work on other sequences goes past it.
After ``kv_wait_s`` seconds of waiting it fails with ``KvCacheFullError``.

Overlap (``overlap=True``, the default on CUDA): a batch of greedy token
chains is not waited for before the next one is built and queued on the
device (:mod:`.lookahead`).

Fairness. Requests carry their user. When several users have work queued,
each user's tokens in one round are capped at an equal share of
``max_batch_tokens`` (a long prefill of one user is chunked to its share, so
other users' decode steps ride in the same round instead of waiting behind
it); work past a share waits for the next round, in order.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Callable, TypeVar

from ...sdk.errors import KvCacheFullError, KvQuotaError, SequenceFreedError
from ..cuda.graphs import DecodeGraphs
from ..models.llama import LlamaModel
from . import lookahead
from .admission import admission_error
from .attention_probe import ProbeAccumulator
from .hidden_states import HiddenSpec
from .kv_cache import PagePool
from .lookahead import lookaheads
from .model_runner import Launch, ModelRunner
from .requests import Chunk, Command, ForwardRequest, check_pass
from .sequence import Sequence
from .stats import SchedulerStats

T = TypeVar("T")

log = logging.getLogger(__name__)


class Scheduler:
    """Owns ``model`` and ``pool``; runs submitted work on its own thread.

    Args:
        model: the model to run.
        pool: its page pool.
        max_batch_tokens: token budget of one model call (>= 1).
        batch_wait_s: how long a round waits for last round's sequences to
            come back before running without them (seconds).
        max_seq_len: longest sequence allowed, in tokens.
        kv_wait_s: how long a request may wait for pages when the pool is
            full before it fails with ``KvCacheFullError`` (seconds).
        graphs: CUDA graphs of decode steps over ``pool`` for the model
            runner, or None.
        overlap: overlap scheduling (:mod:`.lookahead`).
    """

    def __init__(self, model: LlamaModel, pool: PagePool, max_batch_tokens: int = 512, batch_wait_s: float = 0.003,
                 max_seq_len: int | None = None, kv_wait_s: float = 10.0, graphs: DecodeGraphs | None = None,
                 overlap: bool = False) -> None:
        self.model = model
        self.pool = pool
        self.max_batch_tokens = max(1, max_batch_tokens)
        self.batch_wait_s = batch_wait_s
        self.max_seq_len = max_seq_len or model.config.max_position_embeddings
        self.kv_wait_s = kv_wait_s
        # every layer slides: sequences release the pages before the window (sequence.py)
        pool.window = model.config.uniform_window()
        self.stats = SchedulerStats()
        #: runs each batch (graph / fused C / op by op: model_runner.py)
        self.runner = ModelRunner(model, pool, self.stats, graphs)
        self.runner.feeds = overlap
        #: sequences of the launch in flight (overlap): other passes on them wait for it
        self._inflight: set[int] = set()
        #: the future of every lookahead until it takes its origin's (never resolved)
        self._placeholder: Future[list[object]] = Future()
        self._queue: collections.deque[ForwardRequest | Command[Any]] = collections.deque()
        self._cond = threading.Condition()
        self._expected: set[int] = set()
        self._running = False
        self._thread: threading.Thread | None = None
        #: a context manager factory the results of each step are handed out
        #: in (futures resolved, continuations run), or None: the host's
        #: ``tartlet.sdk._binding.hold_wakeups``, so the event loop waiting
        #: on a step's 64 token streams is woken once, not once a stream
        self.hold_wakeups: Callable[[], AbstractContextManager[object]] | None = None

    @property
    def overlap(self) -> bool:
        """Overlap scheduling (:mod:`.lookahead`): the model runner's
        device-side tokens are what lookaheads feed on, so this is its flag;
        set it while the engine is idle (the loop reads it each round)."""
        return self.runner.feeds

    @overlap.setter
    def overlap(self, on: bool) -> None:
        self.runner.feeds = on

    # -- submission (any thread) -------------------------------------------
    def submit(self, req: ForwardRequest) -> Future[list[object]]:
        """Queue a forward request; returns its future.

        Raises:
            ValueError: empty input, or an output index outside the input.
        """
        check_pass(req.tokens, req.outputs)
        req.enqueued_at = time.perf_counter()
        self._put(req, req.seq)
        return req.future

    def command(self, fn: Callable[[], T], *touches: Sequence) -> Future[T]:
        """Queue ``fn`` to run on the scheduler thread, ordered after earlier
        forward passes of the sequences in ``touches``; returns a future of
        its return value (or exception)."""
        cmd = Command(fn, touches)
        self._put(cmd, *touches)
        return cmd.future

    def _put(self, item: ForwardRequest | Command[Any], *seqs: Sequence) -> None:
        with self._cond:
            if not self._running:
                raise RuntimeError("the scheduler is not running")
            self._queue.append(item)
            for s in seqs:
                self._expected.discard(id(s))
            self._cond.notify()

    def queued(self) -> int:
        """Forward requests and commands queued and not yet run (those
        deferred behind their sequence's earlier work count too)."""
        with self._cond:  # _build holds it while deferred items are out of the queue
            return len(self._queue)

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._running:
                return
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="tartlet-scheduler", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        """Whether the scheduler thread runs (a server's health check)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Stop the loop; pending work fails with RuntimeError."""
        with self._cond:
            self._running = False
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        while self._queue:
            item = self._queue.popleft()
            if isinstance(item, ForwardRequest) and item.origin is not None:
                continue  # a lookahead: its origin's future fails (or resolved) on its own
            if not item.future.done():
                item.future.set_exception(RuntimeError("the engine stopped"))

    # -- the loop (scheduler thread) ----------------------------------------
    def _loop(self) -> None:
        inflight: Launch | None = None  # launched ahead and not finished (overlap)
        while True:
            with self._cond:
                if inflight is None:
                    while self._running and not self._queue:
                        self._cond.wait()
                    if not self._running:
                        return
                t0 = time.perf_counter()
                deadline = t0 + self.batch_wait_s
                while inflight is None and self._running and self._expected:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                self._expected.clear()
                t1 = time.perf_counter()
                items = self._build() if self._running else []
                self.stats.batch_wait_seconds += t1 - t0
                self.stats.overhead_seconds += time.perf_counter() - t1
                if inflight is None and not items and self._queue:
                    # only requests waiting for pages are left: sleep until
                    # new work (a free, say) arrives or a wait times out
                    self._cond.wait(0.02)
            launch = self._launch(items) if items else None
            if inflight is not None:
                self._finish_held(inflight)
            inflight, self._inflight = None, set()
            if launch is not None:
                ahead = lookaheads(launch, self._placeholder) if self.overlap else []
                if ahead:  # finished after the next launch
                    self.stats.lookaheads += len(ahead)
                    inflight, self._inflight = launch, {id(it.seq) for it in launch.items}
                    with self._cond:
                        self._queue.extend(ahead)
                else:
                    self._finish_held(launch)

    def _build(self) -> list[Chunk]:
        """Drain the queue into a batch (called with the condition held)."""
        items: list[Chunk] = []
        busy: set[int] = set()
        waiting: set[int] = set()  # sequences with a request waiting for pages
        left: list[ForwardRequest | Command[Any]] = []  # what waits, in queue order
        budget = self.max_batch_tokens
        q = self._queue
        try:
            self._drain(q, items, busy, waiting, left, budget)
        finally:
            q.extendleft(reversed(left))
        return items

    def _drain(self, q: collections.deque[ForwardRequest | Command[Any]], items: list[Chunk], busy: set[int], waiting: set[int],
               left: list[ForwardRequest | Command[Any]], budget: int) -> None:  # fmt: skip
        users = {r.user for r in q if isinstance(r, ForwardRequest)}
        share = max(1, self.max_batch_tokens // len(users)) if len(users) > 1 else self.max_batch_tokens
        used: dict[str, int] = {}  # tokens of each user in this round
        inflight = self._inflight
        while q and budget > 0:
            head = q[0]
            if isinstance(head, ForwardRequest) and head.dropped:  # a lookahead whose chain stopped
                q.popleft()
                self.stats.lookaheads_dropped += 1
                continue
            touched = head.touches if isinstance(head, Command) else (head.seq,)
            ahead = isinstance(head, ForwardRequest) and head.origin is not None  # a lookahead (lookahead.py)
            if any(id(s) in waiting or id(s) in busy or (id(s) in inflight and not ahead) for s in touched):
                # stays behind the earlier work of its sequence (next round)
                left.append(q.popleft())
                waiting.update(id(s) for s in touched)
                continue
            if isinstance(head, Command):
                q.popleft()
                if head.future.set_running_or_notify_cancel():
                    try:
                        head.future.set_result(head.fn())
                    except BaseException as e:  # reported to the submitter
                        head.future.set_exception(e)
                continue
            req = head
            seq = req.seq
            allowance = share - used.get(req.user, 0)
            if allowance <= 0:  # this user had its share of the round
                left.append(q.popleft())
                waiting.add(id(seq))
                continue
            if not req.started:
                # a request queued again by its continuation is running already
                if not (req.continued or req.future.set_running_or_notify_cancel()):
                    q.popleft()  # cancelled while queued
                    continue
                req.started = True
                if seq.freed:
                    q.popleft()
                    self._fail(req, SequenceFreedError(seq.error or "the context was destroyed"))
                    continue
                req.start_len = len(seq)
                refused = admission_error(seq, len(req.tokens), self.pool, self.max_seq_len, self.max_batch_tokens)
                if refused is not None:
                    q.popleft()
                    self._fail(req, refused)
                    continue
                if req.positions is None and req.attention is None and req.probe is None and not ahead:  # a probe: every query computed
                    first_out = min((s.index for s in req.outputs), default=len(req.tokens))
                    reused = seq.match_prefix(req.tokens, first_out, req.adapter_key)
                    req.done = reused
                    self.stats.prefix_tokens_reused += reused
                    if reused == len(req.tokens):
                        q.popleft()
                        req.future.set_result([])
                        continue
            n = min(len(req.tokens) - req.done, budget, allowance)
            lo, hi = req.done, req.done + n
            start = len(seq)
            positions = req.positions[lo:hi] if req.positions is not None else list(range(start, start + n))
            try:
                slots = seq.reserve(req.tokens[lo:hi], positions, custom_attention=req.attention is not None,
                                    adapter=req.adapter_key)
            except KvCacheFullError as e:
                if ahead:  # no wait: its chain goes on without overlap once its token is known
                    q.popleft()
                    self._fail(req, e)
                    continue
                if not isinstance(e, KvQuotaError):  # the pool is full: wait for pages, up to kv_wait_s
                    now = time.perf_counter()
                    req.waiting_since = req.waiting_since or now
                    if now - req.waiting_since < self.kv_wait_s:
                        left.append(q.popleft())
                        waiting.add(id(seq))
                        continue
                    e = KvCacheFullError(f"{e} (waited {self.kv_wait_s:g} s for pages to be freed)")
                q.popleft()
                self._rollback(req)
                req.future.set_exception(e)
                continue
            outs = [(k, s) for k, s in enumerate(req.outputs) if lo <= s.index < hi]
            req.waiting_since = 0.0
            chunk_mask = None if req.attention is None else req.attention[lo:hi]
            # hidden-state slots read the residual stream, not logits (hidden_states.py)
            logit_rows = [s.index - lo for _, s in outs if not isinstance(s.spec, HiddenSpec)]
            hidden = [(s.index - lo, s.spec.layer) for _, s in outs if isinstance(s.spec, HiddenSpec)]
            if req.probe is not None and req.probe_acc is None:  # the attention probe's values, over every chunk
                req.probe_acc = ProbeAccumulator(req.probe, req.start_len + len(req.tokens), self.model.config.num_key_value_heads)
            items.append(Chunk(seq, req.tokens[lo:hi], start, slots, logit_rows, chunk_mask,
                               adapter=req.adapter, req=req, out_slots=outs, hidden_index=hidden, probe=req.probe))
            busy.add(id(seq))
            budget -= n
            used[req.user] = used.get(req.user, 0) + n
            req.done = hi
            q.popleft()
            if hi < len(req.tokens):  # the rest of this prefill goes in the next round
                left.append(req)
                waiting.add(id(seq))

    def _rollback(self, req: ForwardRequest) -> None:
        if req.start_len >= 0 and not req.seq.freed and len(req.seq) > req.start_len:
            req.seq.truncate(req.start_len)

    def _fail(self, req: ForwardRequest, e: BaseException) -> None:
        """Fail ``req``'s future with ``e``; a lookahead not yet handed its
        origin's future is dropped instead (the chain goes on without it)."""
        if req.origin is not None:
            self.stats.lookaheads_dropped += 1
            lookahead.drop(req)
        else:
            req.future.set_exception(e)

    def _failed(self, items: list[Chunk], e: BaseException) -> None:
        """A model call failed: roll back and fail its requests (this batch
        only), and drop the lookaheads made for them."""
        log.error("forward pass failed", exc_info=e)
        for it in items:
            req = it.req
            self._rollback(req)
            if req.ahead is not None:
                lookahead.drop(req.ahead)
            if req.origin is not None or not req.future.done():
                self._fail(req, e)

    def _launch(self, items: list[Chunk]) -> Launch | None:
        """Queue the model call over ``items`` (the scheduler's lookaheads
        take their input tokens from the launch in flight)."""
        feeds = [(j, it.req.feed[0], it.req.feed[1]) for j, it in enumerate(items) if it.req.feed is not None]
        try:
            return self.runner.launch(items, feeds)
        except BaseException as e:  # a model failure fails this batch only
            self._failed(items, e)
            return None

    def _finish_held(self, launch: Launch) -> None:
        """:meth:`_finish` inside :attr:`hold_wakeups` (when set)."""
        hold = self.hold_wakeups
        if hold is None:
            self._finish(launch)
            return
        with hold():
            self._finish(launch)

    def _finish(self, launch: Launch) -> None:
        items = launch.items
        t0 = launch.t0
        try:
            results = self.runner.finish(launch)
        except BaseException as e:
            self._failed(items, e)
            return
        t1 = time.perf_counter()
        st = self.stats
        k = 0
        finished: list[ForwardRequest] = []
        for it in items:
            req = it.req
            if req.dropped:  # a lookahead whose chain stopped: its row was wasted
                st.lookaheads_dropped += 1
                k += len(it.out_slots)
                self._rollback(req)
                continue
            if not req.results:
                req.results = [None] * len(req.outputs)
            for pos, _ in it.out_slots:
                req.results[pos] = results[k]
                k += 1
            if req.done == len(req.tokens):
                lookahead.place_token(req)
            req.seq.commit_full_pages(it.start + it.n)
            if req.done == len(req.tokens):
                if req.probe_acc is not None:  # the attention probe's scores follow the slots' results
                    req.results.append(req.probe_acc.result(self.pool.page_size))
                    req.probe_acc = None
                finished.append(req)
        # Expect these sequences back before resolving, so a resubmission
        # that races with this line is not waited for.
        with self._cond:
            self._expected = {id(r.seq) for r in finished}
        again: list[ForwardRequest] = []  # re-armed by their continuation
        for req in finished:
            st.queue_wait_seconds += t0 - req.enqueued_at
            err = next((r for r in req.results if isinstance(r, Exception)), None)
            if err is not None:
                self._rollback(req)
                if req.ahead is not None:
                    lookahead.drop(req.ahead)
                req.future.set_exception(err)
            elif req.ahead is not None:
                lookahead.settle(req, again)
            elif req.then is None or not req.continue_into(again):
                req.future.set_result(req.results)
        if again:  # queued together: one lock round for the whole batch
            with self._cond:
                if self._running:
                    self._queue.extend(again)
                    self._expected.difference_update(id(r.seq) for r in again)
                    self._cond.notify()
                    again = []
            for req in again:  # the scheduler is stopping
                req.future.set_exception(RuntimeError("the engine stopped"))
        st.overhead_seconds += time.perf_counter() - t1
