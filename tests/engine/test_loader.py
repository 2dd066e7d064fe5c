"""Loading models: GGUF weights equal transformers' (Q/K un-permuted), HF folders, and clear errors."""

from __future__ import annotations

import json

import gguf
import pytest
import torch

from tartlet.engine.loading.loader import ModelLoadError, expected_weight_names, load_model


def test_config_of_default_model(loaded_model):
    c = loaded_model.config
    assert c.architecture == "llama"
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == 49152
    assert c.rope_theta == 100000.0
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.max_position_embeddings == 8192
    assert c.tie_word_embeddings and not c.attention_bias
    assert c.rope_scaling is None
    assert c.bos_token_id == 1 and c.pad_token_id == 2 and c.eos_token_ids[0] == 2


def test_config_matches_transformers(loaded_model, hf_model):
    ours, ref = loaded_model.config, hf_model.config
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings"):
        assert getattr(ours, field) == getattr(ref, field), field
    assert ours.rms_norm_eps == pytest.approx(ref.rms_norm_eps)


def test_weights_equal_transformers(loaded_model, hf_model):
    ref = hf_model.state_dict()
    ours = loaded_model.weights
    assert set(ours) == set(expected_weight_names(loaded_model.config))
    assert set(ours) == set(ref) - {"lm_head.weight"}  # tied: no separate lm_head
    for name, w in ours.items():
        assert w.dtype == torch.float32 and w.shape == ref[name].shape, name
        torch.testing.assert_close(w, ref[name], rtol=0, atol=1e-6, msg=name)


def test_qk_are_unpermuted(loaded_model, hf_model):
    # Guard that the previous test is meaningful: a wrong row order would differ.
    from tartlet.engine.loading.gguf_loader import unpermute_qk

    q = loaded_model.weights["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(unpermute_qk(q, 9), hf_model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file") as e:
        load_model(tmp_path / "nope.gguf")
    assert "nope.gguf" in str(e.value)


def test_truncated_gguf(gguf_path, tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(gguf_path, "rb") as f:
        path.write_bytes(f.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated") as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as e:
        load_model(path)
    assert str(path) in str(e.value)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)


def test_unsupported_gguf_architecture(loaded_model, tmp_path):
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "ab"])
    writer.add_token_merges(["a b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported architecture 'mamba'"):
        load_model(path)


def test_unknown_model_name():
    from tartlet.engine.loading.model_store import DEFAULT_MODEL, resolve

    with pytest.raises(ModelLoadError, match="unknown model 'no-such-model'") as e:
        resolve("no-such-model")
    assert DEFAULT_MODEL in str(e.value)


@pytest.fixture(scope="module")
def qwen2_folder(loaded_model, tmp_path_factory):
    """A randomly initialised 2-layer Qwen2 saved as a HF folder, with the default model's tokenizer."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen2")
    tok = loaded_model.tokenizer
    config = transformers.Qwen2Config(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=1e6, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    tok.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": tok.chat_template}))
    return path, model


def test_qwen2_folder_loads(qwen2_folder):
    path, ref = qwen2_folder
    loaded = load_model(path)
    c = loaded.config
    assert c.architecture == "qwen2" and c.attention_bias and not c.tie_word_embeddings
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        2, 64, 4, 2, 16)
    assert c.rope_theta == 1e6 and c.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps)
    assert c.eos_token_ids[0] == 2 and c.name == path.name
    ref_sd = ref.state_dict()
    assert set(loaded.weights) == set(ref_sd)
    assert "model.layers.1.self_attn.k_proj.bias" in loaded.weights
    for name, w in loaded.weights.items():
        torch.testing.assert_close(w, ref_sd[name], rtol=0, atol=0, msg=name)
    assert loaded.tokenizer.encode("<|im_start|>hi") == [1, loaded.tokenizer.encode("hi")[0]]


def test_dtype_is_applied(qwen2_folder):
    path, ref = qwen2_folder
    loaded = load_model(path, dtype=torch.bfloat16)
    assert {w.dtype for w in loaded.weights.values()} == {torch.bfloat16}
    w = ref.state_dict()["model.embed_tokens.weight"].to(torch.bfloat16)
    assert torch.equal(loaded.weights["model.embed_tokens.weight"], w)


def test_qwen2_folder_without_weights(qwen2_folder, tmp_path):
    path, _ = qwen2_folder
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        load_model(tmp_path)


def test_unsupported_hf_model_type(qwen2_folder, tmp_path):
    path, _ = qwen2_folder
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    (tmp_path / "tokenizer.json").write_bytes((path / "tokenizer.json").read_bytes())
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt_neox'"):
        load_model(tmp_path)


def engine_logits(path, dtype: str, ids: list[int], split: int, cpu_kernels: bool = True, **cfg_kw) -> torch.Tensor:
    """Float32 logits ``[len(ids), vocab]`` of a whole Engine on ``path``: a
    prefill of ``split`` tokens, then one token per forward pass
    (``cfg_kw``: more :class:`EngineConfig` fields)."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

    cfg = EngineConfig(model=str(path), dtype=dtype, cpu_kernels=cpu_kernels, **{"kv_cache_mb": 8, **cfg_kw})
    loaded = load_model(path, dtype=cfg.torch_dtype(), quantized=cfg.keeps_quantized())
    eng = Engine(cfg, loaded.config, loaded.weights, loaded.tokenizer)
    try:
        seq = eng.new_sequence()
        chunks = [ids[:split]] + [[t] for t in ids[split:]]
        rows = []
        for chunk in chunks:
            slots = [OutputSlot(i, ProbeSpec("logits")) for i in range(len(chunk))]
            rows += eng.scheduler.submit(ForwardRequest(seq, chunk, outputs=slots)).result(timeout=60)
        return torch.tensor(rows)
    finally:
        eng.close()


@pytest.mark.parametrize("dtype,rtol,kernels", [("float32", 1e-5, True), ("float32", 1e-5, False), ("bfloat16", 2e-2, False)])
def test_qwen2_logits_match_transformers(qwen2_folder, dtype, rtol, kernels):
    """QKV bias and an untied output head through our decoder (prefill, then
    decode through the paged KV cache) against transformers in float32."""
    path, ref = qwen2_folder
    ids = list(range(3, 40))
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0].float()
    got = engine_logits(path, dtype, ids, split=20, cpu_kernels=kernels)
    diff, scale = float((got - want).abs().max()), float(want.abs().max())
    print(f"qwen2 {dtype} (fused CPU kernels: {kernels}): max abs logit diff vs transformers float32 {diff:.2e} (largest logit {scale:.2f})")
    assert diff <= rtol * scale


def test_gguf_reader_reads_what_gguf_py_reads(gguf_path, tmp_path):
    """The loader's reader (``gguf.GGUFReader`` slicing a plain view of the
    mapping, ~3x faster on the default model's vocabulary) gives the same
    fields (names, types, every part's bytes) and tensors (names, types,
    shapes, bytes) as gguf-py's own, on the default model and on a tiny
    GGUF of many formats."""
    import gguf
    import numpy as np

    from tartlet.engine.loading.gguf_loader import _reader_class
    from tiny_gguf import write_tiny_llama

    fast = _reader_class()
    assert fast is not gguf.GGUFReader, "gguf-py no longer has GGUFReader._get: the plain reader is used"
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", {"attn_q": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q8_0", "output": "F16"})
    for path in (gguf_path, tiny):
        want, got = gguf.GGUFReader(path), fast(path)
        assert list(got.fields) == list(want.fields)
        for name, f in want.fields.items():
            g = got.fields[name]
            assert (g.types, g.data, g.offset) == (f.types, f.data, f.offset), name
            assert len(g.parts) == len(f.parts) and all(np.array_equal(a, b) for a, b in zip(g.parts, f.parts)), name
        assert [(t.name, t.tensor_type, tuple(t.shape), t.data_offset) for t in got.tensors] == \
            [(t.name, t.tensor_type, tuple(t.shape), t.data_offset) for t in want.tensors]
        assert all(np.array_equal(a.data, b.data) for a, b in zip(got.tensors, want.tensors))
