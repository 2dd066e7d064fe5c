"""Read a Hugging Face model folder (``config.json`` + ``*.safetensors`` + tokenizer).

``config.json`` keys follow ``transformers``' config classes of the supported
families (:data:`~tartlet.engine.loading.loader.HF_MODEL_TYPES`: ``LlamaConfig``,
``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``, ``Phi3Config``,
``Gemma2Config``, ``Gemma3TextConfig``, ``MixtralConfig``, ``Qwen2MoeConfig``,
``Qwen3MoeConfig``). Both the 4.x
``rope_theta``/``rope_scaling`` keys and the 5.x ``rope_parameters`` dict
(per layer type for Gemma 3) are understood. Weight names are already
Hugging Face's; Qwen2 always has Q/K/V biases (``Qwen2Attention`` hard-codes
``bias=True``), Qwen2-MoE has them unless ``qkv_bias`` is false. Mixtral
checkpoints name their experts ``block_sparse_moe.experts.{j}.w1/w3/w2``
(gate/up/down) and transformers 5 may store experts as 3-D
``mlp.experts.gate_up_proj`` ``[E, 2 I, H]`` / ``mlp.experts.down_proj``
``[E, H, I]``; both become the per-expert names of :mod:`tartlet.engine.loading.loader`
(:func:`expert_weights`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tartlet.engine.loading.loaded_model import HF_MODEL_TYPES, LoadedModel, ModelLoadError, check_weights
from tartlet.engine.models.config import ModelConfig
from tartlet.engine.models.rope import Rotary
from tartlet.engine.text.tokenizer import Tokenizer


def _rope(cfg: dict[str, Any], key: str | None = None) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` of ``config.json``: the 4.x ``rope_theta`` and
    ``rope_scaling`` keys or the 5.x ``rope_parameters`` dict (per layer
    type, ``key``, for Gemma 3); ``scaling`` is ``None`` for plain RoPE."""
    rope: dict[str, Any] = dict(cfg.get("rope_parameters") or {})
    if key is not None and isinstance(rope.get(key), dict):
        rope = dict(rope[key])
    theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("longrope", "su", "yarn") \
            and "original_max_position_embeddings" not in scaling and "original_max_position_embeddings" in cfg:
        scaling = {**scaling, "original_max_position_embeddings": cfg["original_max_position_embeddings"]}
    if cfg.get("model_type") == "phi3" and scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
        scaling = {**scaling, "rope_type": "longrope"}  # Phi3Config reads both as longrope
    return float(theta), scaling


def _family_fields(path: Path, arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The :class:`ModelConfig` fields that differ between families, from ``config.json``.

    Defaults per family are those of the ``transformers`` config classes
    (``Qwen2Config`` ... ``Gemma3TextConfig``) for configs that omit a key.

    Raises:
        ModelLoadError: partial rotary embeddings, or an MLP activation we do not implement.
    """
    n = int(cfg["num_hidden_layers"])
    gemma = arch in ("gemma2", "gemma3")
    f: dict[str, Any] = dict(qk_norm=arch in ("qwen3", "gemma3", "qwen3_moe"), gemma_norms=gemma)
    # sliding windows: Qwen2/3 (and MoE) only with use_sliding_window; Mistral, Mixtral, Phi-3 and
    # Qwen3-MoE on every layer; Gemma per layer
    window = cfg.get("sliding_window")
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not cfg.get("use_sliding_window"):
        window = None
    elif gemma and window is None:
        window = 4096
    types = tuple(cfg.get("layer_types") or ())
    if window is not None and not types:
        if arch in ("qwen2", "qwen3", "qwen2_moe"):
            start = int(cfg.get("max_window_layers", 28))
            types = tuple("sliding_attention" if i >= start else "full_attention" for i in range(n))
        elif arch == "gemma2":
            types = tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n))
        elif arch == "gemma3":
            pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
            types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))
    if window is not None and types and "sliding_attention" not in types:
        window, types = None, ()
    f.update(sliding_window=None if window is None else int(window), layer_types=types if window is not None else ())
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if gemma and act == "gelu":
        act = "gelu_pytorch_tanh"  # Gemma configs that say "gelu" run the tanh approximation (HF GemmaConfig note)
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ModelLoadError(f"{path}: MLP activation {act!r} is not supported (supported: silu, gelu_pytorch_tanh)")
    f["hidden_act"] = act
    rope = cfg.get("rope_parameters") or {}
    partial = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise ModelLoadError(f"{path}: partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    if gemma:
        f.update(query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
                 attn_logit_softcapping=cfg.get("attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
                 final_logit_softcapping=cfg.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None))
    if arch == "gemma3":
        local = cfg.get("rope_local_base_freq")
        if local is None:
            local, local_scaling = _rope(cfg, "sliding_attention")
            if local_scaling is not None:
                raise ModelLoadError(f"{path}: RoPE scaling on sliding layers is not supported")
        f["rope_local_theta"] = float(local)
    if arch in ("mixtral", "qwen2_moe", "qwen3_moe"):
        f.update(_moe_fields(path, arch, cfg, n))
    return f


def _moe_fields(path: Path, arch: str, cfg: dict[str, Any], n: int) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig`, with the defaults of
    ``MixtralConfig``/``Qwen2MoeConfig``/``Qwen3MoeConfig`` and their sparse-layer
    rule (``Qwen2MoeDecoderLayer``: ``i not in mlp_only_layers and
    (i + 1) % decoder_sparse_step == 0``; every Mixtral layer is sparse)."""
    experts = cfg.get("num_local_experts" if arch == "mixtral" else "num_experts")
    if experts is None:
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 8 if arch == "mixtral" else 60 if arch == "qwen2_moe" else 128))
    experts = int(experts)
    top_k = int(cfg.get("num_experts_per_tok", 2 if arch == "mixtral" else 4 if arch == "qwen2_moe" else 8))
    if experts <= 0 or not 1 <= top_k <= experts:
        raise ModelLoadError(f"{path}: {experts} experts with {top_k} per token is not a mixture of experts")
    if arch == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    norm_topk_prob=True, sparse_layers=tuple(range(n)))
    step = int(cfg.get("decoder_sparse_step", 1)) or 1
    dense = set(cfg.get("mlp_only_layers") or ())
    f = dict(num_experts=experts, num_experts_per_tok=top_k,
             moe_intermediate_size=int(cfg.get("moe_intermediate_size", 1408 if arch == "qwen2_moe" else 768)),
             norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
             sparse_layers=tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0))
    if arch == "qwen2_moe":
        f["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size", 5632))
    return f


_MIXTRAL_EXPERT = re.compile(r"(model\.layers\.\d+\.)block_sparse_moe\.(gate\.weight|experts\.(\d+)\.w([123])\.weight)")


def expert_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` with MoE experts under the per-expert names of :mod:`tartlet.engine.loading.loader`.

    Mixtral's ``block_sparse_moe.gate`` becomes ``mlp.gate`` and
    ``experts.{j}.w1/w3/w2`` ``mlp.experts.{j}.gate_proj/up_proj/down_proj``
    (``MixtralBlockSparseTop2MLP`` of transformers 4.x: ``w2(act(w1 x) * w3 x)``);
    3-D ``mlp.experts.gate_up_proj`` ``[E, 2 I, H]`` (gate rows first, as
    ``MixtralExperts`` chunks it) and ``mlp.experts.down_proj`` ``[E, H, I]``
    are split into views per expert. Other names pass unchanged.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = _MIXTRAL_EXPERT.fullmatch(name)
        if m:
            if m.group(3) is None:
                out[m.group(1) + "mlp.gate.weight"] = t
            else:
                part = {"1": "gate", "3": "up", "2": "down"}[m.group(4)]
                out[f"{m.group(1)}mlp.experts.{m.group(3)}.{part}_proj.weight"] = t
        elif name.endswith("mlp.experts.gate_up_proj") and t.dim() == 3:
            base = name[: -len("gate_up_proj")]
            gates, ups = t.chunk(2, dim=1)
            for j, (gate, up) in enumerate(zip(gates.unbind(0), ups.unbind(0))):
                out[f"{base}{j}.gate_proj.weight"], out[f"{base}{j}.up_proj.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj") and t.dim() == 3:
            base = name[: -len("down_proj")]
            for j, down in enumerate(t.unbind(0)):
                out[f"{base}{j}.down_proj.weight"] = down
        else:
            out[name] = t
    return out


def config_from_hf(path: Path, cfg: dict[str, Any], tokenizer: Tokenizer) -> ModelConfig:
    """Map a ``config.json`` dict onto :class:`ModelConfig`.

    Raises:
        ModelLoadError: unsupported ``model_type`` (the message lists the
            supported ones), an unsupported feature of a supported family
            (see :func:`_family_fields`, RoPE types of :mod:`tartlet.engine.models.rope`),
            or a missing required key.
    """
    mt = cfg.get("model_type")
    arch = None if mt is None else HF_MODEL_TYPES.get(mt)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported model_type {mt!r} "
                             f"(supported: {', '.join(HF_MODEL_TYPES)})")
    try:
        hidden, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg, "full_attention")
        eos = cfg.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        eos_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *eos]))
        config = ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg.get("intermediate_size", 0) if arch in ("qwen2_moe", "qwen3_moe") else cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_head,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or hidden // n_head),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", arch in ("gemma2", "gemma3"))),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("qkv_bias", True)) if arch == "qwen2_moe"
            else bool(cfg.get("attention_bias", False)),
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else cfg.get("pad_token_id"),
            name=path.name,
            **_family_fields(path, arch, cfg),
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: config.json lacks {e.args[0]!r}") from e
    try:
        Rotary(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return config


def load_hf_folder(path: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load config, tokenizer and weights (cast to ``dtype``) from a Hugging Face folder.

    Raises:
        ModelLoadError: unreadable ``config.json``, no ``tokenizer.json``, no
            or corrupt ``*.safetensors``, unsupported architecture, missing weights.
    """
    try:
        cfg = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path / 'config.json'}: unreadable ({e})") from e
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: folder has no tokenizer.json")
    tokenizer = Tokenizer.from_hf_folder(path)
    config = config_from_hf(path, cfg, tokenizer)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path}: folder has no *.safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # safetensors raises SafetensorError (not exported) on bad files
            raise ModelLoadError(f"{f}: cannot read safetensors ({e})") from e
    weights = check_weights(path, config, expert_weights(weights))
    return LoadedModel(
        config=config,
        weights={k: v.to(dtype).contiguous() for k, v in weights.items()},
        tokenizer=tokenizer,
        source=path,
    )
