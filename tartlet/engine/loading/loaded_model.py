"""A loaded model (config + weights + tokenizer) as every loader returns it, and
the architecture tables and weight-name checks the loaders share.

Whatever the source, weights come out under Hugging Face names in
PyTorch orientation (``[out_features, in_features]``)::

    model.embed_tokens.weight                         [vocab, H]
    model.layers.{i}.input_layernorm.weight           [H]
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  [out, in]
    model.layers.{i}.self_attn.{q,k,v}_proj.bias      [out]      (Qwen2 only)
    model.layers.{i}.self_attn.{q,k}_norm.weight      [head_dim] (QK-norm: Qwen3, Gemma 3)
    model.layers.{i}.post_attention_layernorm.weight  [H]
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight [H] (Gemma)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight   [out, in]  (dense layers)
    model.layers.{i}.mlp.gate.weight                  [E, H]     (sparse MoE layers: router)
    model.layers.{i}.mlp.experts.{j}.{gate,up,down}_proj.weight [out, in]  (expert j < E)
    model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight [out, in] (Qwen2-MoE)
    model.layers.{i}.mlp.shared_expert_gate.weight    [1, H]     (Qwen2-MoE)
    model.norm.weight                                 [H]
    lm_head.weight                                    [vocab, H] (only when not tied)

Phi-3 keeps its fused ``self_attn.qkv_proj.weight`` ``[(nh + 2 nkv) hd, H]``
(rows Q, K, V) and ``mlp.gate_up_proj.weight`` ``[2 I, H]`` (rows gate, up)
instead of the separate matrices. Mixtral's ``block_sparse_moe.*`` names
(``w1``/``w3``/``w2`` = gate/up/down) and GGUF's 3-D expert tensors are
mapped onto the per-expert names above by the loaders. Gemma norm weights are HF's (the model
scales by ``1 + w``).

Q and K rows are in Hugging Face's ``rotate_half`` RoPE order.

This module is what every loader produces and checks, below them all
(:mod:`.loader` dispatches to :mod:`.gguf_loader` and :mod:`.hf_loader`,
which import this, not the dispatcher). It does not import torch at import
time (``model_store`` uses :class:`ModelLoadError` without it); the loaders do.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from tartlet.engine.models.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from tartlet.engine.loading.quant_formats import QuantWeight
    from tartlet.engine.text.tokenizer import Tokenizer

#: A loaded weight: float, or quantized when kept in its blocks.
W = TypeVar("W", bound="torch.Tensor | QuantWeight")

#: Our architecture names, one per model family the decoder (:mod:`tartlet.engine.models.llama`) runs.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3",
                           "mixtral", "qwen2_moe", "qwen3_moe")

#: Hugging Face ``model_type`` -> architecture.
HF_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
    "gemma2": "gemma2", "gemma3_text": "gemma3", "mixtral": "mixtral", "qwen2_moe": "qwen2_moe",
    "qwen3_moe": "qwen3_moe",
}
#: GGUF ``general.architecture`` -> architecture (llama.cpp writes Mistral models as ``llama``,
#: and Mixtral as ``llama`` with ``llama.expert_count``: read as ``mixtral``).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3", "gemma2": "gemma2",
                      "gemma3": "gemma3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}

#: Weight-name endings of the MoE routers, kept in float by ``quantize`` (as llama.cpp keeps ``ffn_gate_inp``).
ROUTER_WEIGHTS = ("mlp.gate.weight", "mlp.shared_expert_gate.weight")


class ModelLoadError(ValueError):
    """A model could not be found, read or understood. The message names the path and the problem."""


@dataclass
class LoadedModel:
    """Everything needed to run a model.

    Attributes:
        config: architecture hyper-parameters.
        weights: tensors by Hugging Face name (see module docstring), all of the
            requested dtype, on CPU; matrices kept quantized are
            :class:`~tartlet.engine.loading.quant_formats.QuantWeight`.
        tokenizer: the model's tokenizer.
        source: the ``.gguf`` file or folder it was read from.
    """

    config: ModelConfig
    weights: dict[str, "torch.Tensor | QuantWeight"]
    tokenizer: "Tokenizer"
    source: Path


def expected_weight_names(config: ModelConfig) -> list[str]:
    """The exact set of weight names a model with ``config`` has (see module docstring)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    fused = config.architecture == "phi3"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.gemma_norms:
            names += [p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"]
        if fused:
            names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight"]
        else:
            names += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        if config.attention_bias:
            names += [f"{p}self_attn.{x}_proj.bias" for x in "qkv"]
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config.is_sparse_layer(i):
            names += moe_weight_names(config, p)
        elif fused:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
        else:
            names += [f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
    return names


def moe_weight_names(config: ModelConfig, prefix: str) -> list[str]:
    """The weight names of one sparse MoE layer (``prefix`` = ``"model.layers.{i}."``)."""
    p = prefix + "mlp."
    names = [p + "gate.weight"]
    names += [f"{p}experts.{j}.{x}_proj.weight" for j in range(config.num_experts) for x in ("gate", "up", "down")]
    if config.shared_expert_intermediate_size:
        names += [f"{p}shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")] + [p + "shared_expert_gate.weight"]
    return names


def check_weights(
    path: Path, config: ModelConfig, weights: dict[str, W]
) -> dict[str, W]:
    """Keep exactly the expected weights, checking presence and the embedding shape.

    Raises:
        ModelLoadError: a weight is missing or ``embed_tokens`` is not ``[vocab, H]``.
    """
    names = expected_weight_names(config)
    missing = [n for n in names if n not in weights]
    if missing:
        raise ModelLoadError(f"{path}: missing weights {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    emb = tuple(weights["model.embed_tokens.weight"].shape)
    if emb != (config.vocab_size, config.hidden_size):
        raise ModelLoadError(f"{path}: embedding shape {emb} != (vocab, hidden) "
                             f"({config.vocab_size}, {config.hidden_size})")
    return {n: weights[n] for n in names}
