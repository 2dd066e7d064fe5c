"""Output slots of an explicit forward pass (:meth:`Context.forward`).

Each helper returns the slot dict the host expects. ``index`` is the input
token (0-based, within the pass's input) whose logits are read. A
``logit_mask`` is a BRLE list over the vocabulary (True = allowed), see
:mod:`tartlet.brle`.
"""

from __future__ import annotations

from typing import Any

from .sampler import Sampler


def sample(index: int, sampler: Sampler, step: int = 0, logit_mask: list[int] | None = None) -> dict[str, Any]:
    """Pick a token at ``index`` with ``sampler``; result: token id (for a
    custom sampler: the ``(ids, probs)`` to pass to ``sampler.pick``)."""
    slot = sampler.slot(index, step)
    if logit_mask is not None:
        slot["logit_mask"] = list(logit_mask)
    return slot


def distribution(index: int, k: int = 10, temperature: float = 1.0, logit_mask: list[int] | None = None) -> dict[str, Any]:
    """Top-``k`` of ``softmax(logits / temperature)``; result ``(ids, probs)``."""
    slot: dict[str, Any] = {"index": index, "kind": "distribution", "k": k, "temperature": temperature}
    if logit_mask is not None:
        slot["logit_mask"] = list(logit_mask)
    return slot


def logits(index: int) -> dict[str, Any]:
    """Raw logits; result: ``vocab_size`` floats."""
    return {"index": index, "kind": "logits"}


def logprobs(index: int, token_ids: list[int]) -> dict[str, Any]:
    """Log-probabilities (natural log) of ``token_ids``; result: floats."""
    return {"index": index, "kind": "logprobs", "token_ids": list(token_ids)}


def entropy(index: int) -> dict[str, Any]:
    """Entropy of the next-token distribution in nats; result: float."""
    return {"index": index, "kind": "entropy"}
