"""Drafters for speculative decoding (:meth:`Context.generate` ``drafter=``).

A drafter implements the :class:`tartlet.generator.Drafter` protocol:
``update(tokens)`` appends tokens the context now holds (first the whole
context, then the tokens accepted at each step) and ``draft()`` guesses the
continuation. The generator verifies every guess in one forward pass and
keeps only guesses equal to the sampler's own choice, so a drafter changes
speed, never the output.

:class:`NgramDrafter` is *prompt lookup decoding* (Saxena, 2023,
github.com/apoorvumang/prompt-lookup-decoding): find the most recent earlier
occurrence of the context's last ``n`` tokens and propose the tokens that
followed it. It needs no second model and shines when the output copies from
the input (rewriting code, quoting, summarising with extracts).
"""

from __future__ import annotations


class NgramDrafter:
    """Prompt-lookup (n-gram) drafter.

    For ``n`` from ``max_ngram`` down to ``min_ngram`` it looks up the last
    ``n`` tokens among earlier positions of the context; the first hit wins
    and the (up to ``max_draft``) tokens that followed that occurrence are the
    draft. Lookups are O(max_ngram) dict probes: each n-gram is indexed by
    the position right after its most recent occurrence that has a
    continuation.

    Args:
        max_draft: most tokens proposed per step (>= 1).
        max_ngram: longest suffix tried (>= min_ngram).
        min_ngram: shortest suffix tried (>= 1).

    Raises:
        ValueError: a parameter out of range.
    """

    def __init__(self, max_draft: int = 8, max_ngram: int = 3, min_ngram: int = 1) -> None:
        for name, v in (("max_draft", max_draft), ("max_ngram", max_ngram), ("min_ngram", min_ngram)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"NgramDrafter: {name} must be an integer >= 1, got {v!r}")
        if max_ngram < min_ngram:
            raise ValueError(f"NgramDrafter: max_ngram ({max_ngram}) < min_ngram ({min_ngram})")
        self.max_draft = max_draft
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tokens: list[int] = []
        # n-gram (tuple) -> index just after its latest occurrence that is
        # followed by at least one token
        self._index: dict[tuple[int, ...], int] = {}

    def update(self, tokens: list[int]) -> None:
        """Append ``tokens`` (ids now in the context) to the lookup history."""
        t = self.tokens
        for tok in tokens:
            end = len(t)  # n-grams ending here now get a continuation: tok
            for n in range(self.min_ngram, self.max_ngram + 1):
                if end >= n:
                    self._index[tuple(t[end - n : end])] = end
            t.append(tok)

    def draft(self) -> list[int]:
        """Up to ``max_draft`` guessed next tokens (empty when the context's
        suffix never occurred before)."""
        t = self.tokens
        for n in range(min(self.max_ngram, len(t)), self.min_ngram - 1, -1):
            start = self._index.get(tuple(t[len(t) - n :]))
            if start is not None:
                return t[start : start + self.max_draft]
        return []

    def __repr__(self) -> str:
        return f"NgramDrafter(max_draft={self.max_draft}, max_ngram={self.max_ngram}, min_ngram={self.min_ngram})"
