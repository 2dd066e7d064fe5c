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

:class:`AdaptiveDrafter` wraps a drafter and stops speculation when it stops
paying (low acceptance, a busy engine); :func:`served_drafter` builds the
one the server configured for a model (``[[models]] speculative``), as the
OpenAI routes and ``text-completion`` use it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from .sampler import Sampler

if TYPE_CHECKING:
    from .generator import Drafter
    from .model import Model


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


class AdaptiveDrafter:
    """A drafter that stops speculating when speculation stops paying.

    It wraps another drafter and, once one of the rules below fires, turns
    itself off for the rest of the generation (:attr:`active` False,
    :attr:`stopped` says which rule). :class:`~tartlet.generator.Generator`
    then drops it and decodes on as without a drafter, so the fast paths a
    drafter rules out come back: a host token stream with ``overlap=True``
    (the model never waits for the inferlet), host-side chunks with
    ``chunk=``. Same tokens either way: only how they are computed changes.

    Rules:

    * ``"load"`` (checked before each draft): ``load()`` is above
      ``max_batch``. A verify pass adds its draft's rows to a model call the
      other requests share; with many requests per call the CPU is
      compute-bound and every extra row slows all of them. vLLM's
      ``speculative_disable_by_batch_size`` (vllm-project/vllm#4592) turns
      speculation off above a running-queue size the same way. One busy
      call is enough: with 16 requests in flight nearly every call holds
      them all.
    * ``"acceptance"`` (checked after each verify pass): over the last
      ``window`` passes the generation gained fewer than
      ``min_tokens_per_pass`` tokens per pass (each pass yields its accepted
      draft tokens plus one). Prompt lookup finds some earlier n-gram for
      most contexts, so on text that does not copy its input the drafts are
      mostly rejected and every pass pays for rows that yield nothing; the
      first ``window`` passes always speculate. A rule of ours (llama.cpp's
      server only skips drafts shorter than ``--draft-min``; Hugging Face's
      ``num_assistant_tokens_schedule="heuristic"`` shrinks the draft
      instead), chosen so that a request whose output stops copying goes back
      to the token stream for good.

    Args:
        drafter: the drafter proposing tokens (``update``/``draft``).
        window: passes the acceptance rule averages over (>= 1).
        min_tokens_per_pass: the rule's threshold (>= 1.0; 1.0 never fires).
        load: returns the engine's load, the requests of its last model call
            (``lambda: model.kv_stats()["batch_requests"]``); None: no load rule.
        max_batch: the load rule's threshold (>= 1).

    Attributes:
        active: still drafting.
        stopped: None while active, else ``"load"`` or ``"acceptance"``.
        passes: verify passes seen (steps after the first ``update``).
        tokens: tokens those passes yielded.

    Raises:
        ValueError: a parameter out of range (the message names it).
    """

    def __init__(
        self, drafter: Drafter, *, window: int = 16, min_tokens_per_pass: float = 1.5,
        load: Callable[[], float] | None = None, max_batch: int = 4,
    ) -> None:
        for name, v in (("window", window), ("max_batch", max_batch)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AdaptiveDrafter: {name} must be an integer >= 1, got {v!r}")
        if isinstance(min_tokens_per_pass, bool) or not isinstance(min_tokens_per_pass, (int, float)) \
                or not min_tokens_per_pass >= 1:
            raise ValueError(f"AdaptiveDrafter: min_tokens_per_pass must be a number >= 1, got {min_tokens_per_pass!r}")
        self.drafter = drafter
        self.window = window
        self.min_tokens_per_pass = float(min_tokens_per_pass)
        self.load = load
        self.max_batch = max_batch
        self.active = True
        self.stopped: str | None = None
        self.passes = 0
        self.tokens = 0
        self._recent: deque[int] = deque(maxlen=window)  # tokens of each of the last `window` passes
        self._primed = False  # the first update (the whole context) has come

    def update(self, tokens: list[int]) -> None:
        """The first call: the whole context; then each pass's accepted tokens
        (counted for the acceptance rule)."""
        self.drafter.update(tokens)
        if not self._primed:
            self._primed = True
            return
        self.passes += 1
        self.tokens += len(tokens)
        self._recent.append(len(tokens))
        if self.active and len(self._recent) == self.window and sum(self._recent) < self.min_tokens_per_pass * self.window:
            self._stop("acceptance")

    def draft(self) -> list[int]:
        """The wrapped drafter's draft, or [] once stopped (or stopping now
        because of the load)."""
        if self.active and self.load is not None and self.load() > self.max_batch:
            self._stop("load")
        return list(self.drafter.draft()) if self.active else []

    def _stop(self, why: str) -> None:
        self.active = False
        self.stopped = why

    def __repr__(self) -> str:
        return (f"AdaptiveDrafter({self.drafter!r}, window={self.window}, min_tokens_per_pass={self.min_tokens_per_pass}, "
                f"max_batch={self.max_batch}, active={self.active}, stopped={self.stopped!r})")


def served_drafter(model: Model, sampler: Sampler) -> AdaptiveDrafter | None:
    """The drafter the server configured for ``model`` (``[[models]]
    speculative``, :attr:`Model.speculative`), for a generation with
    ``sampler``: an :class:`AdaptiveDrafter` over an :class:`NgramDrafter`
    with the configured sizes, its load rule reading the engine's
    ``batch_requests`` (:meth:`Model.kv_stats`) against ``max_batch``.

    None when the server configured none, or when ``sampler`` cannot verify
    drafts exactly: speculation is used for greedy sampling and for seeded
    engine-side samplers only (a seeded sampler draws position ``i`` with
    the seed of generation step ``i`` whether or not the position came from
    a draft, so the tokens are plain decoding's; an unseeded one would be
    right in distribution only), never for custom or Mirostat samplers, or
    a subclass that picks tokens itself (logit bias, log-probabilities).
    Callers also leave it out where the generator gains nothing from it
    (a constraint, which gets no drafts) or refuses it (``fork``).

    Raises:
        ValueError: a speculative method this SDK does not know.
    """
    spec = model.speculative
    if spec is None:
        return None
    cls = type(sampler)
    if not (sampler.on_engine and cls.slot is Sampler.slot and cls.pick is Sampler.pick):
        return None
    if not (sampler.is_greedy or sampler.seed is not None):
        return None
    if spec["method"] != "ngram":
        raise ValueError(f"speculative method {spec['method']!r} is not supported by this SDK (ngram)")
    inner = NgramDrafter(spec["max_draft"], spec["max_ngram"], spec["min_ngram"])
    return AdaptiveDrafter(inner, load=lambda: model.kv_stats()["batch_requests"], max_batch=spec["max_batch"])
