"""The attention-score probe through the SDK and the host API
(``Context.forward(outputs=[..., forward.attention_scores(...)])``), natively
and in a WASM component: the result in its place among the outputs, its
shapes, the checks of bad probes, and the same numbers in both runtimes.
The values themselves are checked against a float64 reference in
tests/engine/test_attention_probe.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from harness import run_ok
from tartlet.runtime.program import load_program

SOURCE = textwrap.dedent('''
    """Attention probe inferlet for tests/sdk/test_attention_probe_api.py."""
    from tartlet import Model, Sampler, forward
    from tartlet.attention_probe import AttentionScores


    def dump(s):
        assert isinstance(s, AttentionScores), type(s)
        return {"layers": s.layers, "reduce": s.reduce, "per": s.per, "kv_heads": s.kv_heads, "scores": s.scores,
                "n": len(s), "total": s.total(), "last": s.layer(s.layers[-1])}


    async def main(args):
        model = Model.load()
        out = {"errors": {}}
        with model.new_context() as ctx:
            toks = model.tokenize(args["prompt"])
            probe = forward.attention_scores([0, -1])
            scores, tok = await ctx.forward(toks, outputs=[probe, forward.sample(len(toks) - 1, Sampler.greedy())])
            out["prefill"], out["tok"] = dump(scores), tok
            tok2, scores2 = await ctx.forward([tok], outputs=[
                forward.sample(0, Sampler.greedy()),
                forward.attention_scores(None, reduce="max", per="page", per_kv_head=True)])
            out["decode"], out["tok2"] = dump(scores2), tok2
            (scores3,) = await ctx.forward([tok2], outputs=[forward.AttentionProbe(layers=[3])])
            out["alone"] = dump(scores3)
            bad = {
                "reduce": forward.attention_scores(reduce="mean"),
                "per": forward.attention_scores(per="sequence"),
                "layer": forward.attention_scores([99]),
                "twice": forward.attention_scores([1, -29]),
                "layers_type": forward.AttentionProbe(layers="0"),
                "per_kv_head": forward.AttentionProbe(per_kv_head=1),
            }
            for name, p in bad.items():
                try:
                    await ctx.forward([5], outputs=[p])
                    out["errors"][name] = None
                except Exception as e:
                    out["errors"][name] = f"{type(e).__name__}: {e}"
            try:
                await ctx.forward([5], outputs=[forward.attention_scores(), forward.attention_scores()])
            except Exception as e:
                out["errors"]["two"] = f"{type(e).__name__}: {e}"
            out["kv_len"] = ctx.kv_len
        return out
''')

PROMPT = {"prompt": "The capital of France is Paris. The capital of Germany is"}


@pytest.fixture(scope="module")
def probe_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("attention-probe")
    (d / "main.py").write_text(SOURCE)
    (d / "inferlet.toml").write_text('name = "attention-probe-test"\nversion = "0.1.0"\nentry = "main.py"\n')
    return d


def check_result(out: dict, engine) -> None:
    c = engine.config
    nh, nkv, n_layers, ps = c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers, engine.pool.page_size
    n = len(engine.tokenizer.encode(PROMPT["prompt"]))
    pre = out["prefill"]
    assert pre["layers"] == [0, n_layers - 1] and pre["kv_heads"] == 1 and pre["per"] == "token" and pre["n"] == n
    for rows in pre["scores"]:  # every query's weights sum to 1 in each head
        assert sum(rows[0]) == pytest.approx(n * nh, rel=1e-5)
    assert pre["last"] == pre["scores"][1][0]
    assert pre["total"] == pytest.approx([a + b for a, b in zip(pre["scores"][0][0], pre["scores"][1][0])], rel=1e-6)
    dec = out["decode"]
    assert dec["layers"] == list(range(n_layers)) and dec["kv_heads"] == nkv and dec["n"] == -(-(n + 1) // ps)
    assert all(0 < max(row) <= 1 for rows in dec["scores"] for row in rows)  # a max of weights
    assert out["alone"]["layers"] == [3] and out["alone"]["n"] == n + 2
    errs = out["errors"]
    assert errs["reduce"] == "SamplingError: attention probe reduce must be one of sum, max, got 'mean'"
    assert errs["per"] == "SamplingError: attention probe per must be one of token, page, got 'sequence'"
    assert errs["layer"].startswith("SamplingError: attention probe layer 99 is outside the model's 30 layers")
    assert errs["twice"] == "SamplingError: attention probe layer -29 is named twice"
    assert errs["layers_type"].startswith("SamplingError: attention probe layers must be a non-empty list of ints")
    assert errs["per_kv_head"] == "SamplingError: attention probe per_kv_head must be a bool, got 1"
    assert errs["two"] == "ValueError: forward takes at most one attention probe"
    assert out["kv_len"] == n + 2  # the refused passes queued nothing


async def test_native_inferlet(runtime, probe_dir, engine):
    out = await run_ok(runtime, load_program(probe_dir), PROMPT)
    check_result(out, engine)


@pytest.mark.slow
@pytest.mark.wasm
async def test_wasm_gives_the_native_result(runtime, probe_dir, engine, host_state):
    """The same inferlet built into a component: the same tokens, scores
    (float32 values: the WIT carries f32) and error messages."""
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from harness import assert_no_leaks
    from tartlet.runtime.builder import build
    from tartlet.runtime.wasm import WasmLimits, WasmRuntime

    native = await run_ok(runtime, load_program(probe_dir), PROMPT)
    wasm = WasmRuntime(host_state, limits=WasmLimits(memory_mb=256, cpu_time_s=60))
    sandboxed = await run_ok(wasm, build(probe_dir), PROMPT)
    check_result(sandboxed, engine)
    assert json.dumps(sandboxed, sort_keys=True) == json.dumps(native, sort_keys=True)
    assert_no_leaks(host_state)


def test_host_api_checks_the_probe(host_state, monkeypatch):
    """HostApi.forward refuses a malformed probe before queueing anything,
    and one that would return too many values (the cap lowered here: the
    default model's 30 layers x 3 KV heads x 8192 positions fit)."""
    from tartlet.host import inference_api
    from tartlet.host.api import HostApi
    from tartlet.sdk.attention_probe import AttentionProbe
    from tartlet.sdk.errors import SamplingError

    api = HostApi(host_state, owner="probe-test")
    try:
        h = api.context_new(None)
        with pytest.raises(SamplingError, match="an attention probe is a tartlet.forward.AttentionProbe"):
            api.forward(h, [1, 2], probe={"layers": None})  # type: ignore[arg-type]
        with pytest.raises(SamplingError, match="layer -31 is outside"):
            api.forward(h, [1, 2], probe=AttentionProbe(layers=[-31]))
        assert api.context_len(h) == 0
        monkeypatch.setattr(inference_api, "MAX_PROBE_VALUES", 900)
        with pytest.raises(SamplingError, match="30 layers x 3 rows x 11 tokens, more than 900 values"):
            api.forward(h, [1] * 11, probe=AttentionProbe(per_kv_head=True))
        assert api.context_len(h) == 0
        api.forward(h, [1] * 11, probe=AttentionProbe(per_kv_head=True, per="page")).result(timeout=60)  # 90 values
    finally:
        api.close()


def test_the_c_kernel_checks_its_probe_buffer():
    """``paged_decode_attention``'s ``probe`` must be float32 ``[B, nh, L]``;
    it then holds each head's softmax weights (here: every slot the same key,
    so ``1 / L`` each)."""
    import torch

    from tartlet.engine.kernels import cpu_kernels

    k = cpu_kernels.load()
    if k is None:
        pytest.skip("no C compiler: the kernels are not built")
    q, kp = torch.randn(2, 4, 8), torch.randn(10, 2, 8)
    slots, out = torch.zeros(2, 5, dtype=torch.long), torch.empty(2, 32)
    with pytest.raises(ValueError, match=r"paged_decode_attention: probe must be .*\[2, 4, 5\]"):
        k.paged_decode_attention(q, kp, kp, slots, None, None, 0, out, 0.5, torch.empty(2, 4, 4))
    probe = torch.empty(2, 4, 5)
    k.paged_decode_attention(q, kp, kp, slots, None, None, 0, out, 0.5, probe)
    assert torch.allclose(probe, torch.full_like(probe, 0.2))
