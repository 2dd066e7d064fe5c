"""Read a Hugging Face model folder (``config.json`` + ``*.safetensors`` + tokenizer).

``config.json`` keys follow ``transformers``' ``LlamaConfig``/``Qwen2Config``.
Both the 4.x ``rope_theta``/``rope_scaling`` keys and the 5.x
``rope_parameters`` dict are understood. Weight names are already Hugging
Face's; Qwen2 always has Q/K/V biases (``Qwen2Attention`` hard-codes
``bias=True``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tartlet.engine.config import ModelConfig
from tartlet.engine.loader import SUPPORTED_ARCHITECTURES, LoadedModel, ModelLoadError, check_weights
from tartlet.engine.tokenizer import Tokenizer


def config_from_hf(path: Path, cfg: dict[str, Any], tokenizer: Tokenizer) -> ModelConfig:
    """Map a ``config.json`` dict onto :class:`ModelConfig`.

    Raises:
        ModelLoadError: unsupported ``model_type``, sliding-window attention,
            or a missing required key.
    """
    arch = cfg.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported model_type {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if cfg.get("use_sliding_window"):
        raise ModelLoadError(f"{path}: sliding-window attention is not supported")
    try:
        hidden, n_head = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = dict(cfg.get("rope_parameters") or {})
        theta = cfg.get("rope_theta", rope.pop("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        eos_ids = tuple(dict.fromkeys([*tokenizer.eos_token_ids, *eos]))
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=n_head,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_head),
            head_dim=int(cfg.get("head_dim") or hidden // n_head),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else cfg.get("pad_token_id"),
            name=path.name,
        )
    except KeyError as e:
        raise ModelLoadError(f"{path}: config.json lacks {e.args[0]!r}") from e


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
    weights = check_weights(path, config, weights)
    return LoadedModel(
        config=config,
        weights={k: v.to(dtype).contiguous() for k, v in weights.items()},
        tokenizer=tokenizer,
        source=path,
    )
