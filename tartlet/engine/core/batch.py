"""Tensors of one ragged batch, as the model consumes them.

A batch packs the input tokens of many forward-pass requests into one flat
row dimension ``T``. Attention is computed per :class:`AttentionGroup`: a set
of requests whose queries and KV are gathered into one padded
``scaled_dot_product_attention`` call (all single-token decode requests form
one group; whole prompts of one length form one group; every other
multi-token request is a group of its own).

:func:`build_batch` turns the scheduler's chosen chunks (:class:`BatchItem`)
into these tensors: KV slots from each sequence's page table, masks for
custom attention, hidden tokens and padding, and the sliding-window indexes.
The scheduler decides *what* runs; this module decides how it is laid out.
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field
from typing import overload

import numpy as np
import torch

from ..models.lora import LoraAdapter, LoraBatch, lora_batch
from .attention_probe import AttentionCapture, AttentionProbeSpec
from .hidden_states import HiddenCapture
from .sequence import Sequence


@dataclass
class AttentionGroup:
    """Queries of ``B`` requests attending to their own KV slots.

    Attributes:
        rows: int64 ``[B * Q]`` rows of the flat batch holding the queries,
            request-major; or ``None`` when they are the contiguous rows
            ``row_start : row_start + B * Q``.
        row_start: first row when ``rows`` is ``None``.
        num_queries: ``Q``, queries per request (padding rows are not
            allowed: decode groups have ``Q == 1``).
        kv_slots: int64 ``[B, L]`` pool rows of the keys/values each request
            attends to, padded with slot 0.
        mask: bool ``[B, Q, L]`` (True = may attend), or ``None`` for
            attention without padding or holes: plain causal over exactly
            ``L == Q`` fresh tokens when ``Q > 1``, every one of the ``L``
            slots when ``Q == 1``.
        q_index, kv_index: int64 ``[B, Q]`` and ``[B, L]`` token indexes in
            their sequence of each query and of each KV column (padding
            columns: any value, they are masked). Set only for models with
            sliding-window layers, which narrow ``mask`` with them
            (``kv_index > q_index - W``), and for probed groups; ``None``
            otherwise.
        probe: for a group whose requests asked for the attention probe
            (:mod:`.attention_probe`; such requests are never grouped with
            others), how its weights are reduced over each request's
            queries (``"sum"`` or ``"max"``); ``None``: no probe.
    """

    rows: torch.Tensor | None
    row_start: int
    num_queries: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    q_index: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None
    probe: str | None = None


@dataclass
class BatchItem:
    """One request's chunk in a batch, as :func:`build_batch` reads it.

    Attributes:
        seq: its sequence, already extended by the chunk (``reserve`` ran).
        token_ids: the chunk's ``n`` input token ids.
        start: logical index in ``seq`` of the chunk's first token.
        slot_mapping: pool row each token's K and V are written to (vLLM's
            ``slot_mapping``), ``n`` ints.
        output_index: chunk-relative indexes of the tokens whose logits are wanted.
        attention: per chunk token, a bool ``[start + j + 1]``-or-longer mask
            over logical positions (True = may attend), or None: causal.
        adapter: the LoRA adapter its tokens run with, or None (the base model).
        hidden_index: ``(chunk-relative index, layer key)`` of each hidden
            state wanted (:mod:`.hidden_states`), in slot order; these rows
            are not in ``output_index`` unless their logits are wanted too.
    """

    seq: Sequence
    token_ids: list[int]
    start: int
    slot_mapping: list[int]
    output_index: list[int]
    attention: list[torch.Tensor] | None
    adapter: LoraAdapter | None = None
    hidden_index: list[tuple[int, int | None]] = field(default_factory=list)
    probe: AttentionProbeSpec | None = None

    @property
    def n(self) -> int:
        return len(self.token_ids)


@dataclass
class BatchInputs:
    """Everything the model needs for one forward pass.

    Attributes:
        input_ids: int64 ``[T]`` token ids.
        positions: int64 ``[T]`` RoPE positions.
        write_slots: int64 ``[T]`` pool row each token's K and V are written to.
        groups: attention groups covering every row exactly once.
        output_rows: int64 ``[S]`` rows whose logits are wanted.
        lora: the LoRA adapters of the batch's rows
            (:class:`~tartlet.engine.models.lora.LoraBatch`), or None when
            every row runs the base model.
        hidden: the hidden states to keep (:class:`~.hidden_states.HiddenCapture`),
            or None when no item asked for one.
        probe: the attention probe's groups and buffers
            (:class:`~.attention_probe.AttentionCapture`), or None when no
            item asked for one.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    groups: list[AttentionGroup]
    output_rows: torch.Tensor
    lora: LoraBatch | None = None
    hidden: HiddenCapture | None = None
    probe: AttentionCapture | None = None

    def to(self, device: torch.device) -> "BatchInputs":
        """The same batch with every tensor on ``device``. To a GPU the
        copies are asynchronous, from pinned memory: a blocking copy would
        first wait for every kernel queued (overlap scheduling builds the
        next batch while the last one runs, :mod:`.lookahead`)."""
        if device.type == "cpu":
            return self

        @overload
        def mv(t: torch.Tensor) -> torch.Tensor: ...
        @overload
        def mv(t: None) -> None: ...
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)

        groups = [AttentionGroup(mv(g.rows), g.row_start, g.num_queries, mv(g.kv_slots), mv(g.mask), mv(g.q_index), mv(g.kv_index),
                                 g.probe)
                  for g in self.groups]
        return BatchInputs(mv(self.input_ids), mv(self.positions), mv(self.write_slots), groups, mv(self.output_rows),
                           None if self.lora is None else self.lora.to(device),
                           None if self.hidden is None else self.hidden.to(device), self.probe)


def build_batch(items: collections.abc.Sequence[BatchItem], indexes: bool = False) -> BatchInputs:
    """The tensors of one model call over ``items`` (in order): flat rows,
    one attention group for all single-token (decode) items, one for the
    whole causal prompts of each length, and one per other multi-token
    item. ``indexes``: fill ``q_index``/``kv_index`` (models with
    sliding-window layers). Items with an attention probe get groups of
    their own (their decode rows one group, each multi-token chunk one),
    with their indexes, so the groups of the others are as without them."""
    ids: list[int] = []
    pos: list[int] = []
    write: list[int] = []
    out_rows: list[int] = []
    hidden: list[tuple[int, int | None]] = []  # (flat row, layer key) of each hidden slot
    groups: list[AttentionGroup] = []
    decode: list[tuple[int, BatchItem]] = []
    probed: list[tuple[int, BatchItem]] = []  # decode items with an attention probe
    members: dict[int, list[int]] = {}  # probed group (index in groups) -> its items
    fresh: dict[int, list[tuple[int, torch.Tensor]]] = {}  # whole causal prompts by length: (first row, KV slots)
    for k, it in enumerate(items):
        row0 = len(ids)
        ids.extend(it.token_ids)
        pos.extend(it.seq.positions[it.start : it.start + it.n])
        write.extend(it.slot_mapping)
        out_rows.extend(row0 + i for i in it.output_index)
        hidden.extend((row0 + i, key) for i, key in it.hidden_index)
        if it.n == 1:
            (decode if it.probe is None else probed).append((row0, it))
            continue
        kv, mask, logical = _kv_and_mask(it)
        if it.start == 0 and mask is None and logical is None and it.probe is None:
            fresh.setdefault(it.n, []).append((row0, kv))
            continue
        g = AttentionGroup(None, row0, it.n, kv[None], None if mask is None else mask[None])
        if indexes or it.probe is not None:
            g.q_index = torch.arange(it.start, it.start + it.n)[None]
            g.kv_index = (torch.arange(kv.shape[0]) if logical is None else logical)[None]
        if it.probe is not None:
            g.probe, members[len(groups)] = it.probe.reduce, [k]
        groups.append(g)
    for n, prompts in fresh.items():  # one attention call for prompts of one length
        groups.append(_prompt_group(n, prompts, indexes))
    if decode:
        groups.append(_decode_group(decode, indexes))
    if probed:  # one query each: either reduction over queries is the weight itself
        members[len(groups)] = [k for k, it in enumerate(items) if it.n == 1 and it.probe is not None]
        groups.append(_decode_group(probed, True))
        groups[-1].probe = "sum"
    # one tensor, four views: a decode step builds its batch between two
    # passes, on caches the pass has flushed, and each tensor made from a
    # list costs a few microseconds there
    T = len(ids)
    flat = torch.tensor(ids + pos + write + out_rows, dtype=torch.long)
    return BatchInputs(
        input_ids=flat[:T],
        positions=flat[T : 2 * T],
        write_slots=flat[2 * T : 3 * T],
        groups=groups,
        output_rows=flat[3 * T :],
        lora=lora_batch([(it.adapter, it.n) for it in items]) if any(it.adapter is not None for it in items) else None,
        hidden=HiddenCapture.build(hidden) if hidden else None,
        probe=AttentionCapture(tuple(sorted({layer for it in items if it.probe is not None for layer in it.probe.layers})),
                               members) if members else None,
    )


def _kv_and_mask(it: BatchItem) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """KV slots ``[L]`` of the item's sequence up to the end of its chunk,
    its bool mask ``[n, L]`` (None when plain causal suffices) and the
    token index of each slot (None when it is the slot's number)."""
    seq = it.seq
    end = it.start + it.n
    slots, logical = kv_view(seq, end)
    hidden = seq.masked.find(1, 0, end) != -1
    custom = it.attention
    if custom is None and not hidden and (it.n == 1 or (it.start == 0 and logical is None)):
        return slots, None, logical  # causal: a lone query sees everything before it
    if logical is None:
        logical = torch.arange(end)
    q_idx = torch.arange(it.start, end)
    if custom is None:
        mask = logical[None, :] <= q_idx[:, None]
    else:
        full = torch.zeros(it.n, end, dtype=torch.bool)
        for j in range(it.n):
            m = custom[j]
            full[j, : m.shape[0]] = m[:end]
        mask = full[:, logical]
    if hidden:
        vis = ~torch.frombuffer(bytearray(seq.masked[:end]), dtype=torch.bool)
        mask &= vis[logical][None, :]
    # a token always attends to itself, so no row is empty
    self_col = (logical[None, :] == q_idx[:, None])
    mask |= self_col
    return slots, mask, logical


def _prompt_group(n: int, prompts: list[tuple[int, torch.Tensor]], indexes: bool) -> AttentionGroup:
    """One attention group for whole prompts of ``n`` tokens each (plain
    causal over their own ``n`` fresh slots, no mask): ``B`` requests of
    ``Q = L = n``, so that ``B`` equal prompts arriving together cost one
    attention call per layer, not ``B``."""
    B = len(prompts)
    first = [r for r, _ in prompts]
    if first == list(range(first[0], first[0] + B * n, n)):
        rows = None
    else:
        rows = (torch.tensor(first)[:, None] + torch.arange(n)).view(-1)
    g = AttentionGroup(rows, first[0], n, torch.stack([kv for _, kv in prompts]), None)
    if indexes:
        g.q_index = torch.arange(n).expand(B, n)
        g.kv_index = torch.arange(n).expand(B, n)
    return g


def _decode_group(decode: list[tuple[int, BatchItem]], indexes: bool) -> AttentionGroup:
    """One attention group for all single-token requests. The KV lists
    are padded to the longest; the mask is left out when no request
    needs one (no padding, nothing hidden), e.g. at batch size 1."""
    B = len(decode)
    rows = [r for r, _ in decode]
    rows_t = None if rows == list(range(rows[0], rows[0] + B)) else torch.tensor(rows, dtype=torch.long)
    simple = _plain_decode_slots(decode)
    if simple is not None:
        kv, lens, firsts = simple
        L = kv.shape[1]
        if min(lens) == L:
            g = AttentionGroup(rows_t, rows[0], 1, kv, None)
        else:
            mask = torch.arange(L)[None, :] < torch.tensor(lens)[:, None]
            g = AttentionGroup(rows_t, rows[0], 1, kv, mask.view(B, 1, L))
        if indexes:
            first = torch.tensor(firsts)[:, None]
            g.q_index = first + torch.tensor(lens)[:, None] - 1
            g.kv_index = first + torch.arange(L)
        return g
    views, masks, idx = [], [], []
    for _, it in decode:
        slots, item_mask, logical = _kv_and_mask(it)
        views.append(slots)
        masks.append(item_mask)
        idx.append(torch.arange(slots.shape[0]) if logical is None else logical)
    L = max(v.shape[0] for v in views)
    kv = torch.zeros(B, L, dtype=torch.long)
    mask = torch.zeros(B, 1, L, dtype=torch.bool)
    kv_index = torch.zeros(B, L, dtype=torch.long)
    for b, (v, m, ix) in enumerate(zip(views, masks, idx)):
        kv[b, : v.shape[0]] = v
        kv_index[b, : v.shape[0]] = ix
        if m is None:
            mask[b, 0, : v.shape[0]] = True
        else:
            mask[b, 0, : v.shape[0]] = m[0]
    g = AttentionGroup(rows_t, rows[0], 1, kv, mask)
    if indexes:
        g.q_index = torch.tensor([it.start for _, it in decode])[:, None]
        g.kv_index = kv_index
    return g


def _plain_decode_slots(decode: list[tuple[int, BatchItem]]) -> tuple[torch.Tensor, list[int], list[int]] | None:
    """The common case of :meth:`_decode_group` in a few tensor ops for
    the whole batch: when every request attends causally to all its live
    tokens (no custom mask, nothing hidden, no dropped page but the leading
    ``Sequence.window_dropped`` a sliding window released), the KV slots
    ``[B, L]`` (rows padded with slots of page 0), each request's number of
    columns, and the token index of each request's first column (a
    multiple of the page size); else ``None``."""
    tables, lens, firsts = [], [], []
    for _, it in decode:
        seq, end = it.seq, it.start + 1
        ps = seq.page_size
        table = seq.pages[: -(-end // ps)]
        skip = seq.window_dropped
        if skip:
            table = table[skip:]
        if it.attention is not None or None in table or seq.masked.find(1, 0, end) != -1:
            return None
        tables.append(table)
        lens.append(end - skip * ps)
        firsts.append(skip * ps)
    P = max(len(t) for t in tables)
    # numpy: its small-array ops cost ~1 us where PyTorch's cost ~5 (the whole
    # function runs once a decode step, between passes)
    pages = np.array([t + [0] * (P - len(t)) for t in tables], dtype=np.int64)
    slots = (pages[:, :, None] * ps + np.arange(ps, dtype=np.int64)).reshape(len(decode), P * ps)
    return torch.from_numpy(np.ascontiguousarray(slots[:, : max(lens)])), lens, firsts


def kv_view(seq: Sequence, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pool rows ``[L]`` holding the KV of logical tokens ``[0, end)`` of
    ``seq`` that are still live, and their logical indexes (``None`` when no
    page was dropped, i.e. ``L == end`` and the index is the row number)."""
    ps = seq.page_size
    npages = -(-end // ps)
    table = seq.pages[:npages]
    if all(p is not None for p in table):
        base = torch.tensor(table, dtype=torch.long)
        slots = (base[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)[:end]
        return slots, None
    live = [(j, p) for j, p in enumerate(table) if p is not None]
    js = torch.tensor([j for j, _ in live], dtype=torch.long)
    base = torch.tensor([p for _, p in live], dtype=torch.long)
    off = torch.arange(ps)[None, :]
    slots = (base[:, None] * ps + off).reshape(-1)
    logical = (js[:, None] * ps + off).reshape(-1)
    keep = logical < end
    return slots[keep], logical[keep]
