"""Stop conditions for generation, composable with ``|``.

A condition looks at the tokens generated so far (the newest last) and the
decoded text, and says whether generation ends. ``a | b`` stops when either
does. :class:`StopStrings` also tells the generator where to cut the text.
"""

from __future__ import annotations

from typing import Iterable, TypeVar

C = TypeVar("C")


class StopCondition:
    """Base class: override :meth:`should_stop`."""

    def should_stop(self, tokens: list[int], text: str) -> bool:
        raise NotImplementedError

    def __or__(self, other: "StopCondition") -> "StopCondition":
        return AnyOf([self, other])


class AnyOf(StopCondition):
    """Stops when any of its conditions does."""

    def __init__(self, conditions: Iterable[StopCondition]) -> None:
        self.conditions: list[StopCondition] = []
        for c in conditions:
            self.conditions.extend(c.conditions if isinstance(c, AnyOf) else [c])

    def should_stop(self, tokens: list[int], text: str) -> bool:
        return any(c.should_stop(tokens, text) for c in self.conditions)

    def find(self, kind: type[C]) -> list[C]:
        return [c for c in self.conditions if isinstance(c, kind)]


class MaxTokens(StopCondition):
    """Stops after ``n`` generated tokens (n >= 1)."""

    def __init__(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {n!r}")
        self.n = n

    def should_stop(self, tokens: list[int], text: str) -> bool:
        return len(tokens) >= self.n


class EosTokens(StopCondition):
    """Stops when the newest token is one of ``ids`` (it is not part of
    the returned text)."""

    def __init__(self, ids: Iterable[int]) -> None:
        self.ids = frozenset(ids)

    def should_stop(self, tokens: list[int], text: str) -> bool:
        return bool(tokens) and tokens[-1] in self.ids


class StopStrings(StopCondition):
    """Stops when the text contains one of ``strings``; the returned text
    ends just before it."""

    def __init__(self, strings: Iterable[str]) -> None:
        self.strings = [s for s in strings if s]
        if not self.strings:
            raise ValueError("StopStrings needs at least one non-empty string")

    def should_stop(self, tokens: list[int], text: str) -> bool:
        return self.cut(text) is not None

    def cut(self, text: str) -> int | None:
        """Index where the earliest stop string starts, or None."""
        hits = [i for i in (text.find(s) for s in self.strings) if i >= 0]
        return min(hits) if hits else None

    def holdback(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could start a stop
        string (kept back from streaming until it is decided)."""
        best = 0
        for s in self.strings:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


def max_tokens(n: int) -> MaxTokens:
    return MaxTokens(n)


def eos(ids: Iterable[int]) -> EosTokens:
    return EosTokens(ids)


def stop_strings(*strings: str) -> StopStrings:
    return StopStrings(strings)
