"""Read LoRA adapter files: PEFT folders and llama.cpp GGUF adapters.

**PEFT** (``save_pretrained`` of a ``LoraModel``): a folder with
``adapter_config.json`` and ``adapter_model.safetensors``. Tensors are named
``base_model.model.model.layers.{i}.{module}.lora_A.weight`` (``[r, in]``)
and ``...lora_B.weight`` (``[out, r]``). The scale of each module follows
PEFT's ``LoraLayer.update_layer``: ``lora_alpha / r``, or ``lora_alpha /
sqrt(r)`` with ``use_rslora``; ``rank_pattern``/``alpha_pattern`` override
``r``/``lora_alpha`` per module (a key matches a module whose name ends with
it, PEFT's ``get_pattern_key``). Refused, with :class:`AdapterError`:
``modules_to_save`` (whole trained copies of modules), DoRA (``use_dora``),
LoRA biases (``bias`` other than ``"none"``), embedding or head adapters,
and any PEFT type other than ``LORA``.

**GGUF** (llama.cpp's ``convert_lora_to_gguf.py``): ``general.type =
"adapter"``, ``adapter.type = "lora"``, ``adapter.lora.alpha``, and
``general.architecture`` the base model's; tensors
``blk.{i}.attn_q.weight.lora_a`` (``[r, in]`` in PyTorch order) and
``.lora_b`` (``[out, r]``), any float or quantized GGUF type (dequantized).
The scale is llama.cpp's (``llama-adapter.cpp``): ``alpha / r``, or 1 when
alpha is 0. As for base weights (:mod:`~tartlet.engine.loading.gguf_loader`),
the rows of a *llama* file's ``attn_q``/``attn_k`` ``lora_b`` are in
llama.cpp's RoPE order and are un-permuted here.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from ...sdk.errors import AdapterError
from ..models.config import ModelConfig
from ..models.lora import LoraAdapter, ModuleLora, build_adapter
from .loader import GGUF_ARCHITECTURES, ModelLoadError

#: PEFT tensor names: ``base_model.model.model.layers.{i}.{module}.lora_{A|B}[.adapter].weight``
_PEFT_RE = re.compile(r"(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")
#: GGUF adapter tensor names: ``blk.{i}.{tensor}.weight.lora_{a|b}``
_GGUF_RE = re.compile(r"(blk\.\d+\.\w+\.weight)\.lora_([ab])")


def load_adapter(path: str | Path, config: ModelConfig, name: str | None = None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> LoraAdapter:
    """Load the LoRA adapter at ``path`` for a model of ``config``.

    Args:
        path: a PEFT folder (or its ``adapter_config.json``), or a GGUF adapter file.
        config: the base model's architecture (shapes are checked against it).
        name: the name it is served under (default: the file or folder name).
        dtype, device: of the adapter's matrices (float32 on the CPU; the
            compute dtype on CUDA).

    Returns:
        the :class:`LoraAdapter`, matrices fused per projection.

    Raises:
        AdapterError: a missing or unreadable file, an unsupported adapter
            (see the module docstring), or one made for another base model
            (architecture, layer count or shapes); the message names the file
            and, where one is at fault, the module.
    """
    p = Path(path)
    if p.name == "adapter_config.json":
        p = p.parent
    source = p
    if p.is_dir():
        modules = _peft_modules(p)
        source = p / "adapter_model.safetensors"  # errors of a module name the file holding it
    elif p.is_file() and p.suffix == ".gguf":
        modules = _gguf_modules(p, config)
    elif p.is_file():
        raise AdapterError(f"{p}: not an adapter (expected a PEFT folder with adapter_config.json, or a .gguf file)")
    else:
        raise AdapterError(f"{p}: no such adapter file or folder")
    return build_adapter(name or (p.stem if p.is_file() else p.name), source, config, modules, dtype, device)


def _pattern(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's ``get_pattern_key``: the value of the first key ``k`` with
    ``module`` matching ``(.*\\.)?k$``, else ``default``."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return value
    return default


def _peft_modules(folder: Path) -> dict[tuple[int, str], ModuleLora]:
    cfg_path = folder / "adapter_config.json"
    weights = folder / "adapter_model.safetensors"
    if not cfg_path.is_file():
        raise AdapterError(f"{folder}: no adapter_config.json (not a PEFT adapter folder)")
    if not weights.is_file():
        raise AdapterError(f"{folder}: no adapter_model.safetensors (PEFT's .bin files are not read: save with safetensors)")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{cfg_path}: unreadable ({e})") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{cfg_path}: not a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterError(f"{cfg_path}: peft_type {peft_type!r} is not supported (only LORA)")
    if cfg.get("modules_to_save"):
        raise AdapterError(f"{cfg_path}: modules_to_save {cfg['modules_to_save']!r} is not supported: those modules are "
                           "whole trained copies, not low-rank updates (merge the adapter instead)")
    if cfg.get("use_dora"):
        raise AdapterError(f"{cfg_path}: DoRA (use_dora) adapters are not supported")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{cfg_path}: LoRA biases (bias = {cfg['bias']!r}) are not supported")
    try:
        r0, alpha0 = int(cfg["r"]), float(cfg["lora_alpha"])
    except (KeyError, TypeError, ValueError) as e:
        raise AdapterError(f"{cfg_path}: needs integer r and number lora_alpha ({e})") from e
    rslora = bool(cfg.get("use_rslora", False))
    ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights))
    except (OSError, SafetensorError) as e:
        raise AdapterError(f"{weights}: unreadable safetensors file ({e})") from e
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for tname, t in tensors.items():
        m = _PEFT_RE.fullmatch(tname)
        if m is None:
            raise AdapterError(f"{weights}: tensor {tname!r} is not a LoRA matrix of a decoder layer "
                               "(embedding, head and saved modules are not supported)")
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    out: dict[tuple[int, str], ModuleLora] = {}
    for (layer, mod), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights}: module model.layers.{layer}.{mod} lacks lora_{'B' if 'A' in ab else 'A'}")
        full = f"model.layers.{layer}.{mod}"
        r = int(_pattern(ranks, full, r0))
        alpha = float(_pattern(alphas, full, alpha0))
        if ab["A"].dim() != 2 or ab["A"].shape[0] != r:
            raise AdapterError(f"{weights}: module {full}: lora_A has shape {tuple(ab['A'].shape)}, expected [r = {r}, in]")
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        out[(layer, mod)] = ModuleLora(ab["A"].float(), ab["B"].float(), scale)
    return out


def _gguf_modules(path: Path, config: ModelConfig) -> dict[tuple[int, str], ModuleLora]:
    from .gguf_loader import hf_tensor_name, open_gguf, read_tensor, unpermute_qk

    try:
        reader = open_gguf(path)
    except ModelLoadError as e:
        raise AdapterError(str(e)) from e

    def meta(key: str) -> Any:
        field = reader.fields.get(key)
        return None if field is None else field.contents()

    if meta("general.type") != "adapter" or meta("adapter.type") != "lora":
        raise AdapterError(f"{path}: not a LoRA adapter GGUF (general.type = {meta('general.type')!r}, "
                           f"adapter.type = {meta('adapter.type')!r}; expected 'adapter' and 'lora')")
    arch = meta("general.architecture")
    ours = GGUF_ARCHITECTURES.get(arch)
    base = config.architecture
    if ours != base and not (ours == "llama" and base == "mixtral"):
        raise AdapterError(f"{path}: adapter for architecture {arch!r}, but the base model is {base!r} (another base model)")
    alpha = float(meta("adapter.lora.alpha") or 0.0)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for t in reader.tensors:
        m = _GGUF_RE.fullmatch(t.name)
        if m is None:
            raise AdapterError(f"{path}: tensor {t.name!r} is not a LoRA matrix (blk.N.NAME.weight.lora_a/lora_b)")
        try:
            halves.setdefault(m.group(1), {})[m.group(2)] = torch.from_numpy(read_tensor(t))
        except (NotImplementedError, ValueError) as e:
            raise AdapterError(f"{path}: cannot read tensor {t.name} of type {t.tensor_type.name}: {e}") from e
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    out: dict[tuple[int, str], ModuleLora] = {}
    for gname, ab in halves.items():
        hf = hf_tensor_name(gname, config.architecture)
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", hf or "")
        if m is None:
            raise AdapterError(f"{path}: module {gname}: not a projection of a decoder layer")
        if set(ab) != {"a", "b"}:
            raise AdapterError(f"{path}: module {gname} lacks lora_{'b' if 'a' in ab else 'a'}")
        layer, mod = int(m.group(1)), m.group(2)
        a, b = ab["a"], ab["b"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"{path}: module {gname}: lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} "
                               "are not [r, in] and [out, r]")
        n_head = heads.get(mod)
        if n_head is not None and config.architecture in ("llama", "mixtral") and b.shape[0] % (2 * n_head) == 0:
            b = unpermute_qk(b, n_head)  # llama.cpp's RoPE row order, as for the base Q/K weights
        r = a.shape[0]
        out[(layer, mod)] = ModuleLora(a, b, alpha / r if alpha else 1.0)
    return out
