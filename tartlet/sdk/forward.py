"""Output slots of an explicit forward pass (:meth:`Context.forward`).

An :class:`OutputSlot` asks the host for one output of a pass: a sampled
token, a distribution, raw logits, log-probabilities or the entropy at input
token ``index`` (0-based, within the pass's input). It is the WIT record
``output-slot`` (``wit/tartlet.wit``) as a Python dataclass, and the type
:meth:`tartlet.host.api.HostApi.forward` takes in both runtimes. The
helpers below build one per kind; a ``logit_mask`` is a BRLE list over the
vocabulary (True = allowed), see :mod:`tartlet.brle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sampler import Sampler

#: What an output slot can ask for (``OutputSlot.kind``).
OUTPUT_KINDS = ("sample", "distribution", "logits", "logprobs", "entropy")


@dataclass
class OutputSlot:
    """One requested output of a forward pass.

    Attributes:
        index: the input token (0-based within the pass) whose logits are used.
        kind: ``sample`` (result: a token id), ``distribution`` (``(ids,
            probs)``, the top ``k`` of ``softmax(logits / temperature)``),
            ``logits`` (``vocab_size`` floats), ``logprobs`` (floats, natural
            log, of ``token_ids``) or ``entropy`` (a float, nats).
        temperature: ``sample``: 0 = greedy (default); ``distribution``: the
            softmax temperature (None: 1.0).
        top_k, top_p, min_p, seed: ``sample`` only (see :class:`tartlet.Sampler`).
        k: ``distribution`` only: how many tokens.
        token_ids: ``logprobs`` only.
        logit_mask: BRLE over the vocabulary (True = allowed), or None.
        grammar: a matcher handle (``grammar_new``) whose mask the host
            applies during the pass, or None.
    """

    index: int
    kind: str = "sample"
    temperature: float | None = None
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    k: int = 1
    token_ids: list[int] = field(default_factory=list)
    logit_mask: list[int] | None = None
    grammar: int | None = None


def sample(index: int, sampler: Sampler, step: int = 0, logit_mask: list[int] | None = None) -> OutputSlot:
    """Pick a token at ``index`` with ``sampler``; result: token id (for a
    custom sampler: the ``(ids, probs)`` to pass to ``sampler.pick``)."""
    slot = sampler.slot(index, step)
    if logit_mask is not None:
        slot.logit_mask = list(logit_mask)
    return slot


def distribution(index: int, k: int = 10, temperature: float = 1.0, logit_mask: list[int] | None = None) -> OutputSlot:
    """Top-``k`` of ``softmax(logits / temperature)``; result ``(ids, probs)``."""
    return OutputSlot(index, "distribution", temperature=temperature, k=k, logit_mask=None if logit_mask is None else list(logit_mask))


def logits(index: int) -> OutputSlot:
    """Raw logits; result: ``vocab_size`` floats."""
    return OutputSlot(index, "logits")


def logprobs(index: int, token_ids: list[int]) -> OutputSlot:
    """Log-probabilities (natural log) of ``token_ids``; result: floats."""
    return OutputSlot(index, "logprobs", token_ids=list(token_ids))


def entropy(index: int) -> OutputSlot:
    """Entropy of the next-token distribution in nats; result: float."""
    return OutputSlot(index, "entropy")
