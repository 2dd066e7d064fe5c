"""Mixture-of-experts families (issue 14): Mixtral, Qwen2-MoE, Qwen3-MoE.

Each family is a small random-weight transformers model (8 experts, top-2;
Qwen2-MoE with its shared expert; dense and sparse layers mixed through
``mlp_only_layers`` / ``decoder_sparse_step``) saved to a folder and run through
a whole :class:`Engine` as in ``test_model_families``: a 40-token prompt and
16 cached decode steps give transformers' float32 logits, for a sequence
batched with another, a fork and a prefix-cache hit. The same models written
as GGUF files the way llama.cpp's converter writes them (3-D expert tensors,
F32 or Q8_0) load to the same logits, and Q8_0 experts stay quantized.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tartlet.engine.loading.loader import ModelLoadError, load_model
from test_model_families import DIMS, PROMPT, STEPS, check, reference, run_engine

transformers = pytest.importorskip("transformers")

#: family -> (transformers config class, its arguments beyond DIMS)
MOE = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=96, decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16,
                                         norm_topk_prob=True, decoder_sparse_step=2)),
    "qwen3_moe-unnormed": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=64,
                                                  head_dim=16, norm_topk_prob=False)),
}
#: our architecture name and the layers transformers makes sparse
SPARSE = {"mixtral": ("mixtral", (0, 1, 2)), "qwen2_moe": ("qwen2_moe", (0, 2)), "qwen3_moe": ("qwen3_moe", (1,)),
          "qwen3_moe-unnormed": ("qwen3_moe", (0, 1, 2))}


def make_model(family: str, vocab: int):
    """A random-weight transformers model of ``family`` (norm weights spread around 1)."""
    cls, extra = MOE[family]
    config = getattr(transformers, cls)(vocab_size=vocab, **{**DIMS, **extra})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def save_folder(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    return path


def compare(path, ref, vocab: int, what: str, rtol: float = 2e-5, **engine) -> None:
    """The engine's logits on ``path`` equal ``ref``'s: prompt + decode batched with another sequence, fork, prefix hit."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (PROMPT + STEPS,), generator=g).tolist()
    other = torch.randint(3, vocab, (23 + 9,), generator=g).tolist()
    got = run_engine(path, {"main": (ids[:PROMPT], ids[PROMPT:]), "other": (other[:23], other[23:])}, **engine)
    want = reference(ref, ids)
    check(got["main"], want, f"{what} prompt + decode, batched", rtol)
    check(got["other"], reference(ref, other), f"{what} other sequence of the batch", rtol)
    check(got["fork"], want[PROMPT:], f"{what} fork after the prompt", rtol)
    check(got["cached"], want[PROMPT - 1 :], f"{what} prefix-cache hit", rtol)
    assert got["reused"] == 32  # two full pages of the prompt came from the cache


CASES = [pytest.param(f, True, id=f"{f}-c-kernels") for f in MOE] + [pytest.param("qwen2_moe", False, id="qwen2_moe-pytorch")]


@pytest.mark.parametrize("family,kernels", CASES)
def test_moe_family_matches_transformers(family, kernels, tokenizer, tmp_path):
    """Routing, expert dispatch, shared expert and dense layers give transformers' logits."""
    ref = make_model(family, tokenizer.vocab_size)
    path = save_folder(ref, tokenizer, tmp_path / family)
    config = load_model(path).config
    arch, sparse = SPARSE[family]
    assert (config.architecture, config.sparse_layers) == (arch, sparse)
    assert config.num_experts == MOE[family][1].get("num_experts", MOE[family][1].get("num_local_experts"))
    compare(path, ref, tokenizer.vocab_size, family, cpu_kernels=kernels)


def test_fused_expert_checkpoint_loads(tokenizer, tmp_path):
    """A checkpoint with transformers 5's 3-D expert tensors (``mlp.experts.gate_up_proj``
    ``[E, 2 I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) loads to the same weights."""
    from safetensors.torch import load_file, save_file

    ref = make_model("qwen3_moe-unnormed", tokenizer.vocab_size)
    path = save_folder(ref, tokenizer, tmp_path / "fused")
    per_expert = load_model(path).weights
    flat = load_file(str(path / "model.safetensors"))
    fused = {k: v for k, v in flat.items() if ".experts." not in k}
    for i in range(3):
        p = f"model.layers.{i}.mlp.experts."
        gate_up = [torch.cat([flat[f"{p}{j}.gate_proj.weight"], flat[f"{p}{j}.up_proj.weight"]]) for j in range(6)]
        fused[p + "gate_up_proj"] = torch.stack(gate_up)
        fused[p + "down_proj"] = torch.stack([flat[f"{p}{j}.down_proj.weight"] for j in range(6)])
    save_file(fused, str(path / "model.safetensors"))
    got = load_model(path).weights
    assert got.keys() == per_expert.keys()
    assert all(torch.equal(got[k], per_expert[k]) for k in got)


def test_dispatch_runs_each_chosen_expert_once():
    """Batched dispatch: one call per expert that received rows, over all its rows;
    the result is the per-token sum of HF's MixtralSparseMoeBlock."""
    from tartlet.engine.models.moe import SparseMoe

    torch.manual_seed(0)
    E, H, I, T, k = 6, 16, 8, 11, 2
    w_gu, w_d = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    calls: list[tuple[int, int]] = []

    def proj(e: int, w: torch.Tensor, log: bool):
        def f(x: torch.Tensor) -> torch.Tensor:
            if log:
                calls.append((e, x.shape[0]))
            return x @ w.t()
        return f

    router = torch.randn(E, H)
    moe = SparseMoe(router, [(proj(e, w_gu[e], True), proj(e, w_d[e], False)) for e in range(E)], k, True, F.silu)
    x = torch.randn(T, H)
    out = moe(x)
    weights, chosen = moe.route(x)
    assert sorted(e for e, _ in calls) == sorted(set(chosen.view(-1).tolist()))  # each chosen expert once
    assert sum(n for _, n in calls) == T * k  # ... over exactly the rows routed to it
    want = torch.zeros(T, H)
    for t in range(T):
        for w, e in zip(weights[t], chosen[t]):
            g, u = (x[t] @ w_gu[e].t()).chunk(2)
            want[t] += w * ((F.silu(g) * u) @ w_d[e].t())
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(T))  # renormalised top-k
    with pytest.raises(ValueError, match="top_k"):
        SparseMoe(router, moe.experts, E + 1, True, F.silu)


def test_unknown_architecture_lists_moe_families(tokenizer, tmp_path):
    ref = make_model("mixtral", tokenizer.vocab_size)
    path = save_folder(ref, tokenizer, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'deepseek_v3' \\(supported: .*mixtral, qwen2_moe, qwen3_moe"):
        load_model(path)


# -- GGUF ----------------------------------------------------------------------------------------

GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def write_moe_gguf(family: str, model, path, expert_type: str = "F32") -> None:
    """Write ``model`` as llama.cpp's ``convert_hf_to_gguf.py`` does for MoE
    models: experts stacked into 3-D ``ffn_{gate,up,down}_exps`` (``expert_type``:
    ``"F32"`` or ``"Q8_0"``, quantized with gguf's reference quantizer),
    ``ffn_gate_inp`` router, Qwen2-MoE's ``*_shexp`` and ``ffn_gate_inp_shexp``
    (``[H]``), Q/K rows permuted for ``llama`` (Mixtral)."""
    import gguf.quants as gq

    from tiny_gguf import close_writer, family_writer
    from tiny_gguf import permute_qk as permute

    arch, c = GGUF_ARCH[family], model.config
    w, hd = family_writer(path, arch, c, c.rope_parameters["rope_theta"])
    experts = getattr(c, "num_local_experts", None) or c.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if family != "mixtral":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)

    def experts_tensor(name: str, t: torch.Tensor) -> None:
        if expert_type == "F32":
            w.add_tensor(name, t.contiguous().numpy())
        else:
            raw = gq.quantize(t.contiguous().numpy(), gq.GGMLQuantizationType[expert_type])
            w.add_tensor(name, raw, raw_dtype=gq.GGMLQuantizationType[expert_type])

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
             "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
             "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
    state = {k: v.float() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", state.pop("model.embed_tokens.weight").numpy())
    w.add_tensor("output_norm.weight", state.pop("model.norm.weight").numpy())
    w.add_tensor("output.weight", state.pop("lm_head.weight").numpy())
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        gate_up, down = state.pop(p + "mlp.experts.gate_up_proj", None), state.pop(p + "mlp.experts.down_proj", None)
        if gate_up is not None:  # transformers 5 keeps experts as [E, 2 I, H] and [E, H, I]
            gate, up = gate_up.chunk(2, dim=1)
            experts_tensor(f"blk.{i}.ffn_gate_exps.weight", gate)
            experts_tensor(f"blk.{i}.ffn_up_exps.weight", up)
            experts_tensor(f"blk.{i}.ffn_down_exps.weight", down)
        for name in [k for k in state if k.startswith(p)]:
            t = state.pop(name)
            module, kind = name[len(p):].rsplit(".", 1)  # kind: weight or bias
            out = f"blk.{i}.{names[module]}.{kind}"
            if arch == "llama" and ".attn_q." in out:
                t = permute(t, c.num_attention_heads)
            elif arch == "llama" and ".attn_k." in out:
                t = permute(t, c.num_key_value_heads)
            if out.endswith("ffn_gate_inp_shexp.weight"):
                t = t.reshape(-1)  # llama.cpp: {n_embd}
            w.add_tensor(out, t.contiguous().numpy())
    assert not state, f"tensors not written: {list(state)}"
    close_writer(w)


def gguf_reference(family: str):
    from tiny_gguf import byte_tokens

    vocab = len(byte_tokens())
    return make_model(family, vocab), vocab


@pytest.mark.parametrize("family", list(GGUF_ARCH))
def test_moe_gguf_matches_transformers(family, tmp_path):
    """F32 GGUF files of the three families: metadata and 3-D expert tensors as llama.cpp writes them."""
    ref, vocab = gguf_reference(family)
    path = tmp_path / f"{family}.gguf"
    write_moe_gguf(family, ref, path)
    config = load_model(path).config
    arch, _ = SPARSE[family]
    assert config.architecture == arch
    assert config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.norm_topk_prob == (family != "qwen2_moe")
    # llama.cpp's MoE graphs make every layer sparse; our files keep transformers' dense layers, found by tensor
    assert config.sparse_layers == SPARSE[family][1]
    compare(path, ref, vocab, f"{family} GGUF")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_gguf_q8_experts_stay_quantized(family, tmp_path):
    """Q8_0 experts: each expert is a QuantLinear over its rows of the file's
    3-D tensor (no float copy: resident weights are about the file's size),
    and the logits are those of transformers with the same Q8_0-rounded experts."""
    import gguf.quants as gq

    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.loading.quant_formats import Q8, Q8I
    from tartlet.engine.models.llama import LlamaModel
    from tartlet.engine.models.moe import SparseMoe
    from tartlet.engine.models.quant_linear import QuantLinear

    ref, vocab = gguf_reference(family)
    with torch.no_grad():  # the reference gets the experts exactly as Q8_0 stores them
        for name, p in ref.named_parameters():
            if ".experts." in name:
                raw = gq.quantize(p.numpy(), gq.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gq.dequantize(raw, gq.GGMLQuantizationType.Q8_0)).reshape(p.shape))
    path = tmp_path / f"{family}-q8.gguf"
    write_moe_gguf(family, ref, path, expert_type="Q8_0")
    lm = load_model(path, quantized=True)
    model = LlamaModel(lm.config, dict(lm.weights))
    moe = model.layers[0]["moe"]
    assert isinstance(moe, SparseMoe)
    downs = [down for _, down in moe.experts]
    assert all(isinstance(d, QuantLinear) and d.parts[0].source == "Q8_0" for d in downs)
    if downs[0].parts[0].kind == Q8:  # every expert's down projection is a view of one repacked [E * H, I] tensor
        assert len({d.parts[0].q.untyped_storage().data_ptr() for d in downs}) == 1
    else:  # interleaved at load for the AVX-512 VNNI kernel: a copy per expert (the stacked tensor goes with the loader's dict)
        assert {d.parts[0].kind for d in downs} == {Q8I}
    assert "Q8_0" in model.weight_summary()
    # the experts hold exactly their Q8_0 bytes (34 per 32 weights), nothing in float
    c = lm.config
    for i in c.sparse_layers:
        experts = model.layers[i]["moe"].experts
        assert all(isinstance(p, QuantLinear) for e in experts for p in e)
        assert sum(p.nbytes for e in experts for p in e) == c.num_experts * 3 * c.moe_intermediate_size * c.hidden_size * 34 // 32

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (PROMPT + STEPS,), generator=g).tolist()
    eng = Engine(EngineConfig(model=str(path), kv_cache_mb=8), lm.config, lm.weights, lm.tokenizer)
    try:
        from tartlet.engine.core.requests import ForwardRequest
        from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

        seq = eng.new_sequence()
        got = list(eng.scheduler.submit(ForwardRequest(seq, ids[:PROMPT], outputs=[OutputSlot(i, ProbeSpec("logits")) for i in range(PROMPT)]))
                   .result(timeout=120))
        for t in ids[PROMPT:]:
            got += eng.scheduler.submit(ForwardRequest(seq, [t], outputs=[OutputSlot(0, ProbeSpec("logits"))])).result(timeout=60)
    finally:
        eng.close()
    # activations meet the quantized experts as 16-bit blocks (quant_linear.py): close, not float32-exact
    check(torch.tensor(got), reference(ref, ids), f"{family} Q8_0 experts", rtol=2e-3)


def test_quantize_at_load_keeps_routers_float(tokenizer, tmp_path):
    """``--quantize q8_0`` on an HF MoE folder quantizes the experts and the
    shared expert but leaves the routers in float (llama.cpp keeps ``ffn_gate_inp`` so)."""
    from tartlet.engine.loading.quant_formats import QuantWeight
    from tartlet.engine.models.llama import LlamaModel
    from tartlet.engine.models.quant_linear import QuantLinear

    path = save_folder(make_model("qwen2_moe", tokenizer.vocab_size), tokenizer, tmp_path / "q")
    lm = load_model(path, quantize="q8_0")
    router, shared_gate = lm.weights["model.layers.0.mlp.gate.weight"], lm.weights["model.layers.0.mlp.shared_expert_gate.weight"]
    assert isinstance(router, torch.Tensor) and isinstance(shared_gate, torch.Tensor)
    assert isinstance(lm.weights["model.layers.0.mlp.experts.7.down_proj.weight"], QuantWeight)
    moe = LlamaModel(lm.config, lm.weights).layers[0]["moe"]
    assert moe.router.dtype == torch.float32 and moe.router.shape == (8, 64)
    assert all(isinstance(p, QuantLinear) for e in moe.experts for p in e)
    assert isinstance(moe.shared[0], QuantLinear) and moe.shared[2].shape == (1, 64)
