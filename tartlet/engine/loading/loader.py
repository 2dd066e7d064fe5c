"""Load a model (config + weights + tokenizer) from a GGUF file or a Hugging Face folder.

:func:`load_model` picks the loader by the path (:mod:`.gguf_loader`,
:mod:`.hf_loader`); what they return, the weight names and the architecture
tables are in :mod:`.loaded_model` (re-exported here).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tartlet.engine.loading.loaded_model import (
    GGUF_ARCHITECTURES,
    HF_MODEL_TYPES,
    ROUTER_WEIGHTS,
    SUPPORTED_ARCHITECTURES,
    LoadedModel,
    ModelLoadError,
    check_weights,
    expected_weight_names,
    moe_weight_names,
)

if TYPE_CHECKING:
    import torch

#: load_model, and the loaders' shared names, re-exported from .loaded_model
__all__ = ["GGUF_ARCHITECTURES", "HF_MODEL_TYPES", "ROUTER_WEIGHTS", "SUPPORTED_ARCHITECTURES", "LoadedModel",
           "ModelLoadError", "check_weights", "expected_weight_names", "moe_weight_names", "load_model"]

def load_model(
    path: str | Path, dtype: "torch.dtype | None" = None, quantized: bool = False, quantize: str | None = None
) -> LoadedModel:
    """Load a model from a ``.gguf`` file or a Hugging Face folder with ``config.json``.

    Args:
        path: a ``.gguf`` file (any quantization ``gguf.quants`` can
            dequantize) or a folder with ``config.json``, ``*.safetensors``
            and ``tokenizer.json``.
        dtype: dtype of the returned float weights (default ``torch.float32``).
        quantized: keep quantized GGUF matrices in their blocks
            (:class:`~tartlet.engine.loading.quant_formats.QuantWeight`) instead of
            dequantizing them.
        quantize: quantize float matrices at load to this format (a key of
            :data:`~tartlet.engine.loading.quant_formats.QUANTIZE_TYPES`); matrices
            already quantized, and MoE routers (:data:`ROUTER_WEIGHTS`), are
            kept as they are.

    Raises:
        ModelLoadError: missing path, not a GGUF file, truncated or corrupt
            file, unsupported architecture or tokenizer, missing weights.
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path}: folder has no config.json (expected a Hugging Face model folder)")
        from tartlet.engine.loading.hf_loader import load_hf_folder

        loaded = load_hf_folder(path, torch.float32 if quantize else dtype)
    else:
        from tartlet.engine.loading.gguf_loader import load_gguf

        loaded = load_gguf(path, dtype, quantized=quantized or quantize is not None)
    if quantize is not None:
        from tartlet.engine.loading.quant_formats import quantize as quantize_matrix

        for name, w in loaded.weights.items():
            if isinstance(w, torch.Tensor) and w.dim() == 2 and not name.endswith(ROUTER_WEIGHTS):
                try:
                    loaded.weights[name] = quantize_matrix(w, quantize)
                except ValueError as e:
                    raise ModelLoadError(f"{path}: cannot quantize {name}: {e}") from e
    return loaded
