"""DRY ("don't repeat yourself"): a penalty on the token that would extend a
sequence already repeated in the context.

p-e-w, text-generation-webui PR #5677; this is llama.cpp's version
(``llama_sampler_init_dry``, ported from koboldcpp PR #982 by pi6am) with
its parameters and defaults. Over the last ``penalty_last_n`` tokens of the
context (the prompt included; -1: all of them):

1. Sequence breakers limit how far back a repetition may reach: scanning
   back from the end, the first complete breaker sequence found ends the
   search window (``rep_limit``: the number of tokens after it).
2. For each earlier position ``j``, ``n_j`` is the length of the longest
   suffix of the context that also ends at ``j`` (at most ``rep_limit``).
3. The token at ``j + 1`` would extend that repetition: when ``n_j >=
   allowed_length`` it gets ``n = max n_j`` over its occurrences.
4. Its logit loses ``multiplier * base ** (n - allowed_length)`` (the
   exponent clamped so the power stays a finite float32), unless the token
   is a single-token sequence breaker.

Breakers are strings, matched against the vocabulary as llama.cpp does
(:func:`process_breakers`): a token whose text contains a breaker is a
breaker on its own; a token whose text ends with the start of a breaker is
the head of a multi-token breaker, its tail the tokenization of the rest.
Token texts are each token decoded alone; a multi-byte character split
across tokens decodes to U+FFFD there, so a non-ASCII breaker may match
fewer heads than llama.cpp's byte strings do.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ..text.tokenizer import Tokenizer

#: llama.cpp's caps: a breaker's tail is cut at 20 tokens.
MAX_TAIL_TOKENS = 20
#: ``log(FLT_MAX)``: the exponent is clamped to ``FLOAT_MAX_LOG / log(base)``.
FLOAT_MAX_LOG = 88.7228391


@dataclass(frozen=True)
class DryBreakers:
    """Sequence breakers against one vocabulary.

    Attributes:
        tails: head token id -> the tails (token id tuples, possibly empty)
            that complete a breaker starting with it.
        single: the head ids with an empty tail (whole breakers on their
            own: never penalised).
    """

    tails: dict[int, tuple[tuple[int, ...], ...]]
    single: frozenset[int]


@functools.lru_cache(maxsize=4)
def _vocab_texts(tokenizer: Tokenizer) -> tuple[str, ...]:
    """Every token's text, decoded alone (special tokens as their text)."""
    ids = [[i] for i in range(tokenizer.vocab_size)]
    return tuple(tokenizer.backend.decode_batch(ids, skip_special_tokens=False))


@functools.lru_cache(maxsize=64)
def process_breakers(tokenizer: Tokenizer, breakers: tuple[str, ...]) -> DryBreakers:
    """The breakers ``breakers`` (strings) as token sequences of
    ``tokenizer``'s vocabulary (llama.cpp's ``get_overlapping_token_sequences``;
    cached per tokenizer and breaker tuple: the first call scans the
    vocabulary, ~0.2 s for 49k tokens)."""
    texts = _vocab_texts(tokenizer)
    found: dict[int, list[tuple[int, ...]]] = {}

    def add(tok: int, tail: tuple[int, ...]) -> None:
        lst = found.setdefault(tok, [])
        if tail not in lst:
            lst.append(tail)

    for brk in breakers:
        first = brk[0]
        for tok, word in enumerate(texts):
            if brk in word:
                add(tok, ())
                continue
            pos = word.find(first)
            while pos >= 0:
                i = 1
                while i < len(brk) and pos + i < len(word) and word[pos + i] == brk[i]:
                    i += 1
                if pos + i >= len(word):  # the word ends with brk[:i]: the rest is the tail
                    add(tok, tuple(tokenizer.encode(brk[i:])[:MAX_TAIL_TOKENS]))
                pos = word.find(first, pos + 1)
    tails = {t: tuple(v) for t, v in found.items()}
    return DryBreakers(tails, frozenset(t for t, v in tails.items() if () in v))


@dataclass(frozen=True)
class DryParams:
    """One slot's DRY settings (see the module doc).

    Attributes:
        multiplier: penalty scale (> 0: a ``DryParams`` with 0 is not built).
        base: >= 1.
        allowed_length: repetitions this long or shorter are not penalised.
        penalty_last_n: how many of the last tokens are scanned (-1: all).
        breakers: the processed sequence breakers.
    """

    multiplier: float
    base: float
    allowed_length: int
    penalty_last_n: int
    breakers: DryBreakers


def _rep_limit(h: list[int], breakers: DryBreakers) -> int:
    """Step 1: tokens after the last complete breaker (``len(h)`` if none)."""
    n = len(h)
    for i in range(n):  # i: distance from the end
        tails = breakers.tails.get(h[n - 1 - i])
        if tails is None:
            continue
        longest = -1
        for tail in tails:
            m = len(tail)
            # the tail follows its head: tail[o] is h[n - i + o]
            if longest < m <= i and all(tail[o] == h[n - i + o] for o in range(m)):
                longest = m
        if longest >= 0:
            return i - longest
    return n


def _suffix_matches(h: list[int]) -> np.ndarray:
    """For each ``j < n - 1``, the length of the longest suffix of ``h``
    that also ends at ``j``: the Z-function of ``h`` reversed (Gusfield
    1997), read backwards; int64 ``[n - 1]``."""
    r = h[::-1]
    n = len(r)
    z = [0] * n
    lo = hi = 0
    for i in range(1, n):
        m = min(hi - i, z[i - lo]) if i < hi else 0
        while i + m < n and r[m] == r[i + m]:
            m += 1
        z[i] = m
        if i + m > hi:
            lo, hi = i, i + m
    return np.asarray(z[:0:-1], dtype=np.int64)  # z[n-1-j] for j = 0 .. n-2


def dry_penalties(history: list[int], p: DryParams) -> dict[int, float]:
    """The DRY penalty of each token that gets one, given the context's
    tokens ``history`` (oldest first, the slot's input token last).

    Returns:
        token id -> the amount subtracted from its logit (float64).
    """
    h = history if p.penalty_last_n < 0 else history[len(history) - p.penalty_last_n :]
    n = len(h)
    if n <= p.allowed_length:
        return {}
    limit = _rep_limit(h, p.breakers)
    if limit < p.allowed_length:
        return {}
    # Step 2: the match length ending at each earlier position j, found by
    # narrowing the candidates one token further back at a time: a vector
    # step per token of the longest match, cheap while matches are few and
    # short (they are, in text); once that work passes 16 n (long runs of
    # one token or a short period), the Z-algorithm llama.cpp runs, O(n)
    a = np.asarray(h, dtype=np.int64)
    length = np.zeros(n - 1, dtype=np.int64)
    cand = np.arange(n - 1)
    k = work = 0
    while cand.size and k < limit:
        work += cand.size
        if work > 16 * n:
            length = np.minimum(_suffix_matches(h), limit)
            break
        cand = cand[cand >= k]
        cand = cand[a[cand - k] == a[n - 1 - k]]
        k += 1
        length[cand] = k
    # Step 3: the longest repetition each next token would extend
    sel = np.flatnonzero(length >= p.allowed_length)
    best: dict[int, int] = {}
    for tok, m in zip(a[sel + 1].tolist(), length[sel].tolist()):
        if m > best.get(tok, -1):
            best[tok] = m
    # Step 4: the penalties
    max_exp = int(FLOAT_MAX_LOG / math.log(p.base)) if p.base > 1.000001 else 0
    out = {}
    for tok, m in best.items():
        if tok in p.breakers.single:
            continue
        e = m - p.allowed_length
        if max_exp > 0 and e > max_exp:
            e = max_exp
        out[tok] = p.multiplier * p.base**e
    return out
