"""Samplers: how an inferlet picks each token.

A :class:`Sampler` is a description sent with each forward pass; the engine
runs it next to the logits (argmax, multinomial with temperature, top-k,
top-p, min-p, typical-p, XTC, the DRY repetition penalty) and returns the
token. :meth:`Sampler.custom` instead asks the engine for the top-k
distribution and lets a Python function choose, so authors can write
samplers of their own; :meth:`Sampler.mirostat_v2` is one, built in.

Sources of the formulas (the engine's :mod:`tartlet.engine.core.sampler`
implements them): top-p, Holtzman et al. 2020 "The Curious Case of Neural
Text Degeneration"; min-p, Nguyen et al. 2024 "Turning Up the Heat: Min-p
Sampling for Creative and Coherent LLM Outputs"; typical-p, Meister et al.
2023 "Locally Typical Sampling" (TACL; Hugging Face ``TypicalLogitsWarper``);
XTC ("exclude top choices"), p-e-w, text-generation-webui PR #6335
(llama.cpp ``llama_sampler_init_xtc``); DRY ("don't repeat yourself"),
p-e-w, text-generation-webui PR #5677 (llama.cpp ``llama_sampler_init_dry``);
Mirostat v2, Basu et al. 2021 (:mod:`tartlet.sdk.mirostat`).

Seeds: a seeded sampler derives the seed of step ``i`` as
``(seed + i * 0x9E3779B97F4A7C15) mod 2**63``, so a seeded generation is
reproducible whatever else the engine batches with it.
"""

from __future__ import annotations

import math
import random
from typing import Any, Callable

from . import mirostat
from .errors import SamplingError
from .forward import DRY_SEQUENCE_BREAKERS, OutputSlot

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


def _real(v: Any) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def validate_filters(typical_p: float, xtc_probability: float, xtc_threshold: float) -> None:
    """Check the typical-p and XTC parameters.

    Raises:
        SamplingError: typical_p outside (0, 1], xtc_probability or
            xtc_threshold outside [0, 1]; the message names the parameter.
    """
    if not _real(typical_p) or not 0 < typical_p <= 1:
        raise SamplingError(f"typical_p must be in (0, 1], got {typical_p!r}")
    if not _real(xtc_probability) or not 0 <= xtc_probability <= 1:
        raise SamplingError(f"xtc_probability must be in [0, 1], got {xtc_probability!r}")
    if not _real(xtc_threshold) or not 0 <= xtc_threshold <= 1:
        raise SamplingError(f"xtc_threshold must be in [0, 1], got {xtc_threshold!r}")


#: Most DRY sequence breakers, and most characters in one (llama.cpp cuts
#: a breaker at 40 characters; here a longer one is an error).
DRY_MAX_BREAKERS, DRY_MAX_BREAKER_CHARS = 64, 40


def validate_dry(multiplier: float, base: float, allowed_length: int, penalty_last_n: int, sequence_breakers: Any) -> None:
    """Check the DRY parameters (llama.cpp's names without ``dry_``).

    Raises:
        SamplingError: multiplier < 0, base < 1, allowed_length < 0,
            penalty_last_n < -1 (not an int), or sequence_breakers not a
            list of at most 64 non-empty strings of at most 40 characters;
            the message names the parameter.
    """
    if not _real(multiplier) or multiplier < 0:
        raise SamplingError(f"dry_multiplier must be a number >= 0, got {multiplier!r}")
    if not _real(base) or base < 1:
        raise SamplingError(f"dry_base must be a number >= 1, got {base!r}")
    if isinstance(allowed_length, bool) or not isinstance(allowed_length, int) or not 0 <= allowed_length < 2**31:
        raise SamplingError(f"dry_allowed_length must be an integer >= 0, got {allowed_length!r}")
    if isinstance(penalty_last_n, bool) or not isinstance(penalty_last_n, int) or not -1 <= penalty_last_n < 2**31:
        raise SamplingError(f"dry_penalty_last_n must be an integer >= -1 (-1: the whole context, 0: off), got {penalty_last_n!r}")
    if isinstance(sequence_breakers, (str, bytes)) or not isinstance(sequence_breakers, (list, tuple)):
        raise SamplingError(f"dry_sequence_breakers must be a list of strings, got {type(sequence_breakers).__name__}")
    if len(sequence_breakers) > DRY_MAX_BREAKERS:
        raise SamplingError(f"dry_sequence_breakers holds at most {DRY_MAX_BREAKERS} strings, got {len(sequence_breakers)}")
    for b in sequence_breakers:
        if not isinstance(b, str) or not 0 < len(b) <= DRY_MAX_BREAKER_CHARS:
            raise SamplingError(f"dry_sequence_breakers: each must be a non-empty string of at most "
                                f"{DRY_MAX_BREAKER_CHARS} characters, got {b!r}")


def slot_dry(o: OutputSlot) -> tuple[float, float, int, int, list[str]] | None:
    """A ``sample`` slot's DRY fields, checked (:func:`validate_dry`):
    ``(multiplier, base, allowed_length, penalty_last_n,
    sequence_breakers)``, the WIT record ``dry-params``'s order; None when
    DRY is off (a multiplier or ``dry_penalty_last_n`` of 0)."""
    validate_dry(o.dry_multiplier, o.dry_base, o.dry_allowed_length, o.dry_penalty_last_n, o.dry_sequence_breakers)
    if o.dry_multiplier == 0 or o.dry_penalty_last_n == 0:
        return None
    return float(o.dry_multiplier), float(o.dry_base), o.dry_allowed_length, o.dry_penalty_last_n, list(o.dry_sequence_breakers)


CustomFn = Callable[[list[int], list[float]], int]


class Sampler:
    """Token selection rule.

    Args:
        temperature: 0 = greedy (argmax); the filters below then do not
            apply (the DRY penalty does: it changes the logits).
        top_k: keep the k most likely tokens (None: all).
        top_p: nucleus threshold in (0, 1].
        min_p: drop tokens below ``min_p * p_max`` (1 keeps only ties of
            the most likely).
        typical_p: locally typical sampling's mass in (0, 1] (1: off): keep
            the tokens whose surprise ``-log p`` is closest to the entropy,
            in that order, until their probability reaches ``typical_p``.
        xtc_probability: XTC: the probability in [0, 1] that a step
            excludes its top choices (0: off).
        xtc_threshold: XTC: when it acts, every token with probability
            ``>= xtc_threshold`` except the least likely of them is removed
            (a threshold above 0.5 never removes anything).
        dry_multiplier: DRY repetition penalty strength (0: off). A token
            that would extend a sequence of ``n >= dry_allowed_length``
            tokens already repeated in the context loses
            ``dry_multiplier * dry_base ** (n - dry_allowed_length)`` from
            its logit.
        dry_base: DRY's base (>= 1; llama.cpp's default 1.75).
        dry_allowed_length: the longest repetition DRY leaves alone (2).
        dry_penalty_last_n: how many of the last tokens DRY scans (-1: the
            whole context, 0: off).
        dry_sequence_breakers: strings a repetition never spans (tokenized
            against the model's vocabulary by the host, as llama.cpp does;
            default ``["\\n", ":", "\\"", "*"]``).
        seed: makes the draws reproducible (see module doc).

    Filters apply in this order, on the distribution left by the one
    before: temperature, top-k, top-p, min-p, typical-p, XTC (Hugging Face's
    order for the first five). DRY changes the logits before all of them.

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
        typical_p: float = 1.0,
        xtc_probability: float = 0.0,
        xtc_threshold: float = 0.1,
        dry_multiplier: float = 0.0,
        dry_base: float = 1.75,
        dry_allowed_length: int = 2,
        dry_penalty_last_n: int = -1,
        dry_sequence_breakers: list[str] | None = None,
        seed: int | None = None,
    ) -> None:
        validate_sampler(temperature, top_k, top_p, min_p)
        validate_filters(typical_p, xtc_probability, xtc_threshold)
        breakers = DRY_SEQUENCE_BREAKERS if dry_sequence_breakers is None else dry_sequence_breakers
        validate_dry(dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n, breakers)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.temperature = float(temperature)
        # These instance attributes shadow the presets of the same name
        # (Sampler.top_k(k) builds one, sampler.top_k reads the value), which
        # mypy cannot express: it types the names as the classmethods.
        self.top_k = top_k  # type: ignore[method-assign, assignment]
        self.top_p = float(top_p)  # type: ignore[method-assign, assignment]
        self.min_p = float(min_p)  # type: ignore[method-assign, assignment]
        self.typical_p = float(typical_p)
        self.xtc_probability = float(xtc_probability)
        self.xtc_threshold = float(xtc_threshold)
        self.dry_multiplier = float(dry_multiplier)
        self.dry_base = float(dry_base)
        self.dry_allowed_length = dry_allowed_length
        self.dry_penalty_last_n = dry_penalty_last_n
        self.dry_sequence_breakers = list(breakers)
        self.seed = seed
        self._custom: CustomFn | None = None
        self._custom_k = 0
        #: Mirostat v2's (tau, eta), or None; its state: mu and the step it is for
        self._mirostat: tuple[float, float] | None = None
        self.mu = 0.0
        self._step = 0
        #: unseeded Mirostat's random stream, made at its first draw (seeding
        #: one from os.urandom costs ~0.1 ms, once per request otherwise)
        self._rng: random.Random | None = None
        #: Mirostat: the observed surprise (bits) of each token picked since step 0
        self.surprises: list[float] = []

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
    def typical(cls, p: float, *, temperature: float = 1.0, seed: int | None = None) -> "Sampler":
        """Locally typical sampling with mass ``p`` (Meister et al. 2023)."""
        return cls(temperature=temperature, typical_p=p, seed=seed)

    @classmethod
    def xtc(cls, *, threshold: float = 0.1, probability: float = 0.5, temperature: float = 1.0,
            seed: int | None = None) -> "Sampler":
        """XTC (exclude top choices): with probability ``probability`` a step
        removes every token of probability ``>= threshold`` but the least
        likely of them (p-e-w, text-generation-webui PR #6335)."""
        return cls(temperature=temperature, xtc_threshold=threshold, xtc_probability=probability, seed=seed)

    @classmethod
    def mirostat_v2(cls, tau: float = 5.0, *, eta: float = 0.1, temperature: float = 1.0,
                    seed: int | None = None) -> "Sampler":
        """Mirostat v2 (Basu et al. 2021; llama.cpp's
        ``llama_sampler_init_mirostat_v2``): a draw from
        ``softmax(logits / temperature)`` truncated to the tokens whose
        surprise ``-log2 p`` is at most ``mu``, then ``mu -= eta * (s -
        tau)`` with ``s`` the drawn token's surprise (bits) in the
        truncated, renormalised distribution; ``mu`` starts at ``2 * tau``
        at generation step 0. See :mod:`tartlet.sdk.mirostat`.

        The state changes with every token, so the sampler runs in the SDK
        over a ``distribution`` slot (as :meth:`custom` does): generation
        steps one pass at a time, and one Sampler serves one generation at
        a time (:meth:`Generator.fork` copies it). No drafter.

        Raises:
            SamplingError: tau <= 0, eta < 0, or temperature <= 0.
        """
        if not _real(tau) or tau <= 0:
            raise SamplingError(f"mirostat tau must be a number > 0, got {tau!r}")
        if not _real(eta) or eta < 0:
            raise SamplingError(f"mirostat eta must be a number >= 0, got {eta!r}")
        if not _real(temperature) or temperature <= 0:
            raise SamplingError(f"mirostat needs temperature > 0, got {temperature!r}")
        s = cls(temperature=temperature, seed=seed)
        s._mirostat = (float(tau), float(eta))
        s.mu = 2.0 * tau
        return s

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
        return self._custom is None and self._mirostat is None and self.temperature == 0

    @property
    def on_engine(self) -> bool:
        """Whether the engine picks the token itself (a ``sample`` slot):
        not a custom function, not Mirostat."""
        return self._custom is None and self._mirostat is None

    # -- wire format -------------------------------------------------------------
    def slot(self, index: int, step: int = 0) -> OutputSlot:
        """The output slot asking for this sampler at input ``index``, for
        generation step ``step`` (used to derive the seed)."""
        if self._custom is not None:
            return OutputSlot(index, "distribution", temperature=self.temperature, k=self._custom_k)
        if self._mirostat is not None:
            if step == 0:
                self.mu = 2.0 * self._mirostat[0]
                self.surprises = []
            self._step = step
            return OutputSlot(index, "distribution", temperature=self.temperature,
                              k=mirostat.candidates_needed(self.mu, 1 << 24))
        seed = None if self.seed is None else step_seed(self.seed, step)
        return OutputSlot(index, "sample", temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,  # type: ignore[arg-type]  # the values (see __init__)
                          typical_p=self.typical_p, xtc_probability=self.xtc_probability, xtc_threshold=self.xtc_threshold,
                          dry_multiplier=self.dry_multiplier, dry_base=self.dry_base, dry_allowed_length=self.dry_allowed_length,
                          dry_penalty_last_n=self.dry_penalty_last_n, dry_sequence_breakers=list(self.dry_sequence_breakers),
                          seed=seed)

    def pick(self, result: Any) -> int:
        """The token id from the slot's result (runs the custom function, or
        Mirostat's step, which updates ``mu`` and records the surprise).

        Raises:
            ValueError: a custom function returned something other than an int.
        """
        if self._mirostat is not None:
            ids, probs = result
            tau, eta = self._mirostat
            if self.seed is not None:
                rng = random.Random(step_seed(self.seed, self._step))
            else:
                rng = self._rng = self._rng or random.Random()
            tok, surprise, self.mu = mirostat.draw(list(ids), list(probs), self.mu, tau, eta, rng)
            self.surprises.append(surprise)
            return tok
        if self._custom is None:
            return int(result)
        ids, probs = result
        tok = self._custom(list(ids), list(probs))
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise ValueError(f"custom sampler returned {tok!r}, not a token id")
        return tok

    def __copy__(self) -> "Sampler":
        """A copy with its own Mirostat state (``mu``, ``surprises``) and,
        unseeded, its own random stream."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.surprises = list(self.surprises)
        new.dry_sequence_breakers = list(self.dry_sequence_breakers)
        new._rng = None  # its own stream at its first unseeded draw
        return new

    def __repr__(self) -> str:
        if self._custom is not None:
            return f"Sampler.custom({getattr(self._custom, '__name__', 'fn')}, k={self._custom_k})"
        if self._mirostat is not None:
            tau, eta = self._mirostat
            return f"Sampler.mirostat_v2({tau}, eta={eta}, temperature={self.temperature}, seed={self.seed})"
        extra = ""
        if self.typical_p < 1:
            extra += f", typical_p={self.typical_p}"
        if self.xtc_probability > 0:
            extra += f", xtc_probability={self.xtc_probability}, xtc_threshold={self.xtc_threshold}"
        if self.dry_multiplier > 0:
            extra += (f", dry_multiplier={self.dry_multiplier}, dry_base={self.dry_base}, dry_allowed_length="
                      f"{self.dry_allowed_length}, dry_penalty_last_n={self.dry_penalty_last_n}")
        return (f"Sampler(temperature={self.temperature}, top_k={self.top_k}, top_p={self.top_p}, min_p={self.min_p}"
                f"{extra}, seed={self.seed})")
