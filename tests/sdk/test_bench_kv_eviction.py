"""The workloads of ``benchmarks/bench_kv_eviction.py`` (issue 36), built
with the default model's tokenizer (no model run):

* ``prose-q`` (the question inside the prompt) is deterministic for a
  seed, asks each complete section of ``prose``'s prompt once (or a seeded
  choice of them), and every sample is ``prose``'s prompt, then the
  question, then the scored answer: the answer quotes the sentence its
  ``source`` span holds, earlier in the same prompt;
* ``prose`` still builds the same prompt (its prompt is ``prose-q``'s
  document);
* a run's figures over samples: NLL per scored token of all samples, one
  sample's figures unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_kv_eviction as bench  # noqa: E402

PREFIX = 1024


@pytest.fixture(scope="module")
def samples(tokenizer) -> list[bench.Sample]:
    return bench.reference_qa_in_prompt(tokenizer.encode, 7, PREFIX)


def test_prose_q_is_deterministic(tokenizer, samples):
    again = bench.build_samples("prose-q", tokenizer.encode, 7, PREFIX, 256, 0)
    assert [(s.prompt, s.cont, s.scored, s.spans) for s in again] == \
        [(s.prompt, s.cont, s.scored, s.spans) for s in samples]
    other = bench.reference_qa_in_prompt(tokenizer.encode, 11, PREFIX)
    assert other[0].prompt[:PREFIX] != samples[0].prompt[:PREFIX]  # another seed, other sections
    three = bench.reference_qa_in_prompt(tokenizer.encode, 7, PREFIX, samples=3)
    assert [s.prompt for s in three] == [s.prompt for s in bench.reference_qa_in_prompt(tokenizer.encode, 7, PREFIX, 3)]
    assert len(three) == 3 and len({tuple(s.prompt) for s in three}) == 3
    assert {tuple(s.prompt) for s in three} <= {tuple(s.prompt) for s in samples}


def test_prose_q_asks_each_complete_section_before_its_scored_answer(tokenizer, samples):
    body, titles = bench.reference_prompt(tokenizer.encode, 7, PREFIX)
    prose_prompt, _, _ = bench.reference_qa(tokenizer.encode, 7, PREFIX, 256)
    assert body == prose_prompt and len(body) == PREFIX
    assert len(samples) == len(titles) >= 5
    decode = tokenizer.decode
    for s, (title, text, start) in zip(samples, titles):
        q0, q1 = s.spans["question"]
        assert s.prompt[:q0] == body and q1 == len(s.prompt)  # the question closes the prompt
        assert decode(s.prompt[q0:q1]) == f"Q: How does the section on {title} begin?\nA:"
        assert s.scored == list(range(len(s.cont))) and len(s.cont) >= 10  # the whole answer is scored
        sentence = bench.opening(text)
        assert decode(s.cont) == f" {sentence}\n\n"
        a, b = s.spans["source"]
        assert start < a < b < q0 and decode(s.prompt[a:b]) == sentence  # what the answer quotes, earlier
        a, b = s.spans["section"]
        assert a == start and decode(s.prompt[a:b]) == f"Section: {title}\n{text}\n\n"
        a, b = s.spans["title"]
        assert a == start and decode(s.prompt[a:b]) == f"Section: {title}\n" and b == s.spans["source"][0]
        assert s.spans["document"] == (0, PREFIX)


def test_kept_fractions(samples):
    s = samples[0]
    assert bench.kept_fractions(s, None) == dict.fromkeys(s.spans, 1.0)
    a, b = s.spans["source"]
    got = bench.kept_fractions(s, list(range(a, a + (b - a) // 2)))
    assert got["source"] == ((b - a) // 2) / (b - a) and got["question"] == 0.0


def test_aggregate_weights_tokens_and_keeps_one_sample():
    one = {"budget": 640, "steps": 255, "scored": 148, "mean_pages": 70.0, "live_pages": 71, "tok_s": 50.0,
           "kept": 640, "first4_kept": 4, "lp_sum": -148 * 0.5}
    assert bench.aggregate([one]) == {"budget": 640, "mean_pages": 70.0, "live_pages": 71, "tok_s": 50.0, "kept": 640,
                                      "first4_kept": 4, "nll": 0.5}
    two = {**one, "steps": 85, "scored": 52, "mean_pages": 10.0, "tok_s": 25.0, "first4_kept": 2, "lp_sum": -52 * 2.0}
    got = bench.aggregate([one, two])
    assert got["nll"] == pytest.approx((148 * 0.5 + 52 * 2.0) / 200)
    assert got["mean_pages"] == pytest.approx((255 * 70 + 85 * 10) / 340)
    assert got["tok_s"] == pytest.approx(340 / (255 / 50 + 85 / 25)) and got["first4_kept"] == 2
