"""Tensors of one ragged batch, as the model consumes them.

A batch packs the input tokens of many forward-pass requests into one flat
row dimension ``T``. Attention is computed per :class:`AttentionGroup`: a set
of requests whose queries and KV are gathered into one padded
``scaled_dot_product_attention`` call (all single-token decode requests form
one group; each multi-token request is a group of its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
            (``kv_index > q_index - W``); ``None`` otherwise.
    """

    rows: torch.Tensor | None
    row_start: int
    num_queries: int
    kv_slots: torch.Tensor
    mask: torch.Tensor | None
    q_index: torch.Tensor | None = None
    kv_index: torch.Tensor | None = None


@dataclass
class BatchInputs:
    """Everything the model needs for one forward pass.

    Attributes:
        input_ids: int64 ``[T]`` token ids.
        positions: int64 ``[T]`` RoPE positions.
        write_slots: int64 ``[T]`` pool row each token's K and V are written to.
        groups: attention groups covering every row exactly once.
        output_rows: int64 ``[S]`` rows whose logits are wanted.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    write_slots: torch.Tensor
    groups: list[AttentionGroup]
    output_rows: torch.Tensor

    def to(self, device: torch.device) -> "BatchInputs":
        """The same batch with every tensor on ``device``."""
        if device.type == "cpu":
            return self

        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        groups = [AttentionGroup(mv(g.rows), g.row_start, g.num_queries, mv(g.kv_slots), mv(g.mask), mv(g.q_index), mv(g.kv_index))
                  for g in self.groups]
        return BatchInputs(mv(self.input_ids), mv(self.positions), mv(self.write_slots), groups, mv(self.output_rows))
