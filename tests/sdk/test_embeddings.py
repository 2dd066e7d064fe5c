"""Embeddings in the SDK (:mod:`tartlet.embedding`) and the ``embedding``
inferlet, on the real default model against transformers' float64 hidden
states of the same weights (pooled and normalised here, independently)."""

from __future__ import annotations

import copy
import math
import time

import pytest
import torch

from harness import drain, inline_program, run, run_ok
from tartlet.embedding import POOLINGS, l2_normalize, mean_pool, pool
from tartlet.runtime.instance import Status

TEXTS = ["A cat sat on the mat.", "Paris is the capital of France, and its largest city.", "def add(a, b): return a + b"]


@pytest.fixture(scope="module")
def hf64(hf_model):
    return copy.deepcopy(hf_model).double()


def reference(hf64, engine, text: str, pooling: str, normalize: bool = True, layer: int | None = None) -> torch.Tensor:
    """float64 embedding of ``text``: transformers' final hidden states (or
    layer ``layer``'s output) pooled by ``pooling``, then L2-normalised."""
    ids = engine.tokenizer.encode(text)
    with torch.no_grad():
        hs = hf64(torch.tensor([ids]), output_hidden_states=True).hidden_states
    states = (hs[-1] if layer is None else hs[layer + 1])[0]
    v = states.mean(0) if pooling == "mean" else states[-1]
    return v / v.norm() if normalize else v


def test_pooling_helpers():
    assert mean_pool([[1.0, 2.0], [3.0, 6.0]]) == [2.0, 4.0]
    assert l2_normalize([3.0, 4.0]) == [0.6, 0.8]
    assert l2_normalize([0.0, 0.0]) == [0.0, 0.0]  # no direction: unchanged
    assert pool([[1.0, 0.0], [0.0, 2.0]], "last") == [0.0, 1.0]
    assert pool([[1.0, 0.0], [0.0, 2.0]], "mean", normalize=False) == [0.5, 1.0]
    assert POOLINGS == ("mean", "last")
    for bad, word in ((lambda: pool([[1.0]], "max"), "pooling"), (lambda: mean_pool([]), "at least one"),
                      (lambda: mean_pool([[1.0], [1.0, 2.0]]), "one length")):
        with pytest.raises(ValueError, match=word):
            bad()


@pytest.mark.parametrize("pooling", ["mean", "last"])
async def test_inferlet_matches_transformers(runtime, engine, hf64, pooling):
    res = await run_ok(runtime, "embedding", {"prompt": TEXTS, "pooling": pooling})
    assert res["dimensions"] == engine.config.hidden_size == 576
    assert res["tokens"] == [len(engine.tokenizer.encode(t)) for t in TEXTS]
    assert res["pooling"] == pooling and res["normalized"] is True
    for text, vec in zip(TEXTS, res["embeddings"]):
        v = torch.tensor(vec, dtype=torch.float64)
        assert math.isclose(float(v.norm()), 1.0, abs_tol=1e-9)
        assert float((v - reference(hf64, engine, text, pooling)).abs().max()) < 2e-5


async def test_batch_equals_singles_and_options(runtime, engine, hf64):
    batch = (await run_ok(runtime, "embedding", {"prompt": TEXTS}))["embeddings"]
    for text, vec in zip(TEXTS, batch):
        (single,) = (await run_ok(runtime, "embedding", {"text": text}))["embeddings"]
        assert max(abs(a - b) for a, b in zip(vec, single)) < 1e-6
    raw = await run_ok(runtime, "embedding", {"prompt": TEXTS[1], "normalize": False, "layer": 11})
    ref = reference(hf64, engine, TEXTS[1], "mean", normalize=False, layer=11)
    got = torch.tensor(raw["embeddings"][0], dtype=torch.float64)
    assert float((got - ref).abs().max()) < 5e-5 * float(ref.abs().max())
    assert not math.isclose(float(got.norm()), 1.0, abs_tol=1e-3)


TOKENS = """
from tartlet import Model, embedding

async def main(args):
    m = Model.load()
    text = args["text"]
    a = await embedding.embed(m, text)
    b = await embedding.embed(m, m.tokenize(text))
    waves = await embedding.embed_many(m, [text, m.tokenize(text)], wave_tokens=1)  # one input a wave
    return {"text": a, "ids": b, "waves": waves}
"""


async def test_token_ids_equal_text(runtime, tmp_path):
    res = await run_ok(runtime, inline_program(tmp_path, TOKENS, "embed_tokens"), {"text": TEXTS[0]})
    for other in (res["ids"], *res["waves"]):
        assert max(abs(a - b) for a, b in zip(res["text"], other)) < 1e-6


async def test_pages_are_freed_when_the_request_ends(runtime, engine):
    drain(runtime.state)
    used = engine.pool.stats().used
    long_text = " ".join(TEXTS * 8)  # several pages per input
    res = await run_ok(runtime, "embedding", {"prompt": [long_text, long_text + " More.", TEXTS[0]]})
    assert len(res["embeddings"]) == 3
    drain(runtime.state)
    assert engine.pool.stats().used == used


@pytest.mark.parametrize(("args", "words"), [
    ({"prompt": ""}, ["prompt"]),
    ({"prompt": ["ok", ""]}, ["prompt"]),
    ({"prompt": "x", "pooling": "max"}, ["pooling must be one of mean, last", "'max'"]),
    ({"prompt": "x", "normalize": "yes"}, ["normalize"]),
    ({"prompt": "x", "layer": 99}, ["layer 99"]),
    ({"prompt": "word " * 9000}, ["longer than the model's context"]),
])
async def test_bad_arguments_fail_clearly(runtime, args, words):
    inst = await run(runtime, "embedding", args)
    assert inst.status is Status.FAILED
    assert all(w in inst.error for w in words), inst.error


async def test_inputs_run_as_one_batch(runtime, engine, monkeypatch):
    """The passes of all inputs are in the queue together, so the scheduler
    runs them in one model call, not one after another: the first call is
    held until the other inputs are queued, and the second takes them all."""
    runner = engine.scheduler.runner
    real = runner.launch
    sizes: list[int] = []
    n = 16

    def run_held(items, feeds=()):
        if not sizes:  # the first call: wait (scheduler thread, no lock held) for the rest to be queued
            deadline = time.monotonic() + 30
            while engine.scheduler.queued() < n - len(items) and time.monotonic() < deadline:
                time.sleep(0.005)
        sizes.append(len(items))
        return real(items, feeds)

    monkeypatch.setattr(runner, "launch", run_held)
    res = await run_ok(runtime, "embedding", {"prompt": [f"Sentence number {i}." for i in range(n)]})
    assert len(res["embeddings"]) == n
    assert sum(sizes) == n and len(sizes) <= 2, sizes
