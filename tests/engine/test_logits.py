"""Our logits against transformers on the same GGUF (float32).

Each prompt is run through an inferlet that reads raw logits with the
``logits`` probe: once as one prefill (logits at every position), once token
by token through the KV cache, and once as a chunked prefill. The reference
is ``transformers`` loading the same GGUF file (``hf_model`` fixture).
"""

from __future__ import annotations

import pytest
import torch

from harness import inline_program, run_ok

#: float32 tolerance on logits of magnitude ~20: different (but equally
#: valid) summation orders of 30 layers differ by ~1e-4.
ATOL = 1e-3

PROMPTS = {
    "short": [{"role": "user", "content": "Hi!"}],
    "medium": [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
    "long": [
        {"role": "system", "content": "You are a helpful assistant who answers questions about geography and history."},
        {"role": "user", "content": "Tell me three facts about the river Danube: where it starts, which countries "
                                    "it flows through, and where it ends. Keep it short, please."},
    ],
}

PROBE = """
from array import array
from tartlet import Model
from tartlet.sdk import forward

async def main(args):
    model = Model.load()
    ids, mode = args["ids"], args["mode"]
    out = []  # float32 bytes of each position's logits
    with model.new_context() as ctx:
        if mode == "prefill":
            ctx.fill_tokens(ids)
            res = await ctx.forward(outputs=[forward.logits(i) for i in range(len(ids))])
            out = [array("f", r).tobytes() for r in res]
        else:  # a prefill of `split` tokens, then one token per forward pass
            split = args["split"]
            if split:
                ctx.fill_tokens(ids[:split])
                (r,) = await ctx.forward(outputs=[forward.logits(split - 1)])
                out.append(array("f", r).tobytes())
            for t in ids[split:]:
                (r,) = await ctx.forward([t], outputs=[forward.logits(0)])
                out.append(array("f", r).tobytes())
        stats = await ctx.stats()
    return {"logits": out, "stats": stats}
"""


def as_tensor(rows: list[bytes]) -> torch.Tensor:
    return torch.stack([torch.frombuffer(bytearray(b), dtype=torch.float32) for b in rows])


@pytest.fixture(scope="module")
def prompt_ids(engine):
    return {
        name: engine.tokenizer.encode(engine.tokenizer.apply_chat_template(msgs, add_generation_prompt=True))
        for name, msgs in PROMPTS.items()
    }


@pytest.fixture(scope="module")
def reference(prompt_ids, hf_model, hf_tokenizer):
    """transformers' float32 logits ``[n, vocab]`` per prompt (its own tokenization must agree)."""
    out = {}
    for name, ids in prompt_ids.items():
        ref_ids = hf_tokenizer.apply_chat_template(PROMPTS[name], add_generation_prompt=True, tokenize=True)
        ref_ids = list(ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids)
        assert ids == ref_ids, name
        with torch.no_grad():
            out[name] = hf_model(torch.tensor([ids])).logits[0].float()
    return out


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return inline_program(tmp_path_factory.mktemp("logits"), PROBE, "logits_probe")


def test_prompts_have_different_lengths(prompt_ids, engine):
    lens = sorted(len(v) for v in prompt_ids.values())
    assert len(set(lens)) == 3
    assert lens[-1] > 3 * engine.pool.page_size  # the long one spans several pages


def check(name: str, what: str, ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    diff = float((ours - ref).abs().max())
    print(f"{what} {name}: {ours.shape[0]} positions, max abs logit diff vs transformers {diff:.2e}")
    assert diff <= ATOL, f"{what} {name}: max abs logit diff {diff:.3e} > {ATOL}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"{what} {name}: greedy tokens differ"
    return diff


@pytest.mark.parametrize("name", list(PROMPTS))
async def test_prefill_logits_match_transformers(runtime, probe, prompt_ids, reference, name):
    res = await run_ok(runtime, probe, {"ids": prompt_ids[name], "mode": "prefill"})
    check(name, "prefill", as_tensor(res["logits"]), reference[name])


@pytest.mark.parametrize("name", list(PROMPTS))
async def test_decode_logits_match_transformers(runtime, probe, prompt_ids, reference, engine, name):
    """Every token goes in alone: each step reads all earlier tokens from the paged KV cache."""
    ids = prompt_ids[name]
    calls0 = engine.scheduler.stats.model_calls
    res = await run_ok(runtime, probe, {"ids": ids, "mode": "decode", "split": 0})
    assert engine.scheduler.stats.model_calls - calls0 >= len(ids)
    ps = engine.pool.page_size
    assert res["stats"]["tokens"] == len(ids) and res["stats"]["pages"] == -(-len(ids) // ps)
    check(name, "decode", as_tensor(res["logits"]), reference[name])


async def test_prefill_then_decode_logits_match_transformers(runtime, probe, prompt_ids, reference):
    """A prefill that ends mid-page, then single-token steps across page boundaries."""
    ids = prompt_ids["long"]
    split = 21
    res = await run_ok(runtime, probe, {"ids": ids, "mode": "decode", "split": split})
    check("long", "prefill+decode", as_tensor(res["logits"]), reference["long"][split - 1 :])


async def test_chunked_prefill_matches_unchunked(runtime, probe, prompt_ids, reference, engine):
    ids = prompt_ids["long"]
    whole = as_tensor((await run_ok(runtime, probe, {"ids": ids, "mode": "prefill"}))["logits"])
    sched = engine.scheduler
    old = sched.max_batch_tokens
    calls0 = sched.stats.model_calls
    sched.max_batch_tokens = 7
    try:
        chunked = as_tensor((await run_ok(runtime, probe, {"ids": ids, "mode": "prefill"}))["logits"])
    finally:
        sched.max_batch_tokens = old
    assert sched.stats.model_calls - calls0 >= -(-len(ids) // 7), "the prefill was not split into chunks of 7"
    diff = float((chunked - whole).abs().max())
    print(f"chunked (7 tokens per call) vs unchunked prefill: max abs logit diff {diff:.2e}")
    assert diff <= ATOL, f"chunked vs unchunked prefill: max abs logit diff {diff:.3e}"
    check("long", "chunked prefill", chunked, reference["long"])
