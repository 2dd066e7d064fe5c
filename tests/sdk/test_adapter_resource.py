"""LoRA adapters as a resource an inferlet changes (issue 34, item 2):
fork, read and set matrices, seeded perturbation, save (PEFT's format,
loadable by ``peft``, served after a restart), drop, per-user namespaces and
quota, and the version a pass in flight runs with.

The adapters are the ones tests/engine/test_lora.py trains (``tests/lora_reference.py``);
the engine is the session's float32 one, each test on a host state of its own.
"""

from __future__ import annotations

import pytest
import torch

from tartlet.sdk.errors import AdapterError, LimitError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def adapter_dirs(gguf_path, hf_model, hf_tokenizer):
    from lora_reference import ADAPTERS, lora_adapter

    return {name: lora_adapter(gguf_path, hf_model, hf_tokenizer, name) for name in ADAPTERS}


@pytest.fixture(scope="module")
def served(engine, adapter_dirs):
    """The trained adapters served by the shared float32 engine."""
    return {name: engine.load_adapter(d, name) for name, d in adapter_dirs.items()}


@pytest.fixture
def state(engine, served, tmp_path):
    """A host state of its own on the shared engine, saving adapters under ``tmp_path``."""
    from tartlet.host.state import HostState

    st = HostState()
    st.add_engine(engine)
    st.configure_adapters(None, tmp_path / "adapters")
    return st


@pytest.fixture
def rt(state):
    from harness import assert_no_leaks
    from tartlet.runtime.native import NativeRuntime

    yield NativeRuntime(state)
    assert_no_leaks(state)
    assert all(used == 0 for used in _fork_usage(state)), "forks still counted after every instance ended"


def _fork_usage(state):
    slot = next(iter(state.models.values()))
    saved = {}
    for (owner, _), ua in slot.adapters._saved.items():
        saved[owner] = saved.get(owner, 0) + ua.weight_bytes
    return [slot.adapters.used(o) - saved.get(o, 0) for o in set(slot.adapters._charged) | set(saved)]


@pytest.fixture(scope="module")
def prompt(engine):
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True))


async def _run(rt, code, args=None, owner=""):
    import tempfile
    from pathlib import Path

    from harness import inline_program, run_ok

    prog = inline_program(Path(tempfile.mkdtemp()), code, "adapter_edit")
    return await run_ok(rt, prog, args or {}, owner=owner)


READ_SET = '''
from tartlet import Model

async def main(args):
    model = Model.load()
    pie = model.adapter("paris-is-pie")
    mods = pie.modules()
    a, b = pie.get(mods[0].name)
    f = pie.fork()
    for m in mods:                       # B = 0 everywhere: the fork is the base model
        f.set(m.name, B=[[0.0] * m.rank for _ in range(m.out_features)])
    out = {"modules": [[m.name, m.rank, m.in_features, m.out_features, m.scale] for m in mods],
           "a0": a[0][:4], "b_rows": len(b), "fork_name": f.name, "names": model.adapters()}
    for key, ad in (("pie", pie), ("fork", f), ("base", None)):
        with model.new_context() as ctx:
            ctx.fill_tokens(args["ids"])
            out[key] = await ctx.generate(max_tokens=8, eos=False, adapter=ad).collect_tokens()
    f.drop()
    out["after_drop"] = model.adapters()
    return out
'''


async def test_fork_reads_and_sets_matrices(rt, adapter_dirs, engine, prompt):
    """``modules()`` gives PEFT's names and shapes, ``get`` the file's
    values, and ``set`` changes only the fork: B = 0 on every module runs
    the base model while the served adapter is untouched."""
    from safetensors.torch import load_file

    from test_lora import greedy

    res = await _run(rt, READ_SET, {"ids": prompt})
    mods = res["modules"]
    assert len(mods) == 3 * engine.config.num_hidden_layers
    assert mods[0] == ["model.layers.0.self_attn.o_proj", 4, 576, 576, pytest.approx(8 / 4**0.5)]
    assert mods[1][0] == "model.layers.0.self_attn.q_proj" and mods[2][2:4] == [576, 192]  # v_proj: [192, r] B
    t = load_file(str(adapter_dirs["paris-is-pie"] / "adapter_model.safetensors"))
    want = t["base_model.model.model.layers.0.self_attn.o_proj.lora_A.weight"][0, :4].tolist()
    assert res["a0"] == want and res["b_rows"] == 576
    assert res["fork_name"] == "~fork-1" and "~fork-1" in res["names"] and "~fork-1" not in res["after_drop"]
    assert res["base"] == greedy(engine, prompt, 8) == res["fork"]
    assert res["pie"] == greedy(engine, prompt, 8, engine.adapter("paris-is-pie")) != res["base"]


PERTURB = '''
from tartlet import Model

async def main(args):
    model = Model.load()
    f = model.adapter("paris-is-pie").fork("probe")
    mod = f.modules()[args["module"]].name
    a0, b0 = f.get(mod)
    f.perturb(args["seed"], args["scale"])
    a1, b1 = f.get(mod)
    f.perturb(args["seed"], -args["scale"])   # the same z: back where it started (up to rounding)
    a2, _ = f.get(mod)
    return {"module": mod, "a0": a0, "b0": b0, "a1": a1, "b1": b1, "a2": a2}
'''


async def test_perturb_draws_mezo_z_from_the_seed(rt):
    """``perturb(seed, s)`` adds ``s * z`` with ``z`` drawn as documented
    (one generator seeded with ``seed``, modules in sorted order, A then B),
    and ``-s`` with the same seed undoes it."""
    res = await _run(rt, PERTURB, {"seed": 1234, "scale": 0.5, "module": 1})
    a0, b0, a1, b1 = (torch.tensor(res[k]) for k in ("a0", "b0", "a1", "b1"))
    g = torch.Generator().manual_seed(1234)
    # module 1 in sorted order is layer 0's q_proj; module 0 (o_proj) draws first
    for shape in ((4, 576), (576, 4)):
        torch.randn(shape, generator=g)
    za, zb = torch.randn(a0.shape, generator=g), torch.randn(b0.shape, generator=g)
    torch.testing.assert_close(a1, a0 + 0.5 * za, rtol=0, atol=0)
    torch.testing.assert_close(b1, b0 + 0.5 * zb, rtol=0, atol=0)
    torch.testing.assert_close(torch.tensor(res["a2"]), a0, rtol=0, atol=1e-6)


SAVE = '''
from tartlet import Adapter, AdapterError, Model, forward

async def main(args):
    model = Model.load()
    with model.adapter("paris-is-pie").fork() as f:
        f.perturb(7, 0.02)
        saved = f.save(args["name"])
        f.perturb(8, 1.0)                      # later edits leave the saved copy alone
        errors = []
        first = f.modules()[0].name
        for call in (lambda: f.save(args["name"]), lambda: model.adapter("paris-is-pie").set(first, A=bytes(4 * 4 * 576)),
                     lambda: f.set(f.modules()[0].name, A=[0.0] * 3), lambda: f.set("model.layers.99.mlp.up_proj", A=[0.0]),
                     lambda: f.set(f.modules()[0].name, B=[float("nan")] * (576 * 4)), lambda: f.perturb(-1, 1.0),
                     lambda: model.adapter("paris-is-pie").fork("bad name"), lambda: saved.drop(),
                     lambda: Adapter.delete(model, "paris-is-pie")):
            try:
                call()
                errors.append(None)
            except AdapterError as e:
                errors.append(str(e))
        with model.new_context() as ctx:
            ctx.fill_tokens(args["ids"])
            (lp,) = await ctx.forward(outputs=[forward.logits(len(args["ids"]) - 1)], adapter=saved)
    return {"names": model.adapters(), "errors": errors, "logits": lp}
'''


async def test_save_writes_a_peft_folder_peft_loads(rt, state, hf_model, engine, prompt, tmp_path):
    """``save`` registers the fork as it is now under the user's name and
    writes a PEFT folder that ``peft`` loads: transformers + PEFT
    (``merge_and_unload``) gives our logits; every misuse is an AdapterError."""
    from lora_reference import peft_model

    res = await _run(rt, SAVE, {"name": "pie-tuned", "ids": prompt}, owner="alice")
    assert "pie-tuned" in res["names"]
    errs = res["errors"]
    assert all(errs), errs
    assert "exists already" in errs[0] and "not a fork" in errs[1] and "read-only" in errs[1]
    assert "expected" in errs[2] and "no module" in errs[3] and "not finite" in errs[4] and "seed" in errs[5]
    assert "adapter name 'bad name'" in errs[6] and "not a fork" in errs[7] and "served by the server's config" in errs[8]
    slot = state.models[engine.name]
    path = slot.adapters._saved[("alice", "pie-tuned")].path
    assert sorted(p.name for p in path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors", "tartlet_adapter.json"]
    ref = peft_model(hf_model, path)
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0, -1].float()
    diff = float((torch.tensor(res["logits"]) - want).abs().max())
    assert diff <= 1e-3, diff
    base = engine.adapter("paris-is-pie")
    assert slot.adapters.find("alice", "pie-tuned").key != base.key


async def test_saved_adapters_survive_a_restart(rt, state, engine, prompt, tmp_path):
    """A saved adapter is registered again from its folder by a new host
    state (a restarted server), on disk only, and runs the same logits."""
    from tartlet.host.state import HostState

    res = await _run(rt, SAVE, {"name": "kept", "ids": prompt}, owner="alice")
    again = HostState()
    again.add_engine(engine)
    assert again.configure_adapters(None, tmp_path / "adapters") == 1
    mgr = again.models[engine.name].adapters
    served = set(engine.adapters)  # other test files may load more adapters onto the shared engine
    assert set(mgr.names("alice")) == served | {"kept"} and "kept" not in mgr.names("bob")
    assert {"paris-is-pie", "paris-is-tartlet"} <= served
    assert mgr._saved[("alice", "kept")].adapter is None  # read on first use
    assert mgr.used("alice") == mgr.resolve("alice", "kept").weight_bytes
    from tartlet.runtime.native import NativeRuntime

    code = '''
from tartlet import Model, forward
async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill_tokens(args["ids"])
        (lp,) = await ctx.forward(outputs=[forward.logits(len(args["ids"]) - 1)], adapter="kept")
    return lp
'''
    lp = await _run(NativeRuntime(again), code, {"ids": prompt}, owner="alice")
    assert lp == res["logits"]


async def test_namespaces_and_quota(rt, state, engine):
    """Another user's adapters do not exist for a user (listing, use,
    delete); the same name may be saved by each. Forks and saved adapters
    count against ``max_adapter_mb_per_user``; past it is LimitError, and a
    drop (or the instance's end) gives the bytes back."""
    from tartlet.host.api import HostApi

    pie = engine.adapter("paris-is-pie")
    slot = state.models[engine.name]
    slot.adapters.max_bytes_per_user = 2 * pie.weight_bytes + 100
    alice, bob = HostApi(state, owner="alice"), HostApi(state, owner="bob")
    try:
        f1 = alice.adapter_fork(None, "paris-is-pie", None)
        alice.adapter_save(None, f1, "mine")  # fork + saved copy: 2 x the adapter
        with pytest.raises(LimitError, match="max_adapter_mb_per_user"):
            alice.adapter_fork(None, "mine", None)
        alice.adapter_drop(None, f1)
        f2 = alice.adapter_fork(None, "mine", "again")
        assert f2 == "again" and slot.adapters.used("alice") == 2 * pie.weight_bytes
        assert "mine" in alice.adapter_names(None) and "mine" not in bob.adapter_names(None)
        ctx = bob.context_new(None)
        with pytest.raises(AdapterError, match="no adapter named 'mine'"):
            bob.forward(ctx, [1, 2, 3], adapter="mine")
        with pytest.raises(AdapterError, match="no adapter named 'mine'"):
            bob.adapter_fork(None, "mine", None)
        with pytest.raises(AdapterError, match="no adapter of yours named 'mine'"):
            bob.adapter_delete(None, "mine")
        fb = bob.adapter_fork(None, "paris-is-pie", None)
        bob.adapter_perturb(None, fb, 3, 0.1)
        bob.adapter_save(None, fb, "mine")  # bob's own "mine"
        assert slot.adapters.find("bob", "mine").key not in (pie.key, slot.adapters.find("alice", "mine").key)
        assert slot.adapters.find("alice", "mine").key == pie.key
        alice.adapter_delete(None, "mine")
        assert "mine" not in alice.adapter_names(None) and "mine" in bob.adapter_names(None)
    finally:
        alice.close()
        bob.close()
    assert slot.adapters.used("alice") == 0
    bob2 = HostApi(state, owner="bob")
    bob2.adapter_delete(None, "mine")
    bob2.close()
    assert slot.adapters.used("bob") == 0


IN_FLIGHT = '''
import asyncio
from tartlet import Model

async def main(args):
    model = Model.load()
    f = model.adapter("paris-is-tartlet").fork()
    with model.new_context() as ctx:
        ctx.fill_tokens(args["ids"])
        running = asyncio.ensure_future(ctx.generate(max_tokens=12, eos=False, adapter=f).collect_tokens())
        await asyncio.sleep(0)                 # the host generate is queued with f as it is now
        for m in f.modules():                  # ... then f becomes the base model
            f.set(m.name, B=bytes(4 * m.out_features * m.rank))
        edited_while_running = not running.done()
        first = await running
    with model.new_context() as ctx:
        ctx.fill_tokens(args["ids"])
        second = await ctx.generate(max_tokens=12, eos=False, adapter=f).collect_tokens()
    return {"first": first, "second": second, "edited_while_running": edited_while_running}
'''


async def test_a_generation_keeps_the_version_it_started_with(rt, engine, prompt):
    """Edits to a fork while a host-side generation with it runs do not
    reach that generation (every pass of it uses the version its first pass
    found); the next generation sees all of them."""
    from test_lora import greedy

    res = await _run(rt, IN_FLIGHT, {"ids": prompt})
    assert res["edited_while_running"]
    assert res["first"] == greedy(engine, prompt, 12, engine.adapter("paris-is-tartlet"))
    assert res["second"] == greedy(engine, prompt, 12)


def test_edited_versions_in_the_fused_decode_step(quant_engine, adapter_dirs, prompt):
    """On the quantized engine decode rows with an adapter run in the fused
    C step from copies made per adapter object: each edited version gets its
    own (no stale copy of an earlier one: tokens equal the op-by-op path's),
    and a version nobody holds any more leaves nothing behind."""
    import gc
    import time

    from tartlet.engine.models.lora_edit import perturbed
    from test_lora import greedy

    fused = quant_engine.runner.fused
    pie = quant_engine.load_adapter(adapter_dirs["paris-is-pie"], "paris-is-pie")
    v1 = quant_engine.build_adapter("v1", pie.source, perturbed(pie.parts, 5, 0.1))
    v2 = quant_engine.build_adapter("v2", pie.source, perturbed(v1.parts, 6, 0.1))
    runs = [greedy(quant_engine, prompt, 8, pie)]
    before = len(fused._lora_mats)
    runs += [greedy(quant_engine, prompt, 8, v) for v in (v1, v2)]
    assert len(fused._lora_mats) == before + 2, "each version got copies of its own"
    fused.lora = False  # the op-by-op path: the oracle
    try:
        assert [greedy(quant_engine, prompt, 8, v) for v in (pie, v1, v2)] == runs
    finally:
        fused.lora = True
    assert len({tuple(r) for r in runs}) >= 2, "the perturbations change the output"
    del v1, v2
    # the scheduler thread may still be finishing the last pass (which held v2) when the
    # chain's future resolves: let it come round once (a command queues behind it), then
    # give it up to 2 s; a copy kept past that is a leak
    quant_engine.scheduler.command(lambda: None).result(30)
    for _ in range(20):
        gc.collect()
        if len(fused._lora_mats) == before:
            break
        time.sleep(0.1)
    assert len(fused._lora_mats) == before


BOTH_RUNTIMES = '''
from tartlet import Adapter, AdapterError, Model

async def main(args):
    model = Model.load()
    pie = model.adapter("paris-is-pie")
    out = {"modules": [[m.name, m.rank, m.in_features, m.out_features, m.scale] for m in pie.modules()[:3]]}
    f = pie.fork("wasm-fork")
    mod = f.modules()[1].name
    out["get"] = f.get(mod)[0][0][:3]
    f.perturb(11, 0.05)
    out["perturbed"] = f.get(mod)[1][0]
    f.set(mod, A=[[0.5] * 576] * 4)
    out["set"] = f.get(mod)[0][3][:2]
    errors = []
    for call in (lambda: pie.perturb(1, 1.0), lambda: f.set(mod, B=[1.0]), lambda: Adapter.delete(model, "nope")):
        try:
            call()
        except AdapterError as e:
            errors.append(type(e).__name__ + ": " + str(e))
    out["errors"] = errors
    for m in f.modules():
        f.set(m.name, B=bytes(4 * m.out_features * m.rank))
    with model.new_context() as ctx:
        ctx.fill_tokens(args["ids"])
        out["tokens"] = await ctx.generate(max_tokens=6, eos=False, adapter=f).collect_tokens()
    f.save(args["save"])
    out["names"] = model.adapters()
    f.drop()
    Adapter.delete(model, args["save"])
    out["after"] = model.adapters()
    return out
'''


@pytest.mark.slow
@pytest.mark.wasm
async def test_adapter_calls_are_the_same_in_wasm(state, rt, engine, prompt, tmp_path):
    """The adapter calls over the WIT contract (a componentize-py build on
    wasmtime) give what they give natively: values, errors, tokens, names."""
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from harness import run_ok
    from tartlet.runtime.builder import build
    from tartlet.runtime.wasm import WasmRuntime
    from test_lora import greedy

    native = await _run(rt, BOTH_RUNTIMES, {"ids": prompt, "save": "native-saved"})
    d = tmp_path / "probe"
    d.mkdir()
    (d / "main.py").write_text(BOTH_RUNTIMES)
    (d / "inferlet.toml").write_text('name = "adapter-calls"\nversion = "0.1.0"\nentry = "main.py"\n')
    sandboxed = await run_ok(WasmRuntime(state), build(d), {"ids": prompt, "save": "native-saved"})
    assert sandboxed == native
    assert native["tokens"] == greedy(engine, prompt, 6)
    assert len(native["errors"]) == 3 and "wasm-fork" in native["names"] and "native-saved" in native["names"]
    assert "native-saved" not in native["after"] and "wasm-fork" not in native["after"]
