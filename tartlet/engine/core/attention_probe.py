"""The attention-score probe of a forward pass: how much attention each KV
position (or page) of a context received from the pass's queries.

A request with a probe (:class:`AttentionProbeSpec`, validated from the
SDK's :class:`~tartlet.sdk.attention_probe.AttentionProbe` by the host) gets
attention groups of its own (:func:`~tartlet.engine.core.batch.build_batch`
never mixes it with requests that did not ask, so theirs run exactly as
before). The attention paths write the softmax weights they compute anyway
into the buffers of an :class:`AttentionCapture`, inside the same pass:

- the C paged attention kernel (decode rows, and prefill groups query by
  query) and the fused decode step copy each query head's weights ``p[h, j]``
  (``cpu_kernels.c``, ``decode_step.h``: one ``memcpy`` of ``L`` floats per
  head after its softmax; nothing when the buffer pointer is NULL);
- the other groups (long prefills, bfloat16 pools, no C kernels, CUDA) take an
  explicit ``softmax(q k^T / sqrt(d) + mask)`` path in PyTorch instead of SDPA
  (:meth:`~tartlet.engine.attention.paged_attention.Attention.sdpa`), which reduces
  the weights over the group's queries as it goes.

After the model call :meth:`AttentionCapture.collect` reduces each request's
rows over its queries and query heads (sum or max) and adds them into its
:class:`ProbeAccumulator` at the token index of each KV column (a chunked
prefill adds one chunk at a time), which turns into the SDK's
:class:`~tartlet.sdk.attention_probe.AttentionScores` when the pass ends.

The weights are the ones the attention computed: ``softmax_j(q_h . k_j *
scale + mask_j)`` over the keys the query sees (Vaswani et al., 2017, eq. 1;
hidden, dropped and out-of-window positions weigh 0), with the key as the
pool holds it (float16 rounded, int8 dequantized).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ...sdk.attention_probe import AttentionScores


@dataclass(frozen=True)
class AttentionProbeSpec:
    """A validated attention probe of one forward request.

    Attributes:
        layers: the decoder layers reported, each in ``[0, num_layers)``,
            in the order asked (no repeats).
        reduce: ``"sum"``: attention mass summed over the pass's queries and
            query heads (and over a page's tokens); ``"max"``: the largest
            single weight instead.
        per: ``"token"``: one value per context position; ``"page"``: one per
            KV page (``reduce`` over its ``page_size`` positions).
        per_kv_head: one row per KV head (its query heads reduced) instead
            of one for all heads.
    """

    layers: tuple[int, ...]
    reduce: str = "sum"
    per: str = "token"
    per_kv_head: bool = False


class ProbeAccumulator:
    """One request's probe values over the passes of its chunks.

    Args:
        spec: the probe.
        n_tokens: the sequence's length after the pass (positions reported).
        kv_heads: the model's KV heads.
    """

    def __init__(self, spec: AttentionProbeSpec, n_tokens: int, kv_heads: int) -> None:
        self.spec = spec
        self.n_tokens = n_tokens
        self.heads = kv_heads if spec.per_kv_head else 1
        #: float64 ``[len(spec.layers), heads, n_tokens]``
        self.acc = torch.zeros(len(spec.layers), self.heads, n_tokens, dtype=torch.float64)
        self._where: dict[tuple[int, ...], tuple[list[int] | bool, list[int], bool]] = {}

    def add(self, layers: tuple[int, ...], reduced: torch.Tensor, kv_index: torch.Tensor) -> None:
        """Add one group's weights of this request.

        Args:
            layers: the layers of ``reduced``'s first dimension.
            reduced: float64 ``[len(layers), heads, L]`` on the CPU: the
                softmax weights over the group's ``L`` KV columns, already
                reduced over this request's queries and query heads
                (:func:`reduce_rows`).
            kv_index: int64 ``[L]``: the token index of each column (padding
                columns have weight 0 and any index).
        """
        src_rows, dst_rows, whole = self._rows(layers)
        if not src_rows:
            return
        w = reduced if src_rows is True else reduced[src_rows]
        idx = kv_index.clamp(0, self.n_tokens - 1).expand(w.shape)
        target = self.acc if whole else self.acc[dst_rows]
        if self.spec.reduce == "sum":
            target.scatter_add_(2, idx, w)
        else:
            target.scatter_reduce_(2, idx, w, "amax", include_self=True)
        if not whole:
            self.acc[dst_rows] = target

    def _rows(self, layers: tuple[int, ...]) -> tuple[list[int] | bool, list[int], bool]:
        """Which rows of a buffer over ``layers`` this request wants (True:
        all of them), where they go in :attr:`acc`, and whether that is all
        of :attr:`acc` in order."""
        got = self._where.get(layers)
        if got is None:
            pos = {layer: i for i, layer in enumerate(self.spec.layers)}
            pairs = [(i, pos[layer]) for i, layer in enumerate(layers) if layer in pos]
            src, dst = [a for a, _ in pairs], [b for _, b in pairs]
            got = self._where[layers] = (True if src == list(range(len(layers))) else src, dst,
                                         dst == list(range(len(self.spec.layers))))
        return got

    def result(self, page_size: int) -> AttentionScores:
        """The SDK's :class:`AttentionScores` (values rounded to float32, as
        the WIT carries them, so both runtimes return the same numbers)."""
        s = self.spec
        acc = self.acc
        if s.per == "page":
            n_pages = -(-self.n_tokens // page_size)
            padded = torch.zeros(*acc.shape[:2], n_pages * page_size, dtype=acc.dtype)
            padded[..., : self.n_tokens] = acc
            blocks = padded.view(*acc.shape[:2], n_pages, page_size)
            acc = blocks.sum(-1) if s.reduce == "sum" else blocks.amax(-1)
        # a float32 memoryview: the SDK makes lists of it where it is read (not on the scheduler thread)
        return AttentionScores(list(s.layers), s.reduce, s.per, self.heads, acc.float().numpy().data)


@dataclass
class ProbeBuffer:
    """The weights one attention group writes for the probe.

    Attributes:
        group: the group as the layers ran it (a sliding layer's cut
            to its window: its ``kv_index`` maps the columns).
        members: indexes (into the batch's items) of the group's requests,
            in its request order.
        layers: the layers of ``out``'s first dimension.
        out: float32 ``[len(layers), R, nh, L]``: ``R = B * Q`` query rows
            (``per_query``, the C kernels) or ``B`` rows already reduced over
            each request's queries (the PyTorch path).
        per_query: see ``out``.
        slot: per model layer, its index in ``layers`` or -1 (int64
            ``[n_layers]``, as the fused step reads it; ``index``: the same as a list).
    """

    group: Any
    members: list[int]
    layers: tuple[int, ...]
    out: torch.Tensor
    per_query: bool
    slot: torch.Tensor
    index: list[int]

    def at(self, layer: int) -> torch.Tensor | None:
        """Layer ``layer``'s ``[R, nh, L]`` part of :attr:`out`, or None when
        it is not probed."""
        i = self.index[layer]
        return None if i < 0 else self.out[i]


@dataclass
class AttentionCapture:
    """The probe of one model call: which layers, which groups, and the
    buffers the model fills.

    Attributes:
        layers: every layer some request of the batch probes (sorted).
        members: per probed group (its index in ``BatchInputs.groups``), the
            batch items in it, in its request order.
        buffers: filled by the model, one per probed group and distinct
            sliding window.
    """

    layers: tuple[int, ...]
    members: dict[int, list[int]]
    buffers: list[ProbeBuffer] = field(default_factory=list)

    def allocate(self, plans: dict[int | None, list[Any]], windows: list[int | None], num_heads: int,
                 device: torch.device) -> dict[tuple[int | None, int], ProbeBuffer]:
        """The buffers of one model call, keyed by ``(window, id(group))``:
        one per probed group of each distinct sliding window (``plans``:
        the model's :class:`~tartlet.engine.attention.plan.GroupPlan`
        lists per window, in ``BatchInputs.groups`` order; ``windows``: each
        layer's window), over the probed layers of that window. A plan the
        C kernel runs (``by_kernel``) writes one row per query; the
        PyTorch path one per request, reduced over its queries.
        Uninitialised: the attention writes every entry."""
        out: dict[tuple[int | None, int], ProbeBuffer] = {}
        for w, ps in plans.items():
            layers = tuple(i for i in self.layers if windows[i] == w)
            if not layers:
                continue
            index = [-1] * len(windows)
            for j, layer in enumerate(layers):
                index[layer] = j
            slot = torch.tensor(index, dtype=torch.long)
            for gi, p in enumerate(ps):
                g = p.group
                if g.probe is None:
                    continue
                rows = p.slots.shape[0] if p.by_kernel else g.kv_slots.shape[0]
                buf = torch.empty(len(layers), rows, num_heads, g.kv_slots.shape[1], dtype=torch.float32, device=device)
                out[(w, id(g))] = ProbeBuffer(g, self.members[gi], layers, buf, p.by_kernel, slot, index)
        self.buffers.extend(out.values())
        return out

    def collect(self, accumulators: list[ProbeAccumulator | None]) -> None:
        """Add every buffer's rows into the accumulator of their request
        (``accumulators[i]``: batch item ``i``'s): each buffer reduced once
        per distinct (reduce, rows) its requests asked for, moved to the CPU
        once, then scattered to each request's positions."""
        for buf in self.buffers:
            g = buf.group
            B, L = g.kv_slots.shape
            kv_index = g.kv_index.to("cpu")
            done: dict[tuple[str, int], torch.Tensor] = {}
            for b, item in enumerate(buf.members):
                acc = accumulators[item]
                if acc is None:
                    continue
                key = (acc.spec.reduce, acc.heads)
                if key not in done:
                    q_rows = g.num_queries if buf.per_query else 1
                    done[key] = reduce_rows(buf.out, B, q_rows, acc.heads, acc.spec.reduce)
                acc.add(buf.layers, done[key][:, b], kv_index[b])


def reduce_rows(out: torch.Tensor, B: int, q_rows: int, heads: int, reduce: str) -> torch.Tensor:
    """A probe buffer ``out`` ``[n_l, B * q_rows, nh, L]`` reduced (``"sum"``
    or ``"max"``) over each request's ``q_rows`` query rows and over the
    query heads of each of ``heads`` rows (a KV head's, or all of them):
    float64 ``[n_l, B, heads, L]`` on the CPU. Each reduction is over the
    middle axis of a 3-D view; on the CPU in numpy, on one thread: PyTorch
    spreads a reduction of this size over its OpenMP team, which on a busy
    machine (more runnable threads than cores) took 30x longer."""
    n_l, _, nh, L = out.shape
    g = nh // heads
    x: Any = out.numpy() if out.device.type == "cpu" else out  # on a GPU: reduced there, then copied

    def red(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return v.sum(1) if reduce == "sum" else v.amax(1)
        return np.einsum("ahj->aj", v) if reduce == "sum" else v.max(1)  # einsum: 2x np.sum's speed here

    x = x.reshape(n_l * B, q_rows * nh * L)
    if heads == 1:  # queries and heads in one reduction
        x = red(x.reshape(n_l * B, q_rows * nh, L))
    else:
        if q_rows > 1:
            x = red(x.reshape(n_l * B, q_rows, nh * L))
        x = red(x.reshape(n_l * B * heads, g, L)) if g > 1 else x
    x = x.reshape(n_l, B, heads, L)
    if isinstance(x, torch.Tensor):
        return x.to("cpu", torch.float64)
    return torch.from_numpy(x.astype(np.float64))
