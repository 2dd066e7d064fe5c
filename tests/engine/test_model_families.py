"""Model families (issue 14): each loads from a Hugging Face folder and its logits equal transformers'.

For every family a small random-weight model is built with transformers
(config + ``AutoModelForCausalLM.from_config``), saved to a temporary folder
with the default model's tokenizer, and run through a whole :class:`Engine`:
a 40-token prompt and 16 cached decode steps must give transformers' float32
logits, for a sequence batched with another one, for a fork taken after the
prompt, and for a sequence whose prompt comes from the prefix cache. Sliding
windows are made short (8 tokens) so that they matter over 40 tokens.
"""

from __future__ import annotations

import json

import pytest
import torch

from tartlet.engine.loading.loader import ModelLoadError, load_model

transformers = pytest.importorskip("transformers")

PROMPT, STEPS = 40, 16
DIMS = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1)

#: family -> (transformers config class, its extra arguments)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=16, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3-tied": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True)),
    "llama3-rope": ("LlamaConfig", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                          high_freq_factor=4.0, original_max_position_embeddings=32),
                                        rope_theta=500000.0)),
    "llama-linear": ("LlamaConfig", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "llama-yarn": ("LlamaConfig", dict(rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=128))),
    "llama-dynamic": ("LlamaConfig", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0))),
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2-sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),
    "phi3": ("Phi3Config", dict(sliding_window=None)),
    "phi3-longrope": ("Phi3Config", dict(
        max_position_embeddings=512, original_max_position_embeddings=64,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + i / 16 for i in range(8)],
                          long_factor=[2.0 + i / 4 for i in range(8)]))),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                         "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 1e6}})),
}


def make_folder(family: str, tokenizer, root) -> tuple:
    """A random-weight model of ``family`` saved as a HF folder; returns ``(path, transformers model)``."""
    cls, extra = FAMILIES[family]
    config = getattr(transformers, cls)(vocab_size=tokenizer.vocab_size, **{**DIMS, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # Gemma norms start at 0 (scale 1 + w): give them, and every other weight, some spread
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    path = root / family
    model.save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": tokenizer.chat_template}))
    return path, model


def reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def run_engine(path, runs: dict, cpu_kernels: bool = True) -> dict:
    """Logits of several sequences on one Engine (float32).

    ``runs`` maps a name to ``(prompt ids, decode ids)``. All prompts are
    prefilled in one batch (every position an output), then a fork of the
    first sequence and a fresh sequence with the first prompt (a prefix-cache
    hit; output only at its last position) join, and all decode their tokens
    one per step, batched together. Returns name -> logits ``[n, vocab]``
    plus ``"fork"`` and ``"cached"`` (logits from the last prompt position on)
    and ``"reused"`` (prefix tokens taken from the cache).
    """
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

    def outs(n: int, first: int = 0) -> list:
        return [OutputSlot(i, ProbeSpec("logits")) for i in range(first, n)]

    cfg = EngineConfig(model=str(path), dtype="float32", kv_cache_mb=8, cpu_kernels=cpu_kernels)
    loaded = load_model(path, dtype=torch.float32)
    eng = Engine(cfg, loaded.config, loaded.weights, loaded.tokenizer)
    try:
        sch = eng.scheduler
        names = list(runs)
        seqs = {n: eng.new_sequence() for n in names}
        futs = {n: sch.submit(ForwardRequest(seqs[n], runs[n][0], outputs=outs(len(runs[n][0])))) for n in names}
        got = {n: list(f.result(timeout=120)) for n, f in futs.items()}
        first = names[0]
        prompt, steps = runs[first]
        seqs["fork"] = sch.command(lambda: seqs[first].fork(), seqs[first]).result(timeout=60)
        got["fork"] = []
        reused0 = sch.stats.prefix_tokens_reused
        seqs["cached"] = eng.new_sequence()
        got["cached"] = list(sch.submit(ForwardRequest(seqs["cached"], prompt, outputs=outs(len(prompt), len(prompt) - 1)))
                             .result(timeout=60))
        reused = sch.stats.prefix_tokens_reused - reused0
        follow = {**{n: runs[n][1] for n in names}, "fork": steps, "cached": steps}
        for k in range(max(len(v) for v in follow.values())):
            futs = {n: sch.submit(ForwardRequest(seqs[n], [toks[k]], outputs=outs(1))) for n, toks in follow.items() if k < len(toks)}
            for n, f in futs.items():
                got[n] += f.result(timeout=60)
        result = {n: torch.tensor(v) for n, v in got.items()}
        result["reused"] = reused
        return result
    finally:
        eng.close()


def check(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 2e-5) -> None:
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    print(f"{what}: max abs logit diff {diff:.2e} (largest logit {scale:.2f})")
    assert got.shape == want.shape, what
    assert diff <= rtol * scale, f"{what}: logits differ by {diff:.3e} (largest {scale:.3f})"


# every family through the fused C kernels; the PyTorch path (no C compiler, CUDA) on a few
CASES = [pytest.param(f, True, id=f"{f}-c-kernels") for f in FAMILIES] + [
    pytest.param(f, False, id=f"{f}-pytorch") for f in ("qwen3", "mistral", "phi3-longrope", "gemma3")]


@pytest.mark.parametrize("family,kernels", CASES)
def test_family_matches_transformers(family, kernels, tokenizer, tmp_path):
    """Prefill, cached decode, batching, fork and prefix-cache hit all give transformers' logits."""
    path, ref = make_folder(family, tokenizer, tmp_path)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, tokenizer.vocab_size, (PROMPT + STEPS,), generator=g).tolist()
    other = torch.randint(3, tokenizer.vocab_size, (23 + 9,), generator=g).tolist()
    twin = torch.randint(3, tokenizer.vocab_size, (PROMPT + 4,), generator=g).tolist()  # as long as main: one attention group
    got = run_engine(path, {"main": (ids[:PROMPT], ids[PROMPT:]), "other": (other[:23], other[23:]),
                            "twin": (twin[:PROMPT], twin[PROMPT:])}, cpu_kernels=kernels)  # fmt: skip
    want = reference(ref, ids)
    check(got["main"], want, f"{family} prompt + decode, batched")
    check(got["other"], reference(ref, other), f"{family} other sequence of the batch")
    check(got["twin"], reference(ref, twin), f"{family} prompt of main's length, sharing its attention group")
    check(got["fork"], want[PROMPT:], f"{family} fork after the prompt")
    check(got["cached"], want[PROMPT - 1 :], f"{family} prefix-cache hit")
    assert got["reused"] == 32  # two full pages of the prompt came from the cache


def test_unsupported_architecture_names_it(tokenizer, tmp_path):
    path, _ = make_folder("qwen3", tokenizer, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'deepseek_v3' \\(supported: llama, mistral, qwen2, qwen3"):
        load_model(path)


def test_partial_rotary_is_refused(tokenizer, tmp_path):
    path, _ = make_folder("phi3", tokenizer, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg.get("rope_parameters", {}), "partial_rotary_factor": 0.75}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="partial rotary"):
        load_model(path)


# -- GGUF files of the same families ------------------------------------------------------------

GGUF_ARCH = {"qwen3": "qwen3", "gemma3": "gemma3", "gemma2": "gemma2", "llama3-rope": "llama", "phi3-longrope": "phi3"}


def write_gguf(family: str, model, path) -> None:
    """Write ``model`` (a transformers model of ``family``) as a float32 GGUF
    the way llama.cpp's ``convert_hf_to_gguf.py`` would: its tensor names and
    metadata keys, Q/K rows permuted for ``llama``, Gemma norms stored as
    ``1 + w``, Llama 3 scaling as ``rope_freqs``, Phi-3's factors as tensors."""
    import gguf
    import numpy as np

    from tiny_gguf import close_writer, family_writer
    from tiny_gguf import permute_qk as permute

    arch, c = GGUF_ARCH[family], model.config
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w, hd = family_writer(path, arch, c, rope["rope_theta"])
    gemma = arch.startswith("gemma")
    if gemma:
        w.add_sliding_window(c.sliding_window)
        if arch == "gemma3":
            w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
        if c.attn_logit_softcapping is not None:
            w.add_attn_logit_softcapping(c.attn_logit_softcapping)
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if family == "llama3-rope":
        base = 1.0 / rope["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
        w.add_tensor("rope_freqs.weight", (base / model.model.rotary_emb.inv_freq).numpy().astype(np.float32))
    if family == "phi3-longrope":
        w.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
        w.add_tensor("rope_factors_short.weight", np.array(c.rope_parameters["short_factor"], np.float32))
        w.add_tensor("rope_factors_long.weight", np.array(c.rope_parameters["long_factor"], np.float32))

    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "self_attn.qkv_proj": "attn_qkv", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"}
    for name, t in model.state_dict().items():
        t = t.float()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if c.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            parts = name.split(".")  # model.layers.{i}.<module...>.weight
            out = f"blk.{parts[2]}.{names['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and ".attn_q." in out:
            t = permute(t, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in out:
            t = permute(t, c.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            t = t + 1
        w.add_tensor(out, t.contiguous().numpy())
    close_writer(w)


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_gguf_family_matches_transformers(family, tmp_path):
    """The same families from GGUF files (metadata keys and tensor names of llama.cpp)."""
    from tiny_gguf import byte_tokens

    cls, extra = FAMILIES[family]
    vocab = len(byte_tokens())
    config = getattr(transformers, cls)(vocab_size=vocab, **{**DIMS, **extra})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, p in ref.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path / f"{family}.gguf"
    write_gguf(family, ref, path)
    assert load_model(path).config.architecture == GGUF_ARCH[family]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (PROMPT + STEPS,), generator=g).tolist()
    other = torch.randint(3, vocab, (32,), generator=g).tolist()
    got = run_engine(path, {"main": (ids[:PROMPT], ids[PROMPT:]), "other": (other[:23], other[23:])})
    want = reference(ref, ids)
    check(got["main"], want, f"{family} GGUF prompt + decode, batched")
    check(got["other"], reference(ref, other), f"{family} GGUF other sequence")
    check(got["fork"], want[PROMPT:], f"{family} GGUF fork")
    check(got["cached"], want[PROMPT - 1 :], f"{family} GGUF prefix-cache hit")
