"""Truncation filters that run after top-k, top-p and min-p: locally typical
sampling and XTC. Each takes the candidates left so far as probabilities
``p`` (float32 ``[n]``, not necessarily summing to 1: the filters before
cut the softmax without renormalising) and their token ids (int64 ``[n]``),
and returns the ones it keeps, in the same order.
"""

from __future__ import annotations

import torch


def typical(p: torch.Tensor, ids: torch.Tensor, mass: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Locally typical sampling (Meister, Pimentel, Wiher and Cotterell,
    "Locally Typical Sampling", TACL 2023), with Hugging Face's
    ``TypicalLogitsWarper`` semantics: over the renormalised candidates
    ``q``, sort by ``|-log q - H(q)|`` (distance of each token's surprise to
    the entropy, in nats) ascending, find the first index ``i`` where the
    cumulative ``q`` reaches ``mass`` (the last one if never), and keep
    every token whose distance is at most the ``i``-th (ties kept; the
    closest always). Computed in float64."""
    q = p.double()
    q = q / q.sum()
    logq = torch.where(q > 0, q.log(), torch.full_like(q, -torch.inf))
    ent = -(q * torch.where(q > 0, logq, torch.zeros_like(q))).sum()
    shifted = (-logq - ent).abs()
    order = shifted.argsort(stable=True)
    csum = q[order].cumsum(0)
    last = min(int((csum < mass).sum()), len(q) - 1)
    keep = shifted <= shifted[order[last]]
    return p[keep], ids[keep]


def xtc(p: torch.Tensor, ids: torch.Tensor, probability: float, threshold: float,
        coin: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """XTC, "exclude top choices" (p-e-w, text-generation-webui PR #6335),
    as llama.cpp's ``llama_sampler_init_xtc(p, t, min_keep, seed)``: nothing
    happens when ``probability`` is 0, ``threshold`` is above 0.5 (at most
    one token can pass it) or fewer than 2 candidates are left; else one
    uniform draw from ``coin`` (its own stream, so the token draw's noise
    is the same whether XTC acts or not) decides: at most ``probability``,
    every candidate whose renormalised probability is ``>= threshold`` is
    removed except the least likely of them (nothing when fewer than two
    pass it)."""
    if probability <= 0 or threshold > 0.5 or len(p) < 2:
        return p, ids
    if float(torch.rand((), generator=coin, dtype=torch.float64)) > probability:
        return p, ids
    q = p / p.sum()
    above = q >= threshold
    if int(above.sum()) < 2:
        return p, ids
    masked = torch.where(above, q, torch.full_like(q, torch.inf))
    drop = above.clone()
    drop[int(masked.argmin())] = False  # the least likely above the threshold stays
    return p[~drop], ids[~drop]
