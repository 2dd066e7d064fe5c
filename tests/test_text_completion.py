"""The bundled text-completion inferlet against transformers' greedy generation."""

from __future__ import annotations

import torch

from harness import run_ok


async def test_greedy_matches_transformers(runtime, hf_model, hf_tokenizer):
    prompt = "Write a short story about a robot learning to paint."
    res = await run_ok(runtime, "text-completion", {"prompt": prompt, "max_tokens": 40})
    ids = hf_tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False)
    ref = out[0, len(ids) :].tolist()
    assert len(res["tokens"]) == 40
    assert res["tokens"] == ref
    assert res["text"].startswith('As the AI, a sentient robot named "Echo,"')


async def test_streams_text_and_stops_at_eos(runtime):
    from harness import run

    inst = await run(runtime, "text-completion", {"prompt": "What is the capital of France?"})
    assert inst.result["finish_reason"] == "eos"
    assert inst.result["text"] == "The capital of France is Paris."
    assert "".join(inst.output) == inst.result["text"]
