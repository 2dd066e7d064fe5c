"""The bundled text-completion inferlet against transformers' greedy generation."""

from __future__ import annotations

import asyncio

import torch

from harness import assert_no_leaks, run_ok
from tartlet.host.session import Session
from tartlet.runtime.instance import Status
from tartlet.runtime.program import find_program


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


async def test_abort_mid_stream_frees_its_pages(runtime):
    """text-completion takes its steps from a host token stream, several
    tokens each (``generate(chunk=8, overlap=True)``, passes running while a
    step is streamed): aborting it mid-stream still frees every page, and
    the engine keeps serving."""
    args = {"prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True}
    session, out = Session(), list[str | bytes]()
    session.listen(out.append)
    inst = runtime.launch(find_program("text-completion"), args, session)
    for _ in range(600):  # until a few tokens have streamed
        if len(out) >= 3:
            break
        await asyncio.sleep(0.01)
    assert len(out) >= 3 and inst.status is Status.RUNNING
    inst.abort("stopped by the test")
    await inst.wait()
    assert inst.status is Status.ABORTED
    assert_no_leaks(runtime.state)
    res = await run_ok(runtime, "text-completion", {"prompt": "What is the capital of France?"})
    assert res["text"] == "The capital of France is Paris."
