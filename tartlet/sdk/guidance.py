"""Classifier-free guidance (CFG) for language models.

Sanchez, Fan, Spangher, Levi, Ammanamanchi and Biderman, "Stay on topic with
Classifier-Free Guidance", ICML 2024 (arXiv:2306.17806): the next-token
logits of a conditional context ``c`` (the prompt) and of an unconditional
(or negative) one ``u`` are combined as

    ``g = u + w * (c - u)``

with guidance scale ``w`` (1: the conditional model unchanged; > 1: more
weight on what the prompt adds; the paper finds ~1.5 best for most tasks).
Hugging Face's ``UnbatchedClassifierFreeGuidanceLogitsProcessor`` applies it
to log-softmax'ed logits; on raw logits, as here, ``g`` differs only by a
per-step constant, so ``softmax(g)`` is the same distribution.

:func:`guided_logits` runs both contexts' pending tokens as two forward
passes submitted together, which the engine batches into one model call.
Pure Python, no torch: runs unchanged in WASM builds.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import TYPE_CHECKING

from . import forward

if TYPE_CHECKING:
    from .context import Context


def combine(cond: list[float], uncond: list[float], scale: float) -> list[float]:
    """``u + scale * (c - u)`` elementwise over two logit vectors of one
    length (``vocab_size`` floats each).

    Raises:
        ValueError: the lengths differ, or ``scale`` is not a finite number.
    """
    if len(cond) != len(uncond):
        raise ValueError(f"guidance needs logits of one length, got {len(cond)} and {len(uncond)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"guidance scale must be a finite number, got {scale!r}")
    w = float(scale)
    return [u + w * (c - u) for c, u in zip(cond, uncond)]


async def guided_logits(cond: Context, uncond: Context, scale: float) -> list[float]:
    """Run the pending tokens of ``cond`` and ``uncond`` (both must have
    some) through the model, as two passes submitted at once (the engine
    batches them), and return :func:`combine` of the logits after each
    one's last pending token: ``vocab_size`` floats.

    Raises:
        ValueError: a context without pending tokens, or a bad ``scale``.
    """
    if not cond.pending or not uncond.pending:
        raise ValueError("guided_logits needs pending tokens in both contexts (fill them first)")
    rc, ru = await asyncio.gather(cond.forward(outputs=[forward.logits(len(cond.pending) - 1)]),
                                  uncond.forward(outputs=[forward.logits(len(uncond.pending) - 1)]))
    return combine(rc[0], ru[0], scale)


def pick(logits: list[float], temperature: float = 0.0, top_p: float = 1.0, rng: random.Random | None = None) -> int:
    """A token id from ``logits``: the argmax (the first of ties) when
    ``temperature`` is 0, else a draw from ``softmax(logits / temperature)``
    within the nucleus ``top_p`` (Holtzman et al. 2020: the most likely
    tokens until their mass reaches ``top_p``).

    Raises:
        ValueError: temperature < 0, or top_p outside (0, 1].
    """
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if temperature == 0:
        return max(range(len(logits)), key=logits.__getitem__)
    m = max(logits)
    weights = [math.exp((x - m) / temperature) for x in logits]
    ids = list(range(len(logits)))
    if top_p < 1:
        ids.sort(key=weights.__getitem__, reverse=True)
        total, acc, n = math.fsum(weights), 0.0, 0
        while n < len(ids) and acc < top_p * total:
            acc += weights[ids[n]]
            n += 1
        ids = ids[:n]
    r = (rng or random.Random()).random() * math.fsum(weights[i] for i in ids)
    for i in ids:
        r -= weights[i]
        if r < 0:
            return i
    return ids[-1]
