"""Write small random Llama-architecture GGUF files in any tensor type.

Quantized tensors get random quant bytes with sane float16 scales (the same
recipe as ``test_quant_kernels.random_gguf``), so a test can build a
``Q4_K_M``-like model without llama.cpp's quantizer. The tokenizer is a
byte-level BPE of 256 single-byte tokens plus ChatML's control tokens and one merge.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from test_quant_kernels import random_gguf

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet (every byte one token) + control tokens."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in cs] + ["ab"]


def family_writer(path, arch: str, config, rope_theta: float) -> tuple[gguf.GGUFWriter, int]:
    """A GGUF writer for a transformers ``config`` as llama.cpp's
    ``convert_hf_to_gguf.py`` starts one: architecture ``arch``, the
    attention/FFN/norm/rope metadata and a byte-level vocabulary
    (:func:`byte_tokens`). Returns it and the head dimension; the caller
    adds its family's keys and tensors, then :func:`close_writer`."""
    c = config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    tokens = byte_tokens()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(rope_theta)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w, hd


def permute_qk(t, n_head: int):
    """Q/K rows reordered as ``convert_hf_to_gguf.py``'s ``LlamaModel.permute`` stores them for ``llama``."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


def close_writer(w: gguf.GGUFWriter) -> None:
    """Write the header, metadata and tensors of ``w`` and close it."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_tiny_llama(path: Path, types: dict[str, str], default: str = "Q4_K", seed: int = 0, arch: str = "llama",
                     qkv_bias: bool = False, tied: bool = False, vocab_multiple: int = 1) -> Path:
    """A 2-layer Llama GGUF (hidden 256, FFN 512, 4 heads, 2 KV heads).

    Args:
        path: file to write.
        types: GGUF type name per tensor-name suffix (``"attn_v"``,
            ``"ffn_down"``, ``"output"``, ``"token_embd"`` ...), e.g. the mix
            of a ``Q4_K_M`` file; norms are always F32.
        default: type of the other matrices.
        arch: ``general.architecture`` (``"qwen2"``: the same layout, Q/K rows
            not permuted, as Qwen2.5 GGUFs are).
        qkv_bias: add F32 ``attn_{q,k,v}.bias`` tensors (Qwen2).
        tied: no ``output.weight``: the head is the token embedding.
        vocab_multiple: pad the vocabulary (260 tokens) with unused
            ``<pad_i>`` tokens to a multiple of this.
    """
    rng = np.random.default_rng(seed)
    tokens = byte_tokens()
    tokens += [f"<pad_{i}>" for i in range(-len(tokens) % vocab_multiple)]
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_token_merges(["a b"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def matrix(name: str, n: int, k: int) -> None:
        t = next((v for s, v in types.items() if name.startswith(s) or f".{s}." in name), default)
        if t == "F32":
            w.add_tensor(name, (rng.standard_normal((n, k)) * 0.02).astype(np.float32))
            return
        # weights of magnitude ~0.05, like a trained model's (larger ones make a random model chaotic)
        raw = random_gguf(t, n, k, seed=int(rng.integers(1 << 30)), scale=0.05).reshape(n, -1)  # [n, row bytes]
        if t == "F16":
            w.add_tensor(name, raw.view(np.float16))
        else:
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[t])

    matrix("token_embd.weight", vocab, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if not tied:
        matrix("output.weight", vocab, HIDDEN)
    hd = HIDDEN // HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        matrix(p + "attn_q.weight", HEADS * hd, HIDDEN)
        matrix(p + "attn_k.weight", KV_HEADS * hd, HIDDEN)
        matrix(p + "attn_v.weight", KV_HEADS * hd, HIDDEN)
        if qkv_bias:
            for x, n in (("q", HEADS * hd), ("k", KV_HEADS * hd), ("v", KV_HEADS * hd)):
                w.add_tensor(f"{p}attn_{x}.bias", (0.5 * rng.standard_normal(n)).astype(np.float32))
        matrix(p + "attn_output.weight", HIDDEN, HEADS * hd)
        matrix(p + "ffn_gate.weight", FFN, HIDDEN)
        matrix(p + "ffn_up.weight", FFN, HIDDEN)
        matrix(p + "ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
