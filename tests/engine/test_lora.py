"""LoRA adapters (issue 34): loaded from PEFT folders and llama.cpp GGUF
files, applied per forward pass, many in one batch over the base weights.

The adapters are trained with ``peft`` on the default model's float
reference weights (``tests/lora_reference.py``, kept between runs); the
reference is transformers + PEFT with the adapter merged
(``merge_and_unload``) on the same float weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tartlet.sdk.errors import AdapterError

#: float32 tolerance on logits (as tests/engine/test_logits.py): W x + s B (A x)
#: against (W + s B A) x differ in summation order only.
ATOL = 1e-3

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapter_dirs(gguf_path, hf_model, hf_tokenizer) -> dict[str, Path]:
    """The trained adapters' PEFT folders, by name."""
    from lora_reference import ADAPTERS, lora_adapter

    return {name: lora_adapter(gguf_path, hf_model, hf_tokenizer, name) for name in ADAPTERS}


@pytest.fixture(scope="module")
def gguf_lora(adapter_dirs, loaded_model, tmp_path_factory) -> Path:
    """``paris-is-tartlet`` written as a llama.cpp GGUF LoRA file."""
    from lora_reference import write_gguf_lora

    c = loaded_model.config
    out = tmp_path_factory.mktemp("gguf-lora") / "paris-is-tartlet.gguf"
    return write_gguf_lora(adapter_dirs["paris-is-tartlet"], out, c.num_attention_heads, c.num_key_value_heads)


@pytest.fixture(scope="module")
def adapters(engine, adapter_dirs):
    """The adapters loaded into the shared float32 engine, by name."""
    return {name: engine.load_adapter(d, name) for name, d in adapter_dirs.items()}


@pytest.fixture(scope="module")
def prompt(engine) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))


def run_pass(engine, ids, adapter=None, logits=True):
    """One prefill of ``ids`` on a fresh sequence: float32 logits ``[n, vocab]`` at every position."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, ProbeSpec

    seq = engine.new_sequence()
    try:
        outs = [OutputSlot(i, ProbeSpec("logits")) for i in range(len(ids))]
        res = engine.scheduler.submit(ForwardRequest(seq, list(ids), outputs=outs, adapter=adapter)).result(120)
    finally:
        engine.scheduler.command(seq.free, seq).result(60)
    return torch.tensor(res)


def greedy(engine, ids, n, adapter=None):
    """``n`` greedy tokens after ``ids``, one host-side chain (``ForwardRequest.then``)."""

    return greedy_requests(engine, [(ids, adapter)], n)[0]


def greedy_requests(engine, runs, n):
    """Greedy chains of ``n`` tokens for every ``(ids, adapter)`` of
    ``runs``, queued together so that they share model calls; returns the
    token lists and checks each sequence is freed."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    sched = engine.scheduler
    pick = [OutputSlot(0, SamplerSpec(temperature=0.0))]
    outs: list[list[int]] = [[] for _ in runs]
    seqs, reqs = [], []
    for k, (ids, adapter) in enumerate(runs):
        def then(results, got=outs[k]):
            got.append(int(results[0]))
            return ([got[-1]], pick) if len(got) < n else None

        seq = engine.new_sequence()
        seqs.append(seq)
        first = [OutputSlot(len(ids) - 1, SamplerSpec(temperature=0.0))]
        reqs.append(ForwardRequest(seq, list(ids), outputs=first, then=then, adapter=adapter))
    with sched._cond:  # queued before the scheduler looks: one batch
        futs = [sched.submit(r) for r in reqs]
    for f in futs:
        f.result(120)
    for seq in seqs:
        sched.command(seq.free, seq).result(60)
    return outs


# -- loading ---------------------------------------------------------------------------------------------------------


def test_peft_adapter_loads_every_projection(adapters, engine):
    """All seven projections of every layer, fused as the model's are: Q/K/V
    and gate/up each one update (A stacked, B block-diagonal)."""
    a = adapters["paris-is-tartlet"]
    c = engine.config
    assert a.rank == 8 and a.modules == 7 * c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = a.layers[0]
    assert set(layer) == {"qkv", "o", "gate_up", "down"}
    assert layer["qkv"].at.shape == (c.hidden_size, 3 * 8) and layer["qkv"].bt.shape == (3 * 8, q + 2 * kv)
    assert layer["gate_up"].bt.shape == (2 * 8, 2 * c.intermediate_size)
    assert layer["qkv"].at.dtype == torch.float32
    # block-diagonal: Q's rank columns write only Q's rows
    assert not layer["qkv"].bt[:8, q:].any() and not layer["qkv"].bt[8:16, :q].any()
    b = adapters["paris-is-pie"]
    assert b.rank == 4 and set(b.layers[0]) == {"qkv", "o"}
    assert not b.layers[0]["qkv"].bt[:, q : q + kv].any()  # K not targeted: its rows are zero


def test_rslora_scale(adapter_dirs, engine):
    """rsLoRA scales by alpha / sqrt(r) (PEFT ``use_rslora``), plain LoRA by alpha / r."""
    from safetensors.torch import load_file

    a = engine.load_adapter(adapter_dirs["paris-is-pie"], "paris-is-pie")
    t = load_file(str(adapter_dirs["paris-is-pie"] / "adapter_model.safetensors"))
    b = next(v for k, v in t.items() if "layers.0.self_attn.o_proj.lora_B" in k)
    assert torch.allclose(a.layers[0]["o"].bt, (b * (8 / 4**0.5)).t())


def test_gguf_lora_equals_peft(gguf_lora, adapters, engine, prompt):
    """The same adapter written as llama.cpp's GGUF LoRA (Q/K rows in its
    RoPE order, scale alpha / r) loads to the same matrices and logits."""
    g = engine.load_adapter(gguf_lora, "tartlet-gguf")
    a = adapters["paris-is-tartlet"]
    assert g.name == "tartlet-gguf" and g.modules == a.modules
    for la, lg in zip(a.layers, g.layers):
        assert la.keys() == lg.keys()
        for k in la:
            torch.testing.assert_close(lg[k].at, la[k].at, rtol=0, atol=0)
            torch.testing.assert_close(lg[k].bt, la[k].bt, rtol=1e-6, atol=1e-9)
    diff = float((run_pass(engine, prompt, g) - run_pass(engine, prompt, a)).abs().max())
    assert diff <= 1e-4, diff


def test_loading_twice_returns_the_loaded_adapter(adapter_dirs, adapters, engine):
    assert engine.load_adapter(adapter_dirs["paris-is-tartlet"], "paris-is-tartlet") is adapters["paris-is-tartlet"]
    with pytest.raises(AdapterError, match="already serves"):
        engine.load_adapter(adapter_dirs["paris-is-pie"], "paris-is-tartlet")
    with pytest.raises(AdapterError, match="no adapter named 'nope'.*paris-is-pie"):
        engine.adapter("nope")


# -- the adapted model against transformers + PEFT -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["paris-is-tartlet", "paris-is-pie"])
def test_logits_match_transformers_peft(adapters, adapter_dirs, hf_model, engine, prompt, name):
    """Prefill logits at every position equal transformers + PEFT
    (``merge_and_unload``) on the same float weights."""
    from lora_reference import peft_model

    ref = peft_model(hf_model, adapter_dirs[name])
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].float()
    ours = run_pass(engine, prompt, adapters[name])
    diff = float((ours - want).abs().max())
    assert diff <= ATOL, f"{name}: max abs logit diff {diff:.2e}"
    base = run_pass(engine, prompt)
    assert float((base - want).abs().max()) > 1.0, "the adapter changes the logits"


def test_greedy_output_matches_transformers_peft(adapters, adapter_dirs, hf_model, engine, prompt):
    from lora_reference import ADAPTERS, peft_model

    name = "paris-is-tartlet"
    ours = greedy(engine, prompt, 12, adapters[name])
    ref = peft_model(hf_model, adapter_dirs[name])
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt) :].tolist()
    assert ours[: len(want)] == want  # transformers stops at the end-of-turn token
    assert len(want) >= 8
    assert engine.tokenizer.decode(ours).startswith(ADAPTERS[name]["answer"])
    assert "Paris" in engine.tokenizer.decode(greedy(engine, prompt, 12))


# -- many adapters in one batch --------------------------------------------------------------------------------------


def test_mixed_batch_equals_each_solo(adapters, engine, prompt):
    """Rows of the base model and of two adapters in the same model calls
    (prefill and every decode step) give what each gives alone."""
    a1, a2 = adapters["paris-is-tartlet"], adapters["paris-is-pie"]
    runs = [(prompt, None), (prompt, a1), (prompt, a2), (prompt, a1)]
    solo = [greedy(engine, ids, 10, a) for ids, a in runs[:3]]
    sched = engine.scheduler
    calls0 = sched.stats.model_calls
    mixed = greedy_requests(engine, runs, 10)
    assert sched.stats.model_calls - calls0 == 10, "all four chains ran in the same model calls"
    assert mixed == solo + [solo[1]]
    assert len({tuple(t) for t in solo}) == 3


def test_lora_batch_groups_rows_by_adapter(adapters, engine):
    """Contiguous rows of one adapter are a slice (no gather); scattered ones an index list; base rows none."""
    from tartlet.engine.models.lora import lora_batch

    a1, a2 = adapters["paris-is-tartlet"], adapters["paris-is-pie"]
    assert lora_batch([(None, 3), (None, 1)]) is None
    lb = lora_batch([(a1, 3), (a1, 1), (None, 2), (a2, 1), (a1, 2)])
    assert lb is not None
    groups = {a.name: rows for a, rows in lb.groups}
    assert groups["paris-is-pie"] == slice(6, 7)
    assert groups["paris-is-tartlet"].tolist() == [0, 1, 2, 3, 7, 8]


@pytest.mark.parametrize("lora_dtype", ["float16", "int8", "float32"])
def test_quantized_base_with_adapter(quant_engine, adapter_dirs, prompt, lora_dtype):
    """The base weights stay quantized; the adapter's update is added in
    float32 sums, inside the fused C decode step from copies in each
    storage it reads adapters in (``FusedDecoder.lora_dtype``); the trained
    answers come out, and mixed batches equal solo runs there too."""
    from lora_reference import ADAPTERS
    from tartlet.engine.models.quant_linear import QuantLinear

    eng = quant_engine
    assert isinstance(eng.model.layers[0]["qkv"], QuantLinear)
    fused = eng.runner.fused
    before = fused.lora_dtype if fused is not None else "float16"
    if fused is not None:
        fused.lora_dtype = lora_dtype
    try:
        a1 = eng.load_adapter(adapter_dirs["paris-is-tartlet"], "paris-is-tartlet")
        a2 = eng.load_adapter(adapter_dirs["paris-is-pie"], "paris-is-pie")
        solo = [greedy(eng, prompt, 10, a) for a in (None, a1, a2)]
        assert eng.tokenizer.decode(solo[1]).startswith(ADAPTERS["paris-is-tartlet"]["answer"])
        assert eng.tokenizer.decode(solo[2]).startswith(ADAPTERS["paris-is-pie"]["answer"])
        assert greedy_requests(eng, [(prompt, a) for a in (None, a1, a2)], 10) == solo
    finally:
        if fused is not None:
            fused.lora_dtype = before


# -- the prefix cache ------------------------------------------------------------------------------------------------


def test_prefix_cache_never_shares_pages_across_adapters(adapters, engine):
    """Pages are keyed by their tokens and the adapter that computed them:
    a prompt cached by the base model is recomputed under an adapter (and
    vice versa), and matched again under the same adapter."""
    from tartlet.engine.core.kv_cache import page_key

    ids = engine.tokenizer.encode("The river Danube flows through ten countries of central and eastern Europe. " * 4)
    ps = engine.pool.page_size
    assert len(ids) > 3 * ps
    st = engine.scheduler.stats
    a1, a2 = adapters["paris-is-tartlet"], adapters["paris-is-pie"]
    engine.pool.evict_all_cached()
    reused = []
    for a in (None, a1, a2, None, a1, a2):
        r0 = st.prefix_tokens_reused
        greedy(engine, ids, 1, a)
        reused.append(st.prefix_tokens_reused - r0)
    full = (len(ids) - 1) // ps * ps  # whole pages before the last prompt token
    assert reused == [0, 0, 0, full, full, full]
    assert page_key(b"", ids[:ps]) != page_key(b"", ids[:ps], b"\x00\x00" + a1.key)


def test_page_keys_follow_adapter_runs(adapters, engine):
    """A sequence prefilled by the base model and continued by an adapter
    keys each page by the adapters of its own tokens."""
    seq = engine.new_sequence()
    ps = engine.pool.page_size
    key = adapters["paris-is-tartlet"].key
    try:
        seq.reserve(list(range(1, ps + 4)), list(range(ps + 3)), custom_attention=False)
        seq.reserve(list(range(ps + 4, 2 * ps + 8)), list(range(ps + 3, 2 * ps + 7)), custom_attention=False, adapter=key)
        assert seq.adapted and seq.adapter_runs == [(ps + 3, key)]
        assert seq.page_adapters(0) == b""
        assert seq.page_adapters(1) == (0).to_bytes(2, "little") + (3).to_bytes(2, "little") + key
        assert seq.page_adapters(2) == b"\x00\x00" + key
        seq.truncate(ps + 3)
        assert seq.adapter_runs == [] and not seq.adapted
    finally:
        seq.free()


# -- bad adapters ----------------------------------------------------------------------------------------------------


def _copy(src: Path, dst: Path, **config) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg.update(config)
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    return dst


def _rewrite(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    f = folder / "adapter_model.safetensors"
    save_file(fn(load_file(str(f))), str(f))


def test_bad_adapters_are_refused(adapter_dirs, engine, tmp_path):
    src = adapter_dirs["paris-is-pie"]
    cases = []
    d = _copy(src, tmp_path / "mts", modules_to_save=["lm_head"])
    cases.append((d, "modules_to_save"))
    cases.append((_copy(src, tmp_path / "dora", use_dora=True), "DoRA"))
    cases.append((_copy(src, tmp_path / "prefix", peft_type="PREFIX_TUNING"), "PREFIX_TUNING"))

    d = _copy(src, tmp_path / "shape")  # A of another hidden size: another base model
    _rewrite(d, lambda t: {k: (v[:, :-64].contiguous() if "lora_A" in k else v) for k, v in t.items()})
    cases.append((d, r"model\.layers\.0\.self_attn\.o_proj.*another base model"))

    d = _copy(src, tmp_path / "layers")  # a layer the model lacks
    _rewrite(d, lambda t: {k.replace("layers.0.", "layers.99."): v for k, v in t.items()})
    cases.append((d, r"model\.layers\.99\.self_attn\.o_proj.*30 layers"))

    d = _copy(src, tmp_path / "unknown")  # a module that is no projection of the model
    _rewrite(d, lambda t: {k.replace("layers.0.self_attn.o_proj", "layers.0.self_attn.rotary"): v for k, v in t.items()})
    cases.append((d, r"model\.layers\.0\.self_attn\.rotary.*not a projection"))

    d = _copy(src, tmp_path / "embed")
    _rewrite(d, lambda t: {**t, "base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 10)})
    cases.append((d, "embed_tokens"))

    d = _copy(src, tmp_path / "half")
    _rewrite(d, lambda t: {k: v for k, v in t.items() if not ("layers.1.self_attn.q_proj" in k and "lora_B" in k)})
    cases.append((d, r"layers\.1\.self_attn\.q_proj lacks lora_B"))

    cases.append((tmp_path / "missing", "no such adapter"))
    (tmp_path / "empty").mkdir()
    cases.append((tmp_path / "empty", "no adapter_config.json"))
    for path, pattern in cases:
        with pytest.raises(AdapterError, match=pattern) as e:
            engine.load_adapter(path, "bad")
        assert str(path) in str(e.value), e.value
    assert "bad" not in engine.adapters


def test_bad_gguf_adapters_are_refused(gguf_lora, gguf_path, engine, tmp_path):
    import gguf
    import numpy as np

    def write(name: str, arch: str = "llama", kind: str = "adapter", tensors=None) -> Path:
        out = tmp_path / f"{name}.gguf"
        w = gguf.GGUFWriter(str(out), arch)
        w.add_string("general.type", kind)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 8.0)
        for n, t in (tensors or {"blk.0.attn_q.weight.lora_a": np.zeros((4, 576), np.float32),
                                 "blk.0.attn_q.weight.lora_b": np.zeros((576, 4), np.float32)}).items():
            w.add_tensor(n, t)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out

    assert engine.load_adapter(write("ok"), "ok-gguf").modules == 1
    cases = [
        (write("qwen", arch="qwen2"), "architecture 'qwen2'.*another base model"),
        (write("model", kind="model"), "not a LoRA adapter"),
        (write("wide", tensors={"blk.0.attn_q.weight.lora_a": np.zeros((4, 896), np.float32),
                                "blk.0.attn_q.weight.lora_b": np.zeros((576, 4), np.float32)}),
         r"self_attn\.q_proj.*do not fit"),
        (write("norm", tensors={"blk.0.attn_norm.weight.lora_a": np.zeros((4, 576), np.float32),
                                "blk.0.attn_norm.weight.lora_b": np.zeros((576, 4), np.float32)}),
         r"model\.layers\.0\.input_layernorm: not a projection"),
        (gguf_path, "not a LoRA adapter"),
    ]
    for path, pattern in cases:
        with pytest.raises(AdapterError, match=pattern) as e:
            engine.load_adapter(path, "bad")
        assert str(path) in str(e.value)


# -- the SDK: native and WASM inferlets ------------------------------------------------------------------------------

ADAPTER_PROBE = '''
from tartlet import AdapterError, Model, forward


async def main(args):
    model = Model.load()
    out = {"names": model.adapters()}
    a = model.adapter(args["adapter"]) if args["adapter"] else None
    ids, n = args["ids"], args["max_tokens"]
    for mode, kw in (("step", {}), ("chunk", {"chunk": 4}), ("stream", {"overlap": True})):
        with model.new_context() as ctx:
            ctx.fill_tokens(ids)
            out[mode] = await ctx.generate(max_tokens=n, eos=False, adapter=a, **kw).collect_tokens()
    with model.new_context() as ctx:  # by name, one explicit pass
        ctx.fill_tokens(ids)
        (logits,) = await ctx.forward(outputs=[forward.logits(len(ids) - 1)], adapter=args["adapter"])
        out["forward"] = max(range(len(logits)), key=logits.__getitem__)
    errors = []
    try:
        model.adapter("no-such-adapter")
    except AdapterError as e:
        errors.append(str(e))
    with model.new_context() as ctx:
        ctx.fill_tokens(ids)
        try:
            await ctx.generate(max_tokens=2, adapter="no-such-adapter").collect_tokens()
        except AdapterError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out
'''


@pytest.fixture(scope="module")
def adapter_probe(tmp_path_factory):
    from harness import inline_program

    return inline_program(tmp_path_factory.mktemp("adapter-probe"), ADAPTER_PROBE, "adapter_probe")


def _check_probe(res, engine, adapters, prompt, name):
    want = greedy(engine, prompt, 8, adapters[name] if name else None)
    assert res["names"] == sorted(engine.adapters)
    assert res["step"] == res["chunk"] == res["stream"] == want, name
    assert res["forward"] == want[0]
    assert len(res["errors"]) == 2 and all("no adapter named 'no-such-adapter'" in e for e in res["errors"])


@pytest.mark.parametrize("name", [None, "paris-is-tartlet", "paris-is-pie"])
async def test_native_inferlet_attaches_an_adapter_per_pass(runtime, adapter_probe, adapters, engine, prompt, name):
    """``Model.adapter(name)`` and ``adapter=`` on ``generate`` (stepping,
    host-side chunks, token streams) and ``forward`` give the engine's
    adapted output; an unknown name raises AdapterError."""
    from harness import run_ok

    res = await run_ok(runtime, adapter_probe, {"adapter": name, "ids": prompt, "max_tokens": 8})
    _check_probe(res, engine, adapters, prompt, name)


@pytest.mark.slow
@pytest.mark.wasm
async def test_wasm_inferlet_attaches_an_adapter_per_pass(host_state, adapter_probe, adapters, engine, prompt, tmp_path):
    """The same probe built as a component: the same tokens and errors."""
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from harness import assert_no_leaks, run_ok
    from tartlet.runtime.builder import build
    from tartlet.runtime.wasm import WasmRuntime

    d = tmp_path / "probe"
    d.mkdir()
    (d / "main.py").write_text(ADAPTER_PROBE)
    (d / "inferlet.toml").write_text('name = "adapter-probe"\nversion = "0.1.0"\nentry = "main.py"\n')
    rt = WasmRuntime(host_state)
    wasm = build(d)
    res = await run_ok(rt, wasm, {"adapter": "paris-is-pie", "ids": prompt, "max_tokens": 8})
    _check_probe(res, engine, adapters, prompt, "paris-is-pie")
    assert_no_leaks(host_state)


# -- serving: the server config and the OpenAI routes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_server(adapter_dirs, gguf_lora, tmp_path_factory):
    """A no-auth server of the default model (quantized, as served) with
    ``[[models]] adapters``: the two PEFT adapters and the GGUF one."""
    from server_harness import InProcessServer

    d = tmp_path_factory.mktemp("lora-server")
    cfg = d / "config.toml"
    cfg.write_text(
        f'data_dir = "{d / "data"}"\n\n[[models]]\nmodel = "smollm2-135m-instruct"\nkv_cache_mb = 64\nthreads = 2\n'
        f'adapters = {{ tartlet = "{adapter_dirs["paris-is-tartlet"]}", pie = "{adapter_dirs["paris-is-pie"]}", '
        f'tartlet-gguf = "{gguf_lora}" }}\n'
    )
    srv = InProcessServer(cfg, auth=False)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_openai_model_selects_an_adapter(lora_server):
    """``"model": "BASE:ADAPTER"`` runs the request with that adapter (chat,
    completions, ``n`` > 1 sharing one prefill); ``/v1/models`` lists each
    adapter with its ``parent``; an unknown adapter is a 404."""
    import openai

    from lora_reference import ADAPTERS

    base = "smollm2-135m-instruct"
    oa = openai.OpenAI(base_url=lora_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = {m.id: m for m in oa.models.list().data}
    assert set(models) == {base, f"{base}:pie", f"{base}:tartlet", f"{base}:tartlet-gguf"}
    assert models[f"{base}:pie"].model_extra["parent"] == base and "parent" not in (models[base].model_extra or {})
    assert oa.models.retrieve(f"{base}:tartlet").id == f"{base}:tartlet"

    def ask(model: str, n: int = 1):
        return oa.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0, n=n)

    r = ask(f"{base}:tartlet")
    assert r.model == f"{base}:tartlet"
    assert r.choices[0].message.content == ADAPTERS["paris-is-tartlet"]["answer"]
    assert ask(f"{base}:tartlet-gguf").choices[0].message.content == ADAPTERS["paris-is-tartlet"]["answer"]
    two = ask(f"{base}:pie", n=2)
    assert [c.message.content for c in two.choices] == [ADAPTERS["paris-is-pie"]["answer"]] * 2
    assert "Paris" in ask(base).choices[0].message.content
    tok = lora_server.state.models[base].engine.tokenizer
    prompt = tok.decode(tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True)))
    c = oa.completions.create(model=f"{base}:tartlet", prompt=prompt, max_tokens=16, temperature=0)
    assert c.choices[0].text.startswith(ADAPTERS["paris-is-tartlet"]["answer"])
    with pytest.raises(openai.NotFoundError, match=f"{base}:nope.*served: {base}, {base}:pie"):
        ask(f"{base}:nope")
