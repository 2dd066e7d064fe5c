"""Write a LoRA adapter as a PEFT folder, the form ``peft`` itself loads
(``PeftModel.from_pretrained``) and :mod:`.adapter_loader` reads back.

Files (what PEFT's ``save_pretrained`` writes for a ``LoraModel``):

- ``adapter_model.safetensors``: per module ``base_model.model.model.layers.
  {i}.{module}.lora_A.weight`` (``[r, in_features]``) and ``...lora_B.weight``
  (``[out_features, r]``), float32.
- ``adapter_config.json``: ``peft_type`` ``LORA``, ``r`` and ``lora_alpha``
  of the most common module, ``rank_pattern`` / ``alpha_pattern`` for the
  others (keys ``layers\\.{i}\\.{module}``, escaped: PEFT matches them as
  regular expressions at the end of a module's name), ``target_modules`` (the
  module names when every layer has the same ones, else a regular expression
  matching exactly the modules). Each module's ``lora_alpha`` is ``scale *
  r``, so PEFT's scale ``lora_alpha / r`` is the adapter's (an rsLoRA
  adapter is written as plain LoRA with that alpha: the same update).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from pathlib import Path

import torch

from ..models.lora import ModuleLora

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_config(parts: dict[tuple[int, str], ModuleLora], base_model: str | None = None) -> dict[str, object]:
    """The ``adapter_config.json`` of an adapter whose modules are ``parts``
    (see the module docstring).

    Raises:
        ValueError: ``parts`` is empty.
    """
    if not parts:
        raise ValueError("an adapter needs at least one module")
    shape = {k: (int(m.a.shape[0]), float(m.scale) * int(m.a.shape[0])) for k, m in parts.items()}
    (r0, alpha0), _ = Counter(shape.values()).most_common(1)[0]
    ranks = {_pattern_key(k): r for k, (r, _) in sorted(shape.items()) if r != r0}
    alphas = {_pattern_key(k): a for k, (_, a) in sorted(shape.items()) if a != alpha0}
    layers = sorted({layer for layer, _ in parts})
    names = sorted({mod for _, mod in parts})
    if set(parts) == {(layer, mod) for layer in layers for mod in names} and len(layers) == 1 + max(layers):
        targets: list[str] | str = sorted({mod.rsplit(".", 1)[-1] for mod in names})
    else:
        targets = "|".join(re.escape(f"model.layers.{layer}.{mod}") for layer, mod in sorted(parts))
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": r0,
        "lora_alpha": alpha0,
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "target_modules": targets,
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "modules_to_save": None,
    }


def _pattern_key(key: tuple[int, str]) -> str:
    return re.escape(f"layers.{key[0]}.{key[1]}")


def save_peft(parts: dict[tuple[int, str], ModuleLora], folder: str | Path, base_model: str | None = None) -> None:
    """Write ``parts`` into ``folder`` (which must exist) as ``adapter_config.json``
    and ``adapter_model.safetensors``, each file flushed to disk (``fsync``);
    making the folder appear atomically is the caller's part (write a
    temporary folder, then rename it).

    Args:
        parts: ``(layer, Hugging Face module name) -> ModuleLora`` (``A``
            ``[r, in]``, ``B`` ``[out, r]``, float32).
        base_model: recorded as ``base_model_name_or_path``.

    Raises:
        ValueError: ``parts`` is empty.
        OSError: a write failed.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    config = peft_config(parts, base_model)
    tensors: dict[str, torch.Tensor] = {}
    for (layer, mod), m in sorted(parts.items()):
        stem = f"base_model.model.model.layers.{layer}.{mod}"
        tensors[f"{stem}.lora_A.weight"] = m.a.detach().to("cpu", torch.float32).contiguous()
        tensors[f"{stem}.lora_B.weight"] = m.b.detach().to("cpu", torch.float32).contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE), metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    for name in (WEIGHTS_FILE, CONFIG_FILE):
        with open(folder / name, "rb+") as f:
            os.fsync(f.fileno())
