"""Output slots of an explicit forward pass (:meth:`Context.forward`).

An :class:`OutputSlot` asks the host for one output of a pass: a sampled
token, a distribution, raw logits, log-probabilities, the entropy or a
hidden state at input token ``index`` (0-based, within the pass's input). It is the WIT record
``output-slot`` (``wit/tartlet.wit``) as a Python dataclass, and the type
:meth:`tartlet.host.api.HostApi.forward` takes in both runtimes. The
helpers below build one per kind; a ``logit_mask`` is a BRLE list over the
vocabulary (True = allowed), see :mod:`tartlet.brle`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .attention_probe import AttentionProbe, AttentionScores  # noqa: F401 (re-exported: tartlet.forward.AttentionProbe)

if TYPE_CHECKING:
    from .sampler import Sampler

#: llama.cpp's default DRY sequence breakers (``dry_sequence_breakers``).
DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")

#: What an output slot can ask for (``OutputSlot.kind``).
OUTPUT_KINDS = ("sample", "distribution", "logits", "logprobs", "entropy", "hidden")


@dataclass
class OutputSlot:
    """One requested output of a forward pass.

    Attributes:
        index: the input token (0-based within the pass) whose logits are used.
        kind: ``sample`` (result: a token id), ``distribution`` (``(ids,
            probs)``, the top ``k`` of ``softmax(logits / temperature)``),
            ``logits`` (``vocab_size`` floats), ``logprobs`` (floats, natural
            log, of ``token_ids``), ``entropy`` (a float, nats) or
            ``hidden`` (``hidden_size`` floats: see :func:`hidden`).
        temperature: ``sample``: 0 = greedy (default); ``distribution``: the
            softmax temperature (None: 1.0).
        top_k, top_p, min_p, typical_p, xtc_probability, xtc_threshold,
        dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
        dry_sequence_breakers, seed: ``sample`` only (see :class:`tartlet.Sampler`).
        k: ``distribution`` only: how many tokens.
        token_ids: ``logprobs`` only.
        logit_mask: BRLE over the vocabulary (True = allowed), or None.
        grammar: a matcher handle (``grammar_new``) whose mask the host
            applies during the pass, or None.
        layer: ``hidden`` only: the decoder layer read (0-based, negative
            from the end), or None: the final hidden state.
    """

    index: int
    kind: str = "sample"
    temperature: float | None = None
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    typical_p: float = 1.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_SEQUENCE_BREAKERS))
    seed: int | None = None
    k: int = 1
    token_ids: list[int] = field(default_factory=list)
    logit_mask: list[int] | None = None
    grammar: int | None = None
    layer: int | None = None


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


def hidden(index: int, layer: int | None = None) -> OutputSlot:
    """The hidden state of input token ``index``; result: ``hidden_size``
    floats (float32 values).

    ``layer`` None: the final hidden state, after the model's final norm
    (the LM head's input; Hugging Face ``output_hidden_states[-1]``). An
    int: the output of that decoder layer, 0-based (HF
    ``hidden_states[layer + 1]``), negative counting from the end (``-1``:
    the last layer's output before the final norm). A layer outside the
    model's raises ``SamplingError`` (a ``ValueError``) when the pass is
    submitted. Tokens with a hidden slot are always computed, never taken
    from the prefix cache (their states are not kept there). See
    :mod:`tartlet.embedding` for pooled, normalised embeddings.
    """
    return OutputSlot(index, "hidden", layer=layer)


def attention_scores(layers: list[int] | None = None, *, reduce: str = "sum", per: str = "token",
                     per_kv_head: bool = False) -> AttentionProbe:
    """The attention-score probe (:mod:`tartlet.attention_probe`): put it in
    ``outputs`` of :meth:`Context.forward` (at most one per pass; it reads
    no ``index``: every query of the pass counts); its result, at the same
    place, is an :class:`~tartlet.attention_probe.AttentionScores` holding,
    per layer of ``layers`` (None: all), the attention mass each of the
    context's positions received from the pass's queries (``reduce="sum"``,
    summed over queries and heads; ``"max"``: the largest weight), per
    position or per page (``per``), per KV head or all heads together."""
    return AttentionProbe(None if layers is None else list(layers), reduce, per, per_kv_head)
