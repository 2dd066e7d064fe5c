"""How a pass's attention groups are run: the plan per group, and the rule
that sends a group to the C attention kernel or to PyTorch's SDPA.

Below both the model (:mod:`.llama`, which builds the plans) and the fused
decode step (:mod:`..kernels.fused_decode`, which runs the same groups in
C), so neither imports the other for it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.batch import AttentionGroup

#: Most query-key scores per request (``num_queries * L``) of a multi-token
#: group whose attention the C kernel runs query by query (each query a row
#: with its request's KV slots and its mask row, as decode rows are); larger
#: groups (long prompts, long chunks over a long context) take PyTorch's
#: SDPA, whose blocked kernel reuses each key across queries. 128 x 128:
#: measured on the default model, 2 threads, the kernel is 1.01-1.14x
#: SDPA's speed up to 128-token prompts and 0.93-0.97x at 256 (docs/
#: benchmarks.md, "Host token streams and prefill attention by the kernel").
ROW_ATTENTION_MAX_SCORES = 128 * 128


def row_attention(g: AttentionGroup) -> bool:
    """Whether the C attention kernel can run group ``g`` query by query:
    one query per request, or at most :data:`ROW_ATTENTION_MAX_SCORES`
    query-key scores per request."""
    return g.num_queries == 1 or g.num_queries * g.kv_slots.shape[1] <= ROW_ATTENTION_MAX_SCORES


class GroupPlan(NamedTuple):
    """One attention group of a pass as the layers use it.

    Attributes:
        group: the group.
        bias: its mask as an additive float ``[B, 1, Q, L]`` mask (0 or
            -inf), or None.
        by_kernel: whether the C attention kernel runs it (one query per
            kernel row; a prefill group's ``B * Q`` queries each a row).
        slots, rows_bias: the kernel's arguments when ``by_kernel``: int64
            ``[R, L]`` KV slots per kernel row and float32 ``[R, L]``
            additive mask rows (or None: all visible), for the group's
            ``R = B * Q`` rows of ``q`` (``group.rows``, or from
            ``group.row_start``; request-major, so row ``b * Q + i`` is
            query ``i`` of request ``b``).
    """

    group: AttentionGroup
    bias: torch.Tensor | None
    by_kernel: bool
    slots: torch.Tensor
    rows_bias: torch.Tensor | None
