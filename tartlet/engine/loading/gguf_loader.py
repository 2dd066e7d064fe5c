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
  Qwen2/3, Phi-3 and Gemma files are not permuted (they use the NeoX RoPE layout).

Per family (``convert_hf_to_gguf.py`` and ``src/llama-model.cpp`` of llama.cpp):

* Qwen3, Gemma 3: ``attn_q_norm``/``attn_k_norm`` are the QK-norm weights.
* Phi-3: ``attn_qkv`` is HF's fused ``qkv_proj``; ``ffn_up`` is the fused
  ``gate_up_proj`` (no ``ffn_gate``); ``rope_factors_short``/``_long`` are
  LongRoPE's ``short_factor``/``long_factor``.
* Gemma 2/3: ``ffn_norm`` is ``pre_feedforward_layernorm``,
  ``post_attention_norm``/``post_ffw_norm`` the post norms, and every norm
  weight was stored plus one (the converter folds Gemma's ``1 + w``): we
  subtract it again. The sliding-window layer pattern is
  ``attention.sliding_window_pattern`` (a period or one flag per layer) or,
  when absent, llama.cpp's fixed one (every 2nd layer global for Gemma 2,
  every 6th for Gemma 3); sliding layers of Gemma 3 use
  ``rope.freq_base_swa`` (10000 when absent). The attention scale is
  ``key_length ** -0.5`` (llama.cpp's choice except for the 27B models).
* Llama 3.1+: ``rope_freqs`` divides the RoPE frequencies (llama.cpp's
  encoding of ``rope_type = llama3``).
* MoE (Mixtral, written as ``llama`` with ``llama.expert_count``; ``qwen2moe``;
  ``qwen3moe``): a layer with ``ffn_gate_inp`` (the router, ``[E, H]``) is
  sparse; ``ffn_{gate,up,down}_exps`` are 3-D ``[E, out, in]`` tensors (expert
  ``j``'s matrix is rows ``j * out ... (j + 1) * out - 1`` of the flattened
  ``[E * out, in]`` matrix, so a quantized expert is a row range of the
  file's blocks); ``ffn_{gate,up,down}_shexp`` and ``ffn_gate_inp_shexp``
  (``[H]``) are Qwen2-MoE's shared expert and its sigmoid gate. Metadata:
  ``expert_count``, ``expert_used_count``; expert widths come from the
  tensors' shapes. Routing weights are renormalised as llama.cpp's graphs do
  (``build_moe_ffn``'s ``norm_w``: true for ``llama`` and ``qwen3moe``, false for
  ``qwen2moe``) unless ``expert_weights_norm`` says otherwise.

Mistral files say ``llama``; llama.cpp's converter does not keep Mistral's
sliding window, so neither can we (it matters only past 4096 tokens).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from tartlet.engine.loading.loaded_model import GGUF_ARCHITECTURES, LoadedModel, ModelLoadError, check_weights
from tartlet.engine.loading.os_memory import drop_mapped_pages
from tartlet.engine.models.config import ModelConfig
from tartlet.engine.models.rope import Rotary
from tartlet.engine.text.tokenizer import Tokenizer

GGUF_MAGIC = b"GGUF"

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    # 3-D [E, out, in]: one matrix per expert j ({} in the name)
    "ffn_gate_exps": "mlp.experts.{}.gate_proj",
    "ffn_up_exps": "mlp.experts.{}.up_proj",
    "ffn_down_exps": "mlp.experts.{}.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


_GEMMA_NAMES = {
    **_BLOCK_NAMES,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_PHI3_NAMES = {**_BLOCK_NAMES, "ffn_up": "mlp.gate_up_proj"}


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """Hugging Face name of a GGUF tensor of architecture ``arch`` (ours,
    e.g. ``"gemma3"``), or None for tensors we do not use. The 3-D expert
    tensors (``ffn_*_exps``) get a name with ``{}`` where the expert's index goes."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_NAMES if arch in ("gemma2", "gemma3") else _PHI3_NAMES if arch == "phi3" else _BLOCK_NAMES
    m = _BLOCK_RE.fullmatch(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
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


@functools.cache
def _reader_class() -> Any:
    """``gguf.GGUFReader``, with its one slicing method reading a plain
    ``ndarray`` view of the file instead of the ``np.memmap`` itself.

    Why: the reader builds a numpy view per metadata value (two per
    vocabulary entry and merge), and slicing an ``np.memmap`` runs
    ``memmap.__array_finalize__`` in Python for each: ~2.4 s of a ~4 s load
    of the default model; through a plain view of the same mapping the
    reader takes ~0.7 s. Same bytes, same fields and tensors (the arrays are
    ``ndarray`` views whose base is the memmap, which stays mapped while any
    of them lives, as before). ``_get`` is the reader's private slicing
    method (gguf-py 0.10-0.19); where a gguf version lacks it, the reader is
    used as is, and ``tests/engine/test_loader.py`` compares both readers field by
    field and tensor by tensor.
    """
    import gguf

    base = gguf.GGUFReader
    if not callable(getattr(base, "_get", None)):
        return base

    class Reader(base):  # type: ignore[misc, valid-type]  # gguf is untyped
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return Reader


def open_gguf(path: Path) -> Any:
    """Open ``path`` with ``gguf.GGUFReader`` (memory-mapped; see :func:`_reader_class`).

    Raises:
        ModelLoadError: the file does not start with the ``GGUF`` magic, is
            truncated, or the reader rejects it.
    """
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (first bytes {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        reader = _reader_class()(path)
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
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported architecture {arch!r} "
                             f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    ours = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

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
    orig = _meta(reader, f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_short.weight" in tensors:  # Phi-3 LongRoPE: the factor lists are tensors
        rope_scaling = {"rope_type": "longrope",
                        "short_factor": read_tensor(tensors["rope_factors_short.weight"]).tolist(),
                        "long_factor": read_tensor(tensors["rope_factors_long.weight"]).tolist(),
                        "original_max_position_embeddings": int(orig or _meta(reader, f"{arch}.context_length", 4096))}
        attn = _meta(reader, f"{arch}.rope.scaling.attn_factor")
        if attn is not None:
            rope_scaling["attention_factor"] = float(attn)
    elif "rope_freqs.weight" in tensors:  # Llama 3.1+: llama3 scaling stored as frequency divisors
        rope_scaling = {"rope_type": "freq_factors", "freq_factors": read_tensor(tensors["rope_freqs.weight"]).tolist()}
    elif kind not in (None, "none"):
        rope_scaling = {"rope_type": kind, "factor": float(need("rope.scaling.factor"))}
        if orig is not None:
            rope_scaling["original_max_position_embeddings"] = int(orig)
    n_layer = int(need("block_count"))
    family: dict[str, Any] = dict(qk_norm="blk.0.attn_q_norm.weight" in tensors)
    if ours == "llama" and int(_meta(reader, f"{arch}.expert_count", 0) or 0) > 0:
        ours = "mixtral"  # llama.cpp writes Mixtral as llama with experts
    if ours in ("mixtral", "qwen2_moe", "qwen3_moe"):
        family.update(_moe_config(path, reader, arch, ours, tensors, n_layer))
    window = _meta(reader, f"{arch}.attention.sliding_window")
    if ours in ("gemma2", "gemma3"):
        pattern = _meta(reader, f"{arch}.attention.sliding_window_pattern", 2 if ours == "gemma2" else 6)
        if isinstance(pattern, list):  # per layer, True = sliding
            slides = [bool(x) for x in pattern]
        else:  # llama.cpp's set_swa_pattern(n): every n-th layer is global
            slides = [(i + 1) % int(pattern) != 0 for i in range(n_layer)]
        family.update(
            gemma_norms=True, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=float(head_dim),
            attn_logit_softcapping=_meta(reader, f"{arch}.attn_logit_softcapping"),
            final_logit_softcapping=_meta(reader, f"{arch}.final_logit_softcapping"),
            layer_types=tuple("sliding_attention" if x else "full_attention" for x in slides),
        )
        if ours == "gemma3":
            family["rope_local_theta"] = float(_meta(reader, f"{arch}.rope.freq_base_swa", 10000.0))
    if window:
        family["sliding_window"] = int(window)
    else:
        family.pop("layer_types", None)

    config = ModelConfig(
        architecture=ours,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length") if not family.get("num_experts")
                              else _meta(reader, f"{arch}.feed_forward_length", 0)),
        num_hidden_layers=n_layer,
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
        **family,
    )
    try:
        Rotary(config.head_dim, config.rope_theta, config.rope_scaling, config.max_position_embeddings)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e
    return config


def _moe_config(path: Path, reader: Any, arch: str, ours: str, tensors: dict[str, Any], n_layer: int) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig` from ``{arch}.expert_*`` metadata and the tensor list.

    Raises:
        ModelLoadError: no expert count, a gating function or weight scale
            other than llama.cpp's softmax / 1, or an expert tensor missing.
    """
    experts = int(_meta(reader, f"{arch}.expert_count", 0) or 0)
    used = int(_meta(reader, f"{arch}.expert_used_count", 0) or 0)
    if experts <= 0 or not 1 <= used <= experts:
        raise ModelLoadError(f"{path}: MoE architecture {arch!r} needs {arch}.expert_count and "
                             f"{arch}.expert_used_count (got {experts} and {used})")
    gating = _meta(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{path}: expert gating function {gating} is not supported (only softmax)")
    scale = _meta(reader, f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise ModelLoadError(f"{path}: expert_weights_scale {scale} is not supported")
    sparse = tuple(i for i in range(n_layer) if f"blk.{i}.ffn_gate_inp.weight" in tensors)
    if not sparse:
        raise ModelLoadError(f"{path}: {arch}.expert_count is {experts} but no layer has ffn_gate_inp")
    first = tensors.get(f"blk.{sparse[0]}.ffn_gate_exps.weight")
    if first is None:
        raise ModelLoadError(f"{path}: layer {sparse[0]} has a router but no ffn_gate_exps tensor")
    norm = _meta(reader, f"{arch}.expert_weights_norm")
    shexp = tensors.get(f"blk.{sparse[0]}.ffn_gate_shexp.weight")
    return dict(
        num_experts=experts, num_experts_per_tok=used,
        moe_intermediate_size=int(first.shape[1]),  # GGUF shape [H, I, E]
        shared_expert_intermediate_size=0 if shexp is None else int(shexp.shape[1]),
        norm_topk_prob=bool(norm) if norm is not None else ours != "qwen2_moe",
        sparse_layers=sparse,
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
            :data:`~tartlet.engine.loading.quant_formats.GGUF_TYPES` in their blocks
            (repacked as :class:`~tartlet.engine.loading.quant_formats.QuantWeight`
            for the quantized CPU kernels) instead of dequantizing them; 1-D
            tensors (norms, biases) and other types are dequantized. No float
            copy of a quantized matrix is ever made.

    Tensors are converted one at a time (a float32 tensor, or a repacked
    matrix), un-permuted (Q/K rows of llama), then cast to ``dtype``; the
    file is memory-mapped, each tensor's pages are unmapped once it is
    converted (:func:`~tartlet.engine.loading.os_memory.drop_mapped_pages`: they
    would count in the RSS until the end) and the file is released when
    this returns.

    Raises:
        ModelLoadError: see :func:`open_gguf` and :func:`config_from_gguf`;
            also for a tokenizer type we cannot build and a tensor of a type
            that can be neither kept nor dequantized (the message names the
            tensor and its type).
    """
    from tartlet.engine.loading.quant_formats import GGUF_TYPES

    repack = _repacker(quantized)
    reader = open_gguf(path)
    try:
        tokenizer = Tokenizer.from_gguf(reader)
    except (NotImplementedError, ValueError) as e:
        raise ModelLoadError(f"{path}: {e}") from e
    config = config_from_gguf(path, reader, tokenizer)
    # The reader holds a numpy view per vocabulary entry and merge (~1.3 KiB
    # each: 390 MiB for Qwen2.5's 151936 tokens and 151387 merges); the
    # tokenizer is built, so let them go before the weights are converted.
    for key in [k for k in reader.fields if k.startswith("tokenizer.ggml.")]:
        del reader.fields[key]
    permuted = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    weights: dict[str, Any] = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name, config.architecture)
        if name is None:
            continue
        kind = t.tensor_type.name
        shape = [int(d) for d in reversed(t.shape)]
        if "{}" in name:  # 3-D expert tensor [E, out, in]: one matrix per expert, no copy
            if len(shape) != 3 or shape[0] != config.num_experts:
                raise ModelLoadError(f"{path}: expert tensor {t.name} has shape {shape}, "
                                     f"expected [{config.num_experts}, out, in]")
            try:
                weights.update(_split_experts(name, t, kind, shape, quantized, dtype, repack))
            except (NotImplementedError, ValueError) as e:
                raise ModelLoadError(f"{path}: cannot load tensor {t.name} of type {kind}: {e}") from e
            drop_mapped_pages(t.data)
            continue
        try:
            if quantized and len(shape) == 2 and kind in GGUF_TYPES:
                w: Any = repack(t.data, kind, shape[0], shape[1])
            else:
                w = torch.from_numpy(read_tensor(t))
        except (NotImplementedError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot load tensor {t.name} of type {kind}: {e}") from e
        drop_mapped_pages(t.data)  # converted: its file pages leave the RSS (os_memory)
        if name.endswith("shared_expert_gate.weight") and isinstance(w, torch.Tensor):
            w = w.reshape(1, -1)  # llama.cpp stores it as [H]; HF as [1, H]
        if config.architecture in ("llama", "mixtral"):
            for part, n_head in permuted.items():
                if f".{part}." in name:
                    perm = unpermute_qk(torch.arange(shape[0]), n_head)
                    w = w.index_select(0, perm) if isinstance(w, torch.Tensor) else w.select_rows(perm)
        if config.gemma_norms and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma norms as 1 + w
        weights[name] = w.to(dtype).contiguous() if isinstance(w, torch.Tensor) else w
    del reader  # unmaps the file: only the converted tensors stay resident
    weights = check_weights(path, config, weights)
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=path)


def _repacker(quantized: bool) -> Callable[[np.ndarray, str, int, int], Any]:
    """The function that repacks a GGUF matrix (``from_gguf``'s arguments):
    the C repacker of the quantized kernels for the block types it reads
    (``QuantKernels.repack_gguf``, the same bytes 2-11x faster), else
    :func:`~tartlet.engine.loading.quant_formats.from_gguf`."""
    from tartlet.engine.loading.quant_formats import from_gguf

    kernels = None
    if quantized:
        from tartlet.engine.kernels import quant_kernels

        kernels = quant_kernels.load()
    if kernels is None:
        return from_gguf
    fast = kernels.repack_gguf

    def repack(data: np.ndarray, kind: str, n: int, k: int) -> Any:
        return fast(data, kind, n, k) if kind in quant_kernels.REPACK_TYPES else from_gguf(data, kind, n, k)

    return repack


def _split_experts(name: str, t: Any, kind: str, shape: list[int], quantized: bool, dtype: torch.dtype,
                   repack: Callable[[np.ndarray, str, int, int], Any]) -> dict[str, Any]:
    """One GGUF 3-D expert tensor ``[E, out, in]`` as ``E`` matrices named ``name.format(j) + ".weight"``.

    Quantized (``quantized`` and ``kind`` in ``GGUF_TYPES``): the tensor is
    repacked once as an ``[E * out, in]`` :class:`QuantWeight` and each expert
    is a view of its ``out`` rows; otherwise dequantized to float and split
    into views. Raises ``ValueError``/``NotImplementedError`` from the repacker.
    """
    from tartlet.engine.loading.quant_formats import GGUF_TYPES, QuantWeight

    E, n, k = shape
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if quantized and kind in GGUF_TYPES:
        q = repack(t.data, kind, E * n, k)
        def rows(x: torch.Tensor | None, j: int) -> torch.Tensor | None:  # views, contiguous
            return None if x is None else x[j * n : (j + 1) * n]

        return {f"{base.format(j)}.weight": QuantWeight(q.kind, (n, k), q.q[j * n : (j + 1) * n], rows(q.d, j), rows(q.m, j), q.source)
                for j in range(E)}
    full = torch.from_numpy(read_tensor(t)).to(dtype)
    return {f"{base.format(j)}.weight": full[j] for j in range(E)}
