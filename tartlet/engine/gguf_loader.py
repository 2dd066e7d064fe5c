"""Read a GGUF file (llama.cpp's format) into a :class:`LoadedModel`.

Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md. Tensor
names (``blk.N.attn_q.weight`` ...) and metadata keys (``llama.block_count``
...) follow llama.cpp's ``gguf-py/gguf/constants.py``.

Two layout facts matter:

* GGUF lists dimensions fastest-first, i.e. reversed relative to PyTorch: a
  linear weight with ``tensor.shape == [in, out]`` is a ``[out, in]`` matrix.
* llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
  reorders the rows of Q and K of *llama* models for its interleaved RoPE.
  We undo it per head so Hugging Face's ``rotate_half`` RoPE is correct.
  Qwen2 files are not permuted (they use the NeoX RoPE layout).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tartlet.engine.config import ModelConfig
from tartlet.engine.loader import SUPPORTED_ARCHITECTURES, LoadedModel, ModelLoadError, check_weights
from tartlet.engine.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_tensor_name(gguf_name: str) -> str | None:
    """Hugging Face name of a GGUF tensor, or None for tensors we do not use."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation of one head-stacked weight or bias.

    ``convert_hf_to_gguf.py`` does ``w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)``;
    the inverse reshapes to ``[n_head, d/2, 2, ...]`` and swaps axes 1 and 2.

    Args:
        w: ``[n_head * head_dim, in]`` weight or ``[n_head * head_dim]`` bias.
        n_head: query heads for Q, key/value heads for K.
    """
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_head, out // n_head // 2, 2, *rest).transpose(1, 2).reshape(out, *rest)


def _meta(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def open_gguf(path: Path) -> Any:
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped).

    Raises:
        ModelLoadError: the file does not start with the ``GGUF`` magic, is
            truncated, or the reader rejects it.
    """
    import gguf

    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad data
        raise ModelLoadError(f"{path}: corrupt or truncated GGUF file ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(f"{path}: truncated GGUF file (tensor {t.name} ends at byte "
                                 f"{t.data_offset + t.n_bytes}, file has {size})")
    return reader


def config_from_gguf(path: Path, reader: Any, tokenizer: Tokenizer) -> ModelConfig:
    """Build a :class:`ModelConfig` from ``{arch}.*`` metadata and the tensor list.

    Raises:
        ModelLoadError: unsupported architecture, a required key is missing,
            or a RoPE scaling this engine does not implement.
    """
    arch = _meta(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{path}: per-dimension RoPE frequencies (rope_freqs.weight, Llama 3.1 style) "
                             "are not supported")

    def need(key: str) -> Any:
        value = _meta(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden = int(need("embedding_length"))
    n_head = int(need("attention.head_count"))
    emb = tensors.get("token_embd.weight")
    if emb is not None:
        vocab = int(emb.shape[-1])  # GGUF shape is [H, vocab]
    else:
        vocab = int(_meta(reader, f"{arch}.vocab_size", tokenizer.vocab_size))
    head_dim = int(_meta(reader, f"{arch}.attention.key_length", hidden // n_head))

    rope_scaling = None
    kind = _meta(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        rope_scaling = {"rope_type": kind, "factor": float(need("rope.scaling.factor"))}
        orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)

    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=tokenizer.eos_token_ids,
        pad_token_id=tokenizer.pad_token_id,
        name=str(_meta(reader, "general.name") or path.stem),
    )


def read_tensor(tensor: Any) -> np.ndarray:
    """Dequantize one ``gguf.ReaderTensor`` to a float32 array in PyTorch shape (dims reversed)."""
    from gguf.quants import dequantize

    data = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if not data.flags.writeable or not data.flags.c_contiguous:  # F32 tensors are views of the read-only mmap
        data = data.copy()
    return data.reshape([int(d) for d in reversed(tensor.shape)])


def load_gguf(path: Path, dtype: torch.dtype = torch.float32, quantized: bool = False) -> LoadedModel:
    """Load config, tokenizer and weights from a GGUF file.

    Args:
        path: the ``.gguf`` file.
        dtype: dtype of the float weights.
        quantized: keep the matrices of the types in
            :data:`~tartlet.engine.quant_formats.GGUF_TYPES` in their blocks
            (repacked as :class:`~tartlet.engine.quant_formats.QuantWeight`
            for the quantized CPU kernels) instead of dequantizing them; 1-D
            tensors (norms, biases) and other types are dequantized. No float
            copy of a quantized matrix is ever made.

    Tensors are converted one at a time (a float32 tensor, or a repacked
    matrix), un-permuted (Q/K rows of llama), then cast to ``dtype``; the
    file is memory-mapped and released when this returns.

    Raises:
        ModelLoadError: see :func:`open_gguf` and :func:`config_from_gguf`;
            also for a tokenizer type we cannot build and a tensor of a type
            that can be neither kept nor dequantized (the message names the
            tensor and its type).
    """
    from tartlet.engine.quant_formats import GGUF_TYPES, from_gguf

    reader = open_gguf(path)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    config = config_from_gguf(path, reader, tokenizer)
    permuted = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    weights: dict[str, Any] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        if name is None:
            continue
        kind = t.tensor_type.name
        shape = [int(d) for d in reversed(t.shape)]
        try:
            if quantized and len(shape) == 2 and kind in GGUF_TYPES:
                w: Any = from_gguf(t.data, kind, shape[0], shape[1])
            else:
                w = torch.from_numpy(read_tensor(t))
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot load tensor {t.name} of type {kind}: {e}") from e
        if config.architecture == "llama":
            for part, n_head in permuted.items():
                if f".{part}." in name:
                    perm = unpermute_qk(torch.arange(shape[0]), n_head)
                    w = w.index_select(0, perm) if isinstance(w, torch.Tensor) else w.select_rows(perm)
        weights[name] = w.to(dtype).contiguous() if isinstance(w, torch.Tensor) else w
    del reader  # unmaps the file: only the converted tensors stay resident
    weights = check_weights(path, config, weights)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=path)
