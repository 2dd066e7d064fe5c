"""Model hyper-parameters shared by the loaders and the model code.

A :class:`ModelConfig` is what a loader (GGUF or Hugging Face folder) produces
and what :mod:`tartlet.engine.models.llama` consumes. Field names follow Hugging Face
``LlamaConfig`` so a ``config.json`` maps onto it one to one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder.

    Attributes:
        architecture: a key of :data:`tartlet.engine.loading.loader.FAMILIES`
            (``"llama"``, ``"mistral"``, ``"qwen2"``, ``"qwen3"``, ``"phi3"``,
            ``"gemma2"``, ``"gemma3"``, ``"mixtral"``, ``"qwen2_moe"``,
            ``"qwen3_moe"``); the fields below say what differs.
        vocab_size: number of rows of the embedding matrix.
        hidden_size: model width ``H``.
        intermediate_size: SwiGLU inner width of the dense MLP layers.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention when
            fewer than query heads).
        head_dim: width of one head; ``hidden_size // num_attention_heads``
            unless the model says otherwise.
        rms_norm_eps: epsilon of RMSNorm.
        rope_theta: RoPE base frequency.
        rope_scaling: Hugging Face ``rope_scaling`` dict (``rope_type`` one of
            :data:`tartlet.engine.models.rope.SUPPORTED_ROPE_TYPES`) or ``None``.
        max_position_embeddings: trained context length in tokens.
        tie_word_embeddings: the output projection reuses the embedding matrix.
        attention_bias: Q, K, V projections carry a bias (Qwen2).
        qk_norm: RMSNorm over each query and key head (weights ``[head_dim]``)
            before RoPE (Qwen3, Gemma 3).
        sliding_window: ``W``: sliding layers attend to the last ``W`` tokens,
            the query's own included (HF ``sliding_window_overlay``:
            ``kv_idx > q_idx - W``); ``None``: no sliding layers.
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"``
            (HF ``layer_types``); empty: every layer slides when
            ``sliding_window`` is set (Mistral).
        hidden_act: MLP gate activation, ``"silu"`` (SwiGLU) or
            ``"gelu_pytorch_tanh"`` (GeGLU, Gemma).
        gemma_norms: Gemma's RMSNorm scales by ``1 + w``, the embedding is
            multiplied by ``sqrt(hidden_size)``, and each block has pre and post
            norms around attention and MLP (Gemma 2 and 3).
        query_pre_attn_scalar: attention scale is ``query_pre_attn_scalar ** -0.5``
            instead of ``head_dim ** -0.5`` (Gemma).
        attn_logit_softcapping / final_logit_softcapping: ``c * tanh(x / c)``
            on attention scores / output logits (Gemma 2), or ``None``.
        rope_local_theta: RoPE base of the sliding layers when it differs
            from ``rope_theta`` (Gemma 3; those layers use no scaling), or ``None``.
        num_experts: experts ``E`` of each sparse MoE layer (HF ``num_local_experts``
            / ``num_experts``); 0 for dense models.
        num_experts_per_tok: experts ``k`` each token is routed to.
        moe_intermediate_size: SwiGLU inner width of one expert (Mixtral:
            its ``intermediate_size``).
        shared_expert_intermediate_size: inner width of the always-on shared
            expert (Qwen2-MoE), 0 when there is none.
        norm_topk_prob: the ``k`` routing weights are renormalised to sum to 1
            (Mixtral always; Qwen-MoE per config); see :mod:`tartlet.engine.models.moe`.
        sparse_layers: indexes of the layers whose MLP is the sparse MoE block
            (HF: ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``);
            the others have the dense MLP.
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
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"
    gemma_norms: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None
    name: str = "model"

    def layer_window(self, i: int) -> int | None:
        """The sliding window ``W`` of layer ``i``, or ``None`` for a global layer."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def uniform_window(self) -> int | None:
        """``W`` when every layer is a sliding layer of window ``W`` (Mistral,
        Qwen2 with every layer sliding), else ``None`` (no window, or some
        global layer as in Gemma 2/3). Only then is a token ``W`` or more
        before the newest query never attended again, so the engine can
        release its page (:meth:`tartlet.engine.core.sequence.Sequence.drop_out_of_window`)."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the sparse MoE block (:mod:`tartlet.engine.models.moe`)."""
        return self.num_experts > 0 and i in self.sparse_layers
