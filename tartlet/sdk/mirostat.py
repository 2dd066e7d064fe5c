"""Mirostat v2: sampling that steers the surprise of each token to a target.

Basu, Ramachandran, Keskar and Varshney, "Mirostat: A Neural Text Decoding
Algorithm that Directly Controls Perplexity", ICLR 2021 (Algorithm 2), as
llama.cpp implements it (``llama_sampler_init_mirostat_v2(seed, tau, eta)``):

1. ``p = softmax(logits / T)``, sorted descending;
2. keep the tokens whose surprise ``-log2 p`` is at most ``mu`` (the most
   likely one at least), renormalise, draw ``x``;
3. ``mu <- mu - eta * (s - tau)``, where ``s = -log2 p'(x)`` is the observed
   surprise under the renormalised distribution ``p'``.

``mu`` starts at ``2 * tau``. The state (``mu``) changes with every token, so
Mirostat runs here, in the SDK, on the top of the distribution the engine
returns (:class:`tartlet.Sampler` asks for a ``distribution`` slot of
:func:`candidates_needed` tokens): no token with surprise at most ``mu`` can
lie outside it, so the truncation is exact. Pure Python (runs unchanged in
WASM builds).
"""

from __future__ import annotations

import math
import random


def candidates_needed(mu: float, vocab_size: int) -> int:
    """How many of the most likely tokens hold every token whose surprise
    ``-log2 p`` is at most ``mu``: at most ``floor(2**mu)`` tokens can each
    have probability ``>= 2**-mu`` (they sum to at most 1), plus one so the
    cut is seen. At least 1, at most ``vocab_size``."""
    if mu >= math.log2(vocab_size):
        return vocab_size
    return max(1, min(vocab_size, int(2.0**mu) + 1))


def truncate(probs: list[float], mu: float) -> int:
    """How many of ``probs`` (descending, summing to ~1) Mirostat v2 keeps:
    the leading run with ``-log2 p <= mu``, at least one."""
    floor = 2.0**-mu
    n = 0
    while n < len(probs) and probs[n] >= floor:
        n += 1
    return max(1, n)


def draw(ids: list[int], probs: list[float], mu: float, tau: float, eta: float, rng: random.Random) -> tuple[int, float, float]:
    """One Mirostat v2 step over the top of a distribution.

    Args:
        ids, probs: token ids and their probabilities under
            ``softmax(logits / T)``, descending (the engine's
            ``distribution`` slot), covering at least
            :func:`candidates_needed` tokens.
        mu: the current truncation surprise, bits.
        tau: the target surprise, bits.
        eta: the learning rate.
        rng: the draw's random source.

    Returns:
        ``(token id, observed surprise in bits, the next mu)``.
    """
    n = truncate(probs, mu)
    kept = probs[:n]
    total = math.fsum(kept)
    r = rng.random() * total
    j = n - 1
    acc = 0.0
    for i, p in enumerate(kept):
        acc += p
        if r < acc:
            j = i
            break
    surprise = -math.log2(kept[j] / total)
    return ids[j], surprise, mu - eta * (surprise - tau)
