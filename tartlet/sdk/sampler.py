"""Samplers: how an inferlet picks each token.

A :class:`Sampler` is a description sent with each forward pass; the engine
runs it next to the logits (argmax, multinomial with temperature, top-k,
top-p, min-p, top-k + top-p) and returns the token. :meth:`Sampler.custom`
instead asks the engine for the top-k distribution and lets a Python function
choose, so authors can write samplers of their own.

Seeds: a seeded sampler derives the seed of step ``i`` as
``(seed + i * 0x9E3779B97F4A7C15) mod 2**63``, so a seeded generation is
reproducible whatever else the engine batches with it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from .errors import SamplingError
from .forward import OutputSlot

_GOLDEN = 0x9E3779B97F4A7C15


def step_seed(seed: int, step: int) -> int:
    """The seed of generation step ``step`` of a sampler seeded ``seed``
    (a golden-ratio stride, so steps draw independent streams), in
    [0, 2**63). The host's :meth:`~tartlet.host.api.HostApi.generate`
    derives the same seeds as :meth:`Sampler.slot`."""
    return (seed + step * _GOLDEN) % 2**63


def validate_sampler(temperature: float, top_k: int | None, top_p: float, min_p: float) -> None:
    """Check sampler parameters.

    Raises:
        SamplingError: (a ``ValueError``) temperature < 0 or NaN, top_k < 1, top_p outside (0, 1],
            or min_p outside [0, 1]; the message names the parameter.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or math.isnan(temperature) or temperature < 0:
        raise SamplingError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise SamplingError(f"top_k must be an integer >= 1 (or None), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise SamplingError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(min_p, bool) or not isinstance(min_p, (int, float)) or not 0 <= min_p <= 1:
        raise SamplingError(f"min_p must be in [0, 1], got {min_p!r}")


CustomFn = Callable[[list[int], list[float]], int]


class Sampler:
    """Token selection rule.

    Args:
        temperature: 0 = greedy (argmax).
        top_k: keep the k most likely tokens (None: all).
        top_p: nucleus threshold in (0, 1].
        min_p: drop tokens below ``min_p * p_max``.
        seed: makes the draws reproducible (see module doc).

    Every argument is keyword-only, in the constructor and the presets alike
    (``Sampler.top_p(0.9, temperature=0.7, seed=1)``): Pie's order
    ``top_p(temperature, p)`` differs from ours, so a positional temperature
    is a ``TypeError`` rather than a silent swap.

    Raises:
        ValueError: a parameter out of range.
        TypeError: an optional argument given by position.
    """

    def __init__(
        self,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        min_p: float = 0.0,
        seed: int | None = None,
    ) -> None:
        validate_sampler(temperature, top_k, top_p, min_p)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.temperature = float(temperature)
        # These instance attributes shadow the presets of the same name
        # (Sampler.top_k(k) builds one, sampler.top_k reads the value), which
        # mypy cannot express: it types the names as the classmethods.
        self.top_k = top_k  # type: ignore[method-assign, assignment]
        self.top_p = float(top_p)  # type: ignore[method-assign, assignment]
        self.min_p = float(min_p)  # type: ignore[method-assign, assignment]
        self.seed = seed
        self._custom: CustomFn | None = None
        self._custom_k = 0

    # -- presets ---------------------------------------------------------------
    @classmethod
    def greedy(cls) -> "Sampler":
        """Always the most likely token."""
        return cls()

    @classmethod
    def multinomial(cls, *, temperature: float = 1.0, seed: int | None = None) -> "Sampler":
        """Draw from ``softmax(logits / temperature)``."""
        return cls(temperature=temperature, seed=seed)

    @classmethod
    def top_k(cls, k: int, *, temperature: float = 1.0, seed: int | None = None) -> "Sampler":
        return cls(temperature=temperature, top_k=k, seed=seed)

    @classmethod
    def top_p(cls, p: float, *, temperature: float = 1.0, seed: int | None = None) -> "Sampler":
        return cls(temperature=temperature, top_p=p, seed=seed)

    @classmethod
    def min_p(cls, p: float, *, temperature: float = 1.0, seed: int | None = None) -> "Sampler":
        return cls(temperature=temperature, min_p=p, seed=seed)

    @classmethod
    def top_k_top_p(cls, k: int, p: float, *, temperature: float = 1.0, seed: int | None = None) -> "Sampler":
        return cls(temperature=temperature, top_k=k, top_p=p, seed=seed)

    @classmethod
    def reasoning(cls, *, seed: int | None = None) -> "Sampler":
        """Preset for reasoning models: top-k 20, top-p 0.95, temperature 0.6."""
        return cls(temperature=0.6, top_k=20, top_p=0.95, seed=seed)

    @classmethod
    def custom(cls, fn: CustomFn, *, k: int = 64, temperature: float = 1.0) -> "Sampler":
        """A sampler written in Python: each step the engine returns the
        ``k`` most likely tokens of ``softmax(logits / temperature)`` as
        ``(ids, probs)`` (descending) and ``fn(ids, probs)`` returns the
        chosen token id.

        Raises:
            ValueError: k < 1 or temperature <= 0.
        """
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"custom sampler needs k >= 1, got {k!r}")
        if not temperature > 0:
            raise ValueError(f"custom sampler needs temperature > 0, got {temperature!r}")
        s = cls(temperature=temperature)
        s._custom = fn
        s._custom_k = k
        return s

    @property
    def is_greedy(self) -> bool:
        return self._custom is None and self.temperature == 0

    # -- wire format -------------------------------------------------------------
    def slot(self, index: int, step: int = 0) -> OutputSlot:
        """The output slot asking for this sampler at input ``index``, for
        generation step ``step`` (used to derive the seed)."""
        if self._custom is not None:
            return OutputSlot(index, "distribution", temperature=self.temperature, k=self._custom_k)
        seed = None if self.seed is None else step_seed(self.seed, step)
        return OutputSlot(index, "sample", temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,  # type: ignore[arg-type]  # the values (see __init__)
                          seed=seed)

    def pick(self, result: Any) -> int:
        """The token id from the slot's result (runs the custom function).

        Raises:
            ValueError: a custom function returned something other than an int.
        """
        if self._custom is None:
            return int(result)
        ids, probs = result
        tok = self._custom(list(ids), list(probs))
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"custom sampler returned {tok!r}, not a token id")
        return tok

    def __repr__(self) -> str:
        if self._custom is not None:
            return f"Sampler.custom({getattr(self._custom, '__name__', 'fn')}, k={self._custom_k})"
        return f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}, seed={self.seed})"
