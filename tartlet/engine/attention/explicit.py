"""Attention written out as ``softmax(q k^T * scale + mask) v``: the path
for groups whose weights are needed, not only the output.

SDPA (``F.scaled_dot_product_attention``) returns the output alone. Two
cases need the weights: Gemma 2's soft-capping of the scores before the
softmax (HF ``eager_attention_forward`` of ``modeling_gemma2.py``), and the
attention-score probe (:mod:`tartlet.engine.core.attention_probe`), which
takes them as they are computed, reduced over the group's queries, so a
long prompt never holds a ``[Q, L]`` weight matrix per layer for it. The
scores are computed in the model's dtype and the softmax in float32, as the
soft-capping path always did.
"""

from __future__ import annotations

import torch

#: Most scores (``B * heads * queries * L``) computed at once: queries are
#: taken in blocks below this, so a long prompt's scores never sit whole
#: in memory (the same results, block by block).
MAX_SCORES = 1 << 24


def explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, scale: float,
    softcap: float | None = None, probe: torch.Tensor | None = None, reduce: str = "sum",
) -> torch.Tensor:
    """Attention of ``q`` ``[B, nh, Q, hd]`` over ``k``, ``v`` ``[B, nkv, L,
    hd]`` (grouped-query heads: head ``h`` reads KV head ``h // (nh /
    nkv)``; Ainslie et al., 2023).

    Args:
        bias: additive float mask ``[B, 1, Q, L]`` (0 or -inf), or None:
            causal over the last ``Q`` of the ``L`` keys when ``Q > 1``, all
            of them when ``Q == 1``.
        scale: the score scale (``1 / sqrt(hd)`` or the model's).
        softcap: ``c``: scores become ``c * tanh(s / c)`` before the mask
            (Gemma 2), or None.
        probe: float32 ``[B, nh, L]`` receiving each head's softmax weights
            reduced over the ``Q`` queries (``reduce``: ``"sum"`` or
            ``"max"``), or None.

    Returns:
        ``[B, nh, Q, hd]`` in ``v``'s dtype: ``softmax(s) @ v``, the
        softmax in float32 (Vaswani et al., 2017, eq. 1).
    """
    B, nh, Q, _ = q.shape
    L = k.shape[2]
    rep = nh // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    kt = k.transpose(2, 3)
    step = max(1, MAX_SCORES // max(1, B * nh * L))
    outs = []
    for q0 in range(0, Q, step):
        q1 = min(Q, q0 + step)
        scores = torch.matmul(q[:, :, q0:q1], kt) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if bias is not None:
            scores = scores + bias[:, :, q0:q1]
        elif Q > 1:  # query i of the Q sees keys up to L - Q + i
            rows = torch.arange(q0, q1, device=q.device)[:, None] + (L - Q)
            scores = scores.masked_fill(torch.arange(L, device=q.device)[None, :] > rows, float("-inf"))
        p = torch.softmax(scores.float(), -1)
        if probe is not None:
            part = p.sum(2) if reduce == "sum" else p.amax(2)
            if q0 == 0:
                probe.copy_(part)
            elif reduce == "sum":
                probe.add_(part)
            else:
                torch.maximum(probe, part, out=probe)
        outs.append(torch.matmul(p.to(v.dtype), v))
    return outs[0] if len(outs) == 1 else torch.cat(outs, 2)
