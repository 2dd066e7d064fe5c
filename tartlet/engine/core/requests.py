"""What is submitted to the scheduler: forward requests (tokens for one
sequence, the outputs wanted, an optional continuation) and commands (KV
edits ordered with the passes of the sequences they touch)."""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar

import torch

from ..models.lora import LoraAdapter
from .attention_probe import AttentionProbeSpec, ProbeAccumulator
from .batch import BatchItem
from .sampler import OutputSlot
from .sequence import Sequence

T = TypeVar("T")


@dataclass
class ForwardRequest:
    """Tokens to run through the model for one sequence.

    Attributes:
        seq: the sequence the tokens are appended to.
        tokens: input token ids (at least one).
        positions: RoPE position per token; ``None`` = ``len(seq) + i``.
        attention: per input token, a bool ``[len(seq) + i + 1]`` tensor of
            the logical positions it may attend (True = may attend), or
            ``None`` for causal attention. Positions hidden with
            :meth:`Sequence.mask_range` stay hidden either way.
        outputs: results wanted at given input indexes.
        future: resolves to the list of slot results, in ``outputs`` order.
        then: a continuation, called on the scheduler thread with the slot
            results when the pass is done: it returns the next pass's
            ``(tokens, outputs)`` for the same sequence, and the request is
            queued again with them (same future, no new request object: a
            host-side ``generate`` costs no submission per token), or
            ``None`` to resolve the future with these results. An exception
            it raises fails the future.
        adapter: the LoRA adapter the tokens run with
            (:class:`~tartlet.engine.models.lora.LoraAdapter`), or ``None``
            for the base model. Rows of different adapters share one model
            call; prefix-cache pages are matched and registered per adapter.
        probe: the attention-score probe of this pass
            (:mod:`.attention_probe`), or ``None``. Its scores are one more
            result after the slots' (the future's last element); the pass
            is not served from the prefix cache.
        probe_acc: the probe's values so far (set by the scheduler at the
            first chunk, filled by the model runner).
        feed_back: set when the continuation's next pass is always the token
            sampled at this pass's one output, fed back as the only input,
            with this slot as its output (the same object), unless it stops:
            a host-side greedy ``generate``. With overlap scheduling the
            scheduler then queues that pass before this one's token reaches
            the host (:mod:`.lookahead`).
        origin, ahead, feed, dropped: overlap scheduling's links
            (:mod:`.lookahead`): the request a lookahead pass was made for
            (None once it took over its future), the lookahead made for this
            one, the earlier launch and output slot whose device-side token
            is its input, and whether it was dropped (its origin stopped).
    """

    seq: Sequence
    tokens: list[int]
    positions: list[int] | None = None
    attention: list[torch.Tensor] | None = None
    outputs: list[OutputSlot] = field(default_factory=list)
    future: Future[list[object]] = field(default_factory=Future)
    # progress of a chunked prefill
    started: bool = False
    continued: bool = False  # queued again by ``then`` (its future runs already)
    done: int = 0
    start_len: int = -1
    results: list[object] = field(default_factory=list)
    enqueued_at: float = 0.0
    #: when it first found the pool full (0: never), see Scheduler.kv_wait_s
    waiting_since: float = 0.0
    #: who the tokens count for in the per-user fair share of a round
    user: str = ""
    then: "Callable[[list[object]], tuple[list[int], list[OutputSlot]] | None] | None" = None
    adapter: LoraAdapter | None = None
    probe: AttentionProbeSpec | None = None
    probe_acc: ProbeAccumulator | None = None
    feed_back: OutputSlot | None = None
    origin: "ForwardRequest | None" = None
    ahead: "ForwardRequest | None" = None
    feed: "tuple[Any, int] | None" = None
    dropped: bool = False

    @property
    def adapter_key(self) -> bytes:
        """The key of :attr:`adapter` that prefix-cache pages are matched
        and registered under (``b""``: the base model)."""
        return b"" if self.adapter is None else self.adapter.key

    def rearm(self, tokens: list[int], outputs: list[OutputSlot]) -> None:
        """Make this request the next pass its continuation returned: the
        same future, progress reset, queued again by the scheduler.

        Raises:
            ValueError: as :func:`check_pass`.
        """
        check_pass(tokens, outputs)
        self.tokens, self.outputs = tokens, outputs
        self.started, self.continued, self.done, self.start_len, self.results, self.waiting_since = False, True, 0, -1, [], 0.0
        self.enqueued_at = time.perf_counter()

    def continue_into(self, again: list["ForwardRequest"]) -> bool:
        """Run the continuation (:attr:`then`) of this request, whose pass is
        done and succeeded: re-arm it with the next pass it returns and add
        it to ``again`` (the scheduler queues them), or fail the future with
        what it raised. False when it returns ``None`` (the scheduler
        resolves the future with the results)."""
        assert self.then is not None  # called for requests with a continuation
        try:
            nxt = self.then(self.results)
        except BaseException as e:  # reported to the submitter
            self.future.set_exception(e)
            return True
        return self.continue_with(nxt, again)

    def continue_with(self, nxt: tuple[list[int], list[OutputSlot]] | None, again: list["ForwardRequest"]) -> bool:
        """What :meth:`continue_into` does once the continuation returned
        ``nxt``: re-arm with it into ``again`` (a malformed pass fails the
        future), or False for ``None``."""
        if nxt is None:
            return False
        try:
            self.rearm(*nxt)
            again.append(self)
        except BaseException as e:  # reported to the submitter
            self.future.set_exception(e)
        return True


def check_pass(tokens: list[int], outputs: list[OutputSlot]) -> None:
    """Raises ValueError: no input token, or an output index outside them."""
    if not tokens:
        raise ValueError("a forward pass needs at least one input token")
    for s in outputs:
        if not 0 <= s.index < len(tokens):
            raise ValueError(f"output index {s.index} outside the {len(tokens)} input tokens")


@dataclass
class Command(Generic[T]):
    fn: Callable[[], T]
    touches: tuple[Sequence, ...]
    future: Future[T] = field(default_factory=Future)


@dataclass
class Chunk(BatchItem):
    """One chunk of a request in the batch being built: its rows of the
    batch (:class:`BatchItem`), the request, and the output slots it holds."""

    req: ForwardRequest = None  # type: ignore[assignment]
    out_slots: list[tuple[int, OutputSlot]] = field(default_factory=list)  # (position in req.outputs, slot)
