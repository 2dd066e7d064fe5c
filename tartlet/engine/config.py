"""Model hyper-parameters shared by the loaders and the model code.

A :class:`ModelConfig` is what a loader (GGUF or Hugging Face folder) produces
and what :mod:`tartlet.engine.llama` consumes. Field names follow Hugging Face
``LlamaConfig`` so a ``config.json`` maps onto it one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    Attributes:
        architecture: ``"llama"`` or ``"qwen2"`` (the latter adds a bias to the
            Q, K and V projections).
        vocab_size: number of rows of the embedding matrix.
        hidden_size: model width ``H``.
        intermediate_size: SwiGLU inner width.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention when
            fewer than query heads).
        head_dim: width of one head; ``hidden_size // num_attention_heads``
            unless the model says otherwise.
        rms_norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: Hugging Face ``rope_scaling`` dict (``rope_type`` one of
            ``default``, ``linear``, ``dynamic``-less ``llama3``) or ``None``.
        max_position_embeddings: trained context length in tokens.
        tie_word_embeddings: the output projection reuses the embedding matrix.
        attention_bias: Q, K, V projections carry a bias (Qwen2).
        bos_token_id / eos_token_ids / pad_token_id: special token ids.
        name: human-readable model name (from metadata or the folder name).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    name: str = "model"
