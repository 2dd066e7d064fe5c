"""The ``hidden`` output slot against transformers' hidden states.

The oracle is Hugging Face's model loaded from the same GGUF and run in
float64 (``output_hidden_states``: ``hidden_states[i + 1]`` is decoder layer
``i``'s output, the last entry the final one after the final norm; the last
layer's output before that norm is read with a forward hook). Ours run in
float32: the float32 engine takes the op-by-op path (C kernels), the
quantized engine (the default model as users get it) the fused C decode step
for final / last-layer reads and the op-by-op path for earlier layers.
"""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from harness import inline_program, run, run_ok

#: float32 against float64 through 30 layers: relative to the largest
#: magnitude of the compared states (the final ones reach ~35, middle
#: layers ~100, the last layer's raw output ~2500)
RTOL = 5e-5

PROBE = """
from array import array
import asyncio
from tartlet import Model, forward

def pack(rows):
    return [array("f", r).tobytes() for r in rows]

async def one(m, ids, mode, layers, split):
    # {layer: [float32 bytes per position]}; mode: prefill (one pass) or
    # decode (a prefill of `split` tokens, then one token per pass)
    out = {str(layer): [] for layer in layers}
    with m.new_context() as ctx:
        if mode == "prefill":
            ctx.fill_tokens(ids)
            res = await ctx.forward(outputs=[forward.hidden(i, layer) for layer in layers for i in range(len(ids))])
            for j, layer in enumerate(layers):
                out[str(layer)] = pack(res[j * len(ids):(j + 1) * len(ids)])
        else:
            ctx.fill_tokens(ids[:split])
            res = await ctx.forward(outputs=[forward.hidden(i, layer) for layer in layers for i in range(split)])
            for j, layer in enumerate(layers):
                out[str(layer)] = pack(res[j * split:(j + 1) * split])
            for t in ids[split:]:
                res = await ctx.forward([t], outputs=[forward.hidden(0, layer) for layer in layers])
                for layer, r in zip(layers, res):
                    out[str(layer)] += pack([r])
    return out

async def main(args):
    m = Model.load()
    layers = args["layers"]
    return await asyncio.gather(*(one(m, ids, args.get("mode", "prefill"), layers, args.get("split", 1))
                                  for ids in args["prompts"]))
"""

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Paris is the capital of",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)",
    "Water boils at one hundred degrees Celsius at sea level, and freezes at zero.",
]


@pytest.fixture(scope="module")
def hf64(hf_model):
    """transformers' model in float64 (a copy: the session's stays float32)."""
    return copy.deepcopy(hf_model).double()


def reference(hf64, ids: list[int]) -> dict[str, torch.Tensor]:
    """float64 ``[n, H]`` states by our layer key: "None" (final), "0".."29" and "-1"."""
    last = hf64.model.layers[-1]
    kept = {}
    hook = last.register_forward_hook(lambda _m, _i, out: kept.setdefault("raw", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            hs = hf64(torch.tensor([ids]), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    n = len(hs) - 1
    ref = {str(i): hs[i + 1][0] for i in range(n - 1)}
    ref["None"] = hs[-1][0]
    ref[str(n - 1)] = ref["-1"] = kept["raw"][0]
    return ref


def rows(blobs: list[bytes]) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(b), dtype=torch.float32) for b in blobs]).double()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = RTOL) -> None:
    assert ours.shape == ref.shape
    err = float((ours - ref).abs().max())
    scale = float(ref.abs().max())
    assert err <= rtol * scale, f"max error {err:.3g} against states up to {scale:.3g} (rtol {rtol})"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return inline_program(tmp_path_factory.mktemp("hidden"), PROBE, "hidden_probe")


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return [engine.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("layers", [[None], [14, 0], [-1, 29]])
async def test_prefill_matches_transformers(runtime, probe, prompt_ids, hf64, layers):
    ids = prompt_ids[0]
    (got,) = await run_ok(runtime, probe, {"prompts": [ids], "layers": layers})
    ref = reference(hf64, ids)
    for layer in layers:
        assert_close(rows(got[str(layer)]), ref[str(layer)])
    if layers == [-1, 29]:  # two names of one layer: the same rows
        assert got["-1"] == got["29"]


async def test_decode_steps_match_transformers(runtime, probe, prompt_ids, hf64):
    """One prefill, then token by token through the KV cache (the decode
    attention kernel): every position's final and middle-layer state."""
    ids = prompt_ids[1]
    (got,) = await run_ok(runtime, probe, {"prompts": [ids], "layers": [None, 7], "mode": "decode", "split": 5})
    ref = reference(hf64, ids)
    for layer in ("None", "7"):
        assert_close(rows(got[layer]), ref[layer])


async def test_batched_contexts_match_transformers_and_singles(runtime, probe, prompt_ids, hf64):
    """Three prompts of different lengths in one batch of passes (one
    instance, concurrent contexts): each equals its reference and its run alone."""
    together = await run_ok(runtime, probe, {"prompts": prompt_ids, "layers": [None, 20], "mode": "decode", "split": 4})
    for ids, got in zip(prompt_ids, together):
        ref = reference(hf64, ids)
        (alone,) = await run_ok(runtime, probe, {"prompts": [ids], "layers": [None, 20], "mode": "decode", "split": 4})
        for layer in ("None", "20"):
            assert_close(rows(got[layer]), ref[layer])
            assert_close(rows(got[layer]), rows(alone[layer]), 1e-5)


PREFIX = """
from array import array
from tartlet import Model, forward

async def main(args):
    m = Model.load()
    ids = args["ids"]
    with m.new_context() as warm:  # commits the prompt's full pages to the prefix cache
        warm.fill_tokens(ids)
        await warm.flush()
    before = m.kv_stats()
    with m.new_context() as ctx:
        ctx.fill_tokens(ids)
        res = await ctx.forward(outputs=[forward.hidden(len(ids) - 1), forward.hidden(len(ids) - 1, 12)])
    return {"rows": [array("f", r).tobytes() for r in res], "cached_before": before["cached"]}
"""


async def test_prefix_cache_hit_matches_transformers(runtime, engine, prompt_ids, hf64, tmp_path):
    """A prompt whose first pages come from the prefix cache: only the
    tokens from the first hidden slot on are computed, and the state of the
    last one is still the reference's."""
    ids = (prompt_ids[0] + prompt_ids[2]) * 2  # > 2 pages of 16 tokens
    reused = engine.scheduler.stats.prefix_tokens_reused
    res = await run_ok(runtime, inline_program(tmp_path, PREFIX, "prefix_probe"), {"ids": ids})
    assert engine.scheduler.stats.prefix_tokens_reused - reused >= 2 * engine.pool.page_size
    ref = reference(hf64, ids)
    assert_close(rows(res["rows"][:1]), ref["None"][-1:])
    assert_close(rows(res["rows"][1:]), ref["12"][-1:])


SAME_PASS = """
from array import array
from tartlet import Model, forward

async def main(args):
    m = Model.load()
    ids = args["ids"]
    out = []
    for slots in ([forward.logits(len(ids) - 1)], [forward.hidden(2, 3), forward.logits(len(ids) - 1), forward.hidden(len(ids) - 1)]):
        with m.new_context() as ctx:
            ctx.fill_tokens(ids)
            out.append([array("f", r).tobytes() for r in await ctx.forward(outputs=slots)])
    return out
"""


async def test_hidden_slots_leave_the_logits_of_the_pass_unchanged(runtime, prompt_ids, tmp_path):
    alone, mixed = await run_ok(runtime, inline_program(tmp_path, SAME_PASS, "same_pass"), {"ids": prompt_ids[0]})
    assert mixed[1] == alone[0]  # the logits slot between two hidden slots: bit for bit
    assert len(mixed[0]) == len(mixed[2]) == 576 * 4


async def test_fused_decode_step_matches_op_by_op(quant_runtime, quant_engine, probe, prompt_ids, hf64, monkeypatch):
    """The quantized engine: decode steps reading the final state or the
    last layer's run in the fused C step (counted), a middle layer's op by
    op; both paths give the same states within their rounding, and the
    reference's within the quantized kernels' accuracy (16-bit activations,
    a float16 KV pool)."""
    fused = quant_engine.runner.fused
    assert fused is not None, "the default model's quantized engine has a fused decode step"
    calls = []
    real = fused.run
    monkeypatch.setattr(fused, "run", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    ids = prompt_ids[2]
    args = {"prompts": [ids], "mode": "decode", "split": 3}
    (step,) = await run_ok(quant_runtime, probe, {**args, "layers": [None, -1]})
    n_fused = len(calls)
    assert n_fused >= len(ids) - 3  # every decode step (prompts may run fused too)
    (mid,) = await run_ok(quant_runtime, probe, {**args, "layers": [None, 9]})
    assert len(calls) == n_fused  # a middle layer: never the fused step
    monkeypatch.setattr(fused, "enabled", False)
    (eager,) = await run_ok(quant_runtime, probe, {**args, "layers": [None, -1]})
    # the fused step and the op-by-op kernels round differently (test_fused_decode: logits within 0.02 of ~30)
    assert_close(rows(step["None"]), rows(eager["None"]), 1e-3)
    assert_close(rows(step["-1"]), rows(eager["-1"]), 1e-3)
    assert_close(rows(mid["None"]), rows(eager["None"]), 1e-3)
    ref = reference(hf64, ids)
    for got, layer in ((step, "None"), (mid, "9"), (step, "-1")):
        assert_close(rows(got[layer]), ref[layer], 5e-3)


BAD = """
from tartlet import Model, forward
from tartlet.sdk.forward import OutputSlot

async def main(args):
    m = Model.load()
    slot = OutputSlot(0, "hidden", layer=args.get("layer"), logit_mask=args.get("mask"))
    with m.new_context() as ctx:
        ctx.fill_tokens([1, 2, 3])
        try:
            await ctx.forward(outputs=[slot])
        except ValueError as e:
            return {"error": type(e).__name__, "message": str(e), "kv_len": ctx.kv_len}
    return {"error": None}
"""


@pytest.mark.parametrize(("args", "words"), [
    ({"layer": 30}, ["layer 30", "30 layers"]),
    ({"layer": -31}, ["layer -31"]),
    ({"layer": "last"}, ["layer must be an int or None", "'last'"]),
    ({"layer": True}, ["layer must be an int or None"]),
    ({"mask": [0, 5]}, ["hidden-state slot", "logit_mask"]),
])
async def test_bad_hidden_slots_raise_before_anything_runs(runtime, tmp_path, args, words):
    res = await run_ok(runtime, inline_program(tmp_path, BAD, "bad_hidden"), args)
    assert res["error"] == "SamplingError", res
    assert all(w in res["message"] for w in words), res["message"]
    assert res["kv_len"] == 0  # nothing was queued


async def test_pages_of_hidden_state_passes_are_freed(runtime, engine, probe, prompt_ids):
    used = engine.pool.stats().used
    inst = await run(runtime, probe, {"prompts": prompt_ids, "layers": [None, 3]})
    assert inst.error is None
    from harness import drain

    drain(runtime.state)
    assert engine.pool.stats().used == used


async def test_concurrent_probe_instances(runtime, probe, prompt_ids):
    """Two instances at once (their passes share batches) get what each gets alone."""
    a, b = await asyncio.gather(run_ok(runtime, probe, {"prompts": prompt_ids[:1], "layers": [None]}),
                                run_ok(runtime, probe, {"prompts": prompt_ids[1:2], "layers": [None]}))
    (a1,) = await run_ok(runtime, probe, {"prompts": prompt_ids[:1], "layers": [None]})
    assert_close(rows(a[0]["None"]), rows(a1["None"]), 1e-5)
    assert len(b[0]["None"]) == len(prompt_ids[1])
