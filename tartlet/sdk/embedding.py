"""Text embeddings from a model's hidden states: pooling and L2 normalisation.

An embedding here is one vector per input, pooled from the hidden states
the ``hidden`` output slot returns (:func:`tartlet.forward.hidden`):

- ``mean``: the mean of the hidden states of every input token (the
  "MEAN" strategy of Sentence-BERT: Reimers & Gurevych, 2019, "Sentence-BERT:
  Sentence Embeddings using Siamese BERT-Networks"; the mean of the last
  hidden states, as ``sentence_transformers.models.Pooling`` computes it);
- ``last``: the hidden state of the last input token, which in a causal
  model is the only one that has seen the whole input (last-token pooling of
  decoder embedders, e.g. Wang et al., 2024, "Improving Text Embeddings with
  Large Language Models", E5-Mistral).

Then, with ``normalize``, the vector is divided by its Euclidean (L2) norm,
so cosine similarity is a dot product (OpenAI's embeddings are normalised
so). Which pooling suits a model is its model card's call; a causal LM such
as the default SmolLM2-135M-Instruct is not trained as an embedder at all,
and mean pooling is the usual fallback for those (the server's default).

Every input runs in a context of its own, all of a wave concurrently, so
the engine batches their prefills; each context is closed (its KV pages
freed) as soon as its vector is read. ``mean`` asks for a hidden state at
every position, so its tokens never come from the prefix cache; ``last``
reuses cached prefix pages like any prefill. Pure Python (no numpy): runs
natively and in WASM builds alike.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from . import forward
from .errors import ContextLengthError

if TYPE_CHECKING:
    from .adapter import Adapter
    from .model import Model

#: The pooling strategies :func:`pool` knows.
POOLINGS = ("mean", "last")

#: Default token budget of one wave of :func:`embed_many` (the inputs of a
#: wave are in the KV cache at the same time).
WAVE_TOKENS = 8192


def mean_pool(states: Sequence[Sequence[float]]) -> list[float]:
    """The element-wise mean of ``states`` (``n >= 1`` vectors of equal length).

    Raises:
        ValueError: no vector, or vectors of different lengths.
    """
    if not states:
        raise ValueError("mean pooling needs at least one hidden state")
    width = len(states[0])
    if any(len(s) != width for s in states):
        raise ValueError("mean pooling needs hidden states of one length")
    n = len(states)
    return [math.fsum(col) / n for col in zip(*states)]


def l2_normalize(vector: Sequence[float]) -> list[float]:
    """``vector / ||vector||_2`` (the norm summed with ``math.fsum``); an
    all-zero vector is returned unchanged (it has no direction)."""
    norm = math.sqrt(math.fsum(x * x for x in vector))
    if norm == 0.0:
        return list(vector)
    return [x / norm for x in vector]


def pool(states: Sequence[Sequence[float]], pooling: str = "mean", normalize: bool = True) -> list[float]:
    """One embedding from the hidden states of an input's tokens, in order.

    Args:
        states: ``n >= 1`` hidden states (``hidden_size`` floats each).
        pooling: ``mean`` (all of them) or ``last`` (the last one).
        normalize: divide by the L2 norm (:func:`l2_normalize`).

    Raises:
        ValueError: an unknown ``pooling``, or no state.
    """
    check_pooling(pooling)
    if not states:
        raise ValueError("pooling needs at least one hidden state")
    v = mean_pool(states) if pooling == "mean" else list(states[-1])
    return l2_normalize(v) if normalize else v


def check_pooling(pooling: object) -> str:
    """``pooling`` when it is one of :data:`POOLINGS`.

    Raises:
        ValueError: anything else, naming the parameter.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    return str(pooling)


def input_tokens(model: "Model", text: str | Sequence[int]) -> list[int]:
    """The token ids an input is embedded from: a string's tokens (with the
    model's BOS first when it asks for one, as :meth:`Context.fill` does),
    or token ids as they are.

    Raises:
        ValueError: an empty input, or a token id outside the vocabulary.
        ContextLengthError: more tokens than the model's context.
    """
    if isinstance(text, str):
        if not text:
            raise ValueError("an input to embed must not be empty")
        ids = model.tokenize(text)
        bos = model.bos_token_id
        if model.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
    else:
        ids = list(text)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < model.vocab_size:
                raise ValueError(f"token id {t!r} outside the vocabulary [0, {model.vocab_size})")
    if not ids:
        raise ValueError("an input to embed must not be empty")
    if len(ids) > model.max_seq_len:
        raise ContextLengthError(f"an input of {len(ids)} tokens is longer than the model's context ({model.max_seq_len} tokens)")
    return ids


async def embed(model: "Model", text: str | Sequence[int], *, pooling: str = "mean", normalize: bool = True,
                layer: int | None = None, adapter: "Adapter | str | None" = None) -> list[float]:
    """The embedding of one input (a string, or token ids).

    Args:
        model: the model whose hidden states are pooled.
        text: a string (tokenized as :func:`input_tokens` says) or token ids.
        pooling: ``mean`` or ``last`` (see the module docstring).
        normalize: L2-normalise the pooled vector.
        layer: the hidden states pooled: None, the final ones (after the
            final norm), or a decoder layer's output (:func:`tartlet.forward.hidden`).
        adapter: a LoRA adapter the pass runs with, or None.

    Returns:
        ``hidden_size`` floats.

    Raises:
        ValueError: an empty input, an unknown ``pooling``, a bad token id.
        ContextLengthError: the input is longer than the model's context.
        SamplingError: ``layer`` outside the model's layers.
    """
    return (await embed_many(model, [text], pooling=pooling, normalize=normalize, layer=layer, adapter=adapter))[0]


async def embed_many(model: "Model", inputs: Sequence[str | Sequence[int]], *, pooling: str = "mean",
                     normalize: bool = True, layer: int | None = None, adapter: "Adapter | str | None" = None,
                     wave_tokens: int = WAVE_TOKENS) -> list[list[float]]:
    """The embeddings of ``inputs``, in order: :func:`embed` of each, their
    forward passes submitted together so the engine runs them as one batch
    (in waves of at most ``wave_tokens`` input tokens, and at most half the
    model's KV pool, or one input, in the KV cache at once: concurrent
    prefills that together outgrow the pool would wait on each other's
    pages). Every context is closed when its vector is read, and when any
    pass fails.

    Raises:
        ValueError, ContextLengthError, SamplingError: as :func:`embed`, for
            any input (checked before anything runs).
    """
    check_pooling(pooling)
    if isinstance(wave_tokens, bool) or not isinstance(wave_tokens, int) or wave_tokens < 1:
        raise ValueError(f"wave_tokens must be an int >= 1, got {wave_tokens!r}")
    token_lists = [input_tokens(model, t) for t in inputs]
    kv = model.kv_stats()
    budget = max(1, min(wave_tokens, kv["total"] * kv["page_size"] // 2))

    async def one(ids: list[int]) -> list[float]:
        with model.new_context() as ctx:
            ctx.fill_tokens(ids)
            wanted = range(len(ids)) if pooling == "mean" else [len(ids) - 1]
            states = await ctx.forward(outputs=[forward.hidden(i, layer) for i in wanted], adapter=adapter)
        return pool(states, pooling, normalize)

    out: list[list[float]] = []
    wave: list[list[int]] = []
    size = 0
    for ids in token_lists + [[]]:  # a final empty list flushes the last wave
        if wave and (not ids or size + len(ids) > budget):
            out += await asyncio.gather(*(one(w) for w in wave))
            wave, size = [], 0
        if ids:
            wave.append(ids)
            size += len(ids)
    return out
