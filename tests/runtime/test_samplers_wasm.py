"""The samplers of issue 36 part 4 in a WASM component give the tokens of a
native run: the engine-side fields (typical-p, XTC, DRY with its sequence
breakers) cross the WIT in ``sampler-params`` (forward slots, host-side
``generate`` and token streams), Mirostat and classifier-free guidance run
in the guest's SDK, and a bad parameter raises the same error."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from harness import assert_no_leaks, run_ok  # noqa: E402
from tartlet.runtime.builder import build  # noqa: E402
from tartlet.runtime.program import load_program  # noqa: E402
from tartlet.runtime.wasm import WasmRuntime  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.wasm]  # one componentize-py build (cached) and compile

SOURCE = textwrap.dedent('''
    """Sampler probe: the same generations natively and sandboxed."""
    from tartlet import Model, Sampler, _binding, forward
    from tartlet.guidance import guided_logits, pick

    PROMPT = "Repeat exactly: red blue red blue red blue red blue"

    async def gen(model, sampler, how):
        with model.new_context() as ctx:
            ctx.user(PROMPT)
            if how == "collect":
                return await ctx.generate(sampler, max_tokens=16, eos=False).collect_tokens()
            g = ctx.generate(sampler, max_tokens=16, eos=False, overlap=(how == "stream"))
            async for _ in g:
                pass
            return g.tokens

    async def main(args):
        model = Model.load()
        mixed = Sampler(temperature=0.9, seed=7, min_p=0.02, typical_p=0.9, xtc_probability=0.5, xtc_threshold=0.1,
                        dry_multiplier=0.8, dry_base=1.5, dry_allowed_length=1, dry_penalty_last_n=64,
                        dry_sequence_breakers=["\\n", " blue"])
        out = {how: await gen(model, mixed, how) for how in ("collect", "step", "stream")}
        out["dry_greedy"] = await gen(model, Sampler(dry_multiplier=3.0), "collect")
        miro = Sampler.mirostat_v2(3.0, eta=0.2, seed=3)
        out["mirostat"] = await gen(model, miro, "step")
        out["surprises"] = [round(s, 9) for s in miro.surprises]
        with model.new_context() as c, model.new_context() as u:
            c.user(PROMPT); c.begin_assistant()
            u.user(""); u.begin_assistant()
            toks = []
            for _ in range(6):
                toks.append(pick(await guided_logits(c, u, 2.0)))
                c.fill_tokens([toks[-1]]); u.fill_tokens([toks[-1]])
            out["cfg"] = toks
        errors = {}
        h = _binding.host().context_new(None)
        for name, kw in {"typical_p": {"typical_p": 0.0}, "dry_base": {"dry_base": 0.5},
                         "dry_sequence_breakers": {"dry_sequence_breakers": [""]}}.items():
            try:
                _binding.host().forward(h, [1], None, None, [forward.OutputSlot(0, "sample", temperature=1.0, **kw)])
            except Exception as e:
                errors[name] = f"{type(e).__name__}: {e}"
        _binding.host().context_free(h)
        out["errors"] = errors
        return out
''')


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("sampler-probe")
    (d / "main.py").write_text(SOURCE)
    (d / "inferlet.toml").write_text('name = "sampler-probe"\nversion = "0.1.0"\nentry = "main.py"\n')
    return d, build(d)


async def test_samplers_in_a_component_match_native(probe, runtime, host_state):
    folder, wasm = probe
    native = await run_ok(runtime, load_program(folder))
    sandboxed = await run_ok(WasmRuntime(host_state), wasm)
    assert sandboxed == native
    assert native["collect"] == native["step"] == native["stream"]  # host-side, stepped and streamed: one sampler
    assert len(native["mirostat"]) == len(native["surprises"]) == 16
    assert set(native["errors"]) == {"typical_p", "dry_base", "dry_sequence_breakers"}
    assert all(k in v for k, v in native["errors"].items())
    assert_no_leaks(host_state)
