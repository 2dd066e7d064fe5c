"""The model runner (nano-vllm's term): runs one batch the scheduler built.

It turns the chunks into the batch tensors (:func:`.batch.build_batch`),
picks how the model runs over the page pool, and runs the output slots'
samplers and probes on the logits, counting the call in
:class:`.stats.SchedulerStats`. Per batch, the first that takes it:

1. a **CUDA graph** of the decode step (:mod:`tartlet.engine.cuda.graphs`:
   decode rows only, captured per bucket of batch size and slot-list length);
2. the **fused C step** (:mod:`tartlet.engine.kernels.fused_decode`: the
   whole layer stack in one C call, on quantized Llama-shaped models, when
   every group's attention is the C kernel's and no hidden state before the
   last layer is wanted);
3. the model **op by op** (:meth:`~tartlet.engine.models.llama.LlamaModel.forward_eager`).

The scheduler keeps queueing, fairness and KV waits; failures propagate to
it, which fails the batch's requests and rolls their sequences back.
"""

from __future__ import annotations

import collections.abc
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..cuda.graphs import DecodeGraphs
from ..kernels.fused_decode import FusedDecoder
from ..models.llama import LlamaModel
from .batch import BatchInputs, build_batch
from .hidden_states import HiddenSpec
from .kv_cache import PagePool
from .requests import Chunk
from .sampler import OutputSlot, SamplerSpec, SlotSampler
from .sequence import Sequence
from .stats import SchedulerStats


def plain_greedy(slot: OutputSlot) -> bool:
    """Whether ``slot`` takes the argmax of its logits and nothing else
    (greedy, no logit mask or check, no DRY penalty): its token can be
    picked on the device, before the host sees the logits."""
    spec = slot.spec
    # ``allowed`` last: a grammar's slot computes its mask when it is read
    return (isinstance(spec, SamplerSpec) and spec.temperature == 0 and spec.dry is None and slot.check is None
            and slot.prefetch is None and type(slot) is OutputSlot and slot.allowed is None)


@dataclass
class Launch:
    """A model call queued by :meth:`ModelRunner.launch`, not yet finished.

    Attributes:
        items, batch, logits, slots: its chunks, tensors, float32 logits
            ``[S, vocab]`` and output slots.
        t0: when it was launched (``time.perf_counter()``).
        feed: int64 ``[S]`` tokens sampled on the device (every slot plain
            greedy), which a later launch may take as inputs; or None.
        tokens: the sampled tokens on the host, once known; or None.
        host, event: the pinned host copy of ``feed`` and the CUDA event
            after it (CUDA only).
    """

    items: list[Chunk]
    batch: BatchInputs
    logits: torch.Tensor
    slots: list[OutputSlot]
    t0: float
    feed: torch.Tensor | None = None
    tokens: list[int] | None = None
    host: torch.Tensor | None = None
    event: Any = None


class ModelRunner:
    """Runs batches of ``model`` over ``pool`` and counts them in ``stats``.

    Args:
        model: the model.
        pool: its page pool (keys and values of every layer).
        stats: the scheduler's counters; :meth:`run` adds each model call.
        graphs: CUDA graphs of decode steps over ``pool``, or None.
    """

    def __init__(self, model: LlamaModel, pool: PagePool, stats: SchedulerStats, graphs: DecodeGraphs | None = None) -> None:
        self.model = model
        self.pool = pool
        self.stats = stats
        #: CUDA graphs of decode steps (set by the engine when it enables them), or None
        self.graphs = graphs
        kern = model.kernels  # the fused C kernels (float32 CPU), or None
        #: the layer stack of a batch in one C call, when the model's shape allows it (float32 C kernels), or None
        self.fused = FusedDecoder.build(model) if kern is not None else None
        self.sampler = SlotSampler(model.config.vocab_size, kern.argmax_rows if kern is not None else None,
                                   kern.argmax_masked if kern is not None else None)
        #: overlap scheduling is on (``Scheduler.overlap``): plain greedy launches get a
        #: :attr:`Launch.feed` on a CPU too (on a GPU they always have one)
        self.feeds = False
        # sliding-window models need each group's token indexes (AttentionGroup.q_index/kv_index)
        self._indexes = getattr(model.config, "sliding_window", None) is not None

    def run(self, items: list[Chunk]) -> list[object]:
        """One model call over ``items``: :meth:`launch` then :meth:`finish`.

        Returns:
            The result of every output slot, in order of the chunks and of
            each chunk's ``out_slots``: a sampled token id, a probe's value, a
            hidden state (``hidden_size`` floats),
            or the exception that slot raised (a bad sampler fails its slot
            only).

        Raises:
            BaseException: whatever the batch tensors or the model call raised
                (the whole batch failed; nothing was counted).
        """
        return self.finish(self.launch(items))

    def launch(self, items: list[Chunk], feeds: collections.abc.Sequence[tuple[int, Launch, int]] = ()) -> Launch:
        """Queue the model call over ``items`` and, when every output slot is
        a plain greedy one (:func:`plain_greedy`), the argmax of its logits
        and the copy of the tokens to the host, without waiting for the
        device (on a CPU everything has run on return).

        Args:
            items: the chunks, as :meth:`run`.
            feeds: ``(chunk index, earlier launch, slot k)``: the chunk's one
                input token is the token the earlier launch sampled at its
                output slot ``k`` (still on the device: the input is copied
                there, in stream order, without the host reading it; the
                chunk's own token id is a placeholder). The earlier launch
                must have sampled on the device (:attr:`Launch.feed`).

        Raises:
            BaseException: as :meth:`run` (nothing was counted).
        """
        t0 = time.perf_counter()
        batch = build_batch(items, self._indexes).to(self.model.device)
        if feeds:
            starts = list(itertools.accumulate((it.n for it in items), initial=0))
            rows = [starts[j] for j, _, _ in feeds]  # a fed chunk is one token: its row
            src = feeds[0][1].feed
            assert src is not None and all(f[1].feed is src for f in feeds)  # one earlier launch
            # no blocking copy here: one would wait for the launch in flight (the overlap's point)
            idx = torch.tensor(rows + [k for *_, k in feeds], dtype=torch.long)
            idx = idx.pin_memory().to(src.device, non_blocking=True) if src.is_cuda else idx
            batch.input_ids.index_copy_(0, idx[: len(rows)], src.index_select(0, idx[len(rows) :]))
        logits = self.forward(batch)
        slots = [s for it in items for _, s in it.out_slots]
        launch = Launch(items, batch, logits, slots, t0)
        if slots and batch.hidden is None and batch.probe is None and all(plain_greedy(s) for s in slots):
            if logits.device.type == "cpu":
                launch.tokens = self.sampler.argmax(logits)
                if self.feeds:  # a CPU runs the same path as a GPU (the tests check it there)
                    launch.feed = torch.tensor(launch.tokens, dtype=torch.long)
            else:  # sampled on the device; the host copy is read at finish
                launch.feed = logits.argmax(dim=-1)
                launch.host = torch.empty(launch.feed.shape, dtype=torch.long, pin_memory=True)
                launch.host.copy_(launch.feed, non_blocking=True)
                launch.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
                launch.event.record()
        return launch

    def finish(self, launch: Launch) -> list[object]:
        """The results of a :meth:`launch` (as :meth:`run` returns them),
        waiting for the device if need be; counts the call in the stats.

        Raises:
            BaseException: as :meth:`run` (nothing was counted).
        """
        items, batch, logits, slots = launch.items, launch.batch, launch.logits, launch.slots
        if launch.event is not None:
            launch.event.synchronize()
            assert launch.host is not None  # set with the event
            launch.tokens = launch.host.tolist()
        if batch.probe is not None:  # the attention probe's weights into each request's scores
            batch.probe.collect([it.req.probe_acc for it in items])
        results: list[object]
        if launch.tokens is not None:  # sampled at launch (every slot plain greedy)
            results = list(launch.tokens)
        else:
            history = _history(items)  # read only by slots with a DRY penalty (the sampler finds them)
            if batch.hidden is None:
                results = self.sampler.run(logits, slots, history) if slots else []
            else:  # hidden-state slots take their rows of the capture, the others the logits rows
                on_logits = [s for s in slots if not isinstance(s.spec, HiddenSpec)]
                sampled = iter(self.sampler.run(logits, on_logits, history) if on_logits else [])
                hidden = iter(batch.hidden.results())
                results = [next(hidden) if isinstance(s.spec, HiddenSpec) else next(sampled) for s in slots]
        st = self.stats
        st.model_calls += 1
        st.forward_seconds += time.perf_counter() - launch.t0
        decodes = sum(1 for it in items if it.n == 1)
        st.mixed_calls += 0 < decodes < len(items)
        st.batched_requests += len(items)
        st.batch_sizes[len(items)] += 1
        st.last_batch = len(items)
        st.tokens_computed += sum(it.n for it in items)
        st.decode_steps += decodes
        st.tokens_generated += sum(
            1 for s, r in zip(slots, results) if isinstance(s.spec, SamplerSpec) and not isinstance(r, Exception)
        )
        return results

    @torch.inference_mode()
    def forward(self, batch: BatchInputs) -> torch.Tensor:
        """The model over ``batch`` and the pool, by a CUDA graph, the fused
        C step or op by op (the first that takes the batch; see the module
        docstring). Arguments and result as
        :meth:`~tartlet.engine.models.llama.LlamaModel.forward_eager`'s,
        which the three paths match (the tests compare them)."""
        m, k, v = self.model, self.pool.k, self.pool.v
        if self.graphs is not None and self.graphs.accepts(batch, k):
            return self.graphs.run(batch)
        hid = batch.hidden  # the fused step returns the last layer's output only: earlier layers' states run op by op
        last = len(m.layers) - 1
        fused = self.fused is not None and (hid is None or hid.layers() <= {last}) and self.fused.accepts(batch, k)
        x = m.embed_rows(batch)
        att = m.attention.prepare(batch, k)
        if not fused or att.kern is None:
            return m.head(m.run_layers(x, batch, att, k, v), batch)
        assert self.fused is not None  # fused
        logits = self.fused.run(x, batch, *att.ropes[m.rotary], k, v, att.plans[None], att.probes)  # x: the last layer's output
        if hid is not None:
            m.keep_hidden(hid, last, x)
        return logits if logits is not None else m.head(x, batch)  # None: the head did not run in the step


def _history(items: list[Chunk]) -> Callable[[OutputSlot], list[int]]:
    """For the sampler's DRY penalty: a slot's context tokens up to and
    including its input token (the request's tokens sit from
    ``req.start_len`` on in its sequence, which already holds this chunk).
    The slot map is built on the first call: most steps make none."""
    where: dict[int, tuple[Sequence, int]] = {}

    def history(slot: OutputSlot) -> list[int]:
        if not where:
            where.update({id(s): (it.seq, it.req.start_len + s.index) for it in items for _, s in it.out_slots})
        seq, k = where[id(slot)]
        return seq.tokens[: k + 1]

    return history
