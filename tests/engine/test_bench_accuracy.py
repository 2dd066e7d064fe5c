"""The accuracy gate's measurement (``benchmarks/bench_accuracy.py``,
issue 38) on the default model over a short stretch of its text (~130
tokens, windows of 64 moved by 32):

* its windows score every text token exactly once;
* its NLL on the float32 engine equals the one computed directly from the
  ``logits`` probe of an inferlet over the same windows (float64
  log-softmax of the same float32 logits, to 1e-9 nats);
* ``--decode`` (a decode step per scored position) gives the prefill NLL;
* 16-bit activations (the quantized engine) and ``act_bits="auto"`` keep
  the NLL within the gate (0.5%) of the float32 reference (measured on
  the script's full text: -0.000% and +0.020%).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from harness import inline_program, run_ok
from test_logits import PROBE, as_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_accuracy  # noqa: E402

WINDOW, STRIDE = 64, 32


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    return inline_program(tmp_path_factory.mktemp("accuracy"), PROBE, "logits_probe")


@pytest.fixture(scope="module")
def ids(engine) -> list[int]:
    out = engine.tokenizer.encode(bench_accuracy.TEXT[:600])
    assert 100 <= len(out) <= 200, len(out)
    return out


def test_windows_score_each_token_once():
    for n, bos in [(1300, False), (1300, True), (100, True), (64, False), (2, False)]:
        ws = bench_accuracy.windows(n, bos, 64, 32)
        scored = [j for _, end, first in ws for j in range(first, end)]
        assert scored == list(range(0 if bos else 1, n)), (n, bos)
        for start, end, first in ws:
            assert end - start <= 64 - bos and start <= first and (first - start + bos >= 32 or start == 0)
    with pytest.raises(ValueError):
        bench_accuracy.windows(100, False, 64, 64)


async def test_nll_equals_logits_probe(runtime, probe, engine, ids):
    got = bench_accuracy.text_nll(engine, ids, WINDOW, STRIDE)
    tok = engine.tokenizer
    bos = [tok.bos_token_id] if tok.add_bos_token else []
    nll: list[float] = []
    for start, end, first in bench_accuracy.windows(len(ids), bool(bos), WINDOW, STRIDE):
        inputs = bos + ids[start:end]
        logits = as_tensor((await run_ok(runtime, probe, {"ids": inputs, "mode": "prefill"}))["logits"])
        logp = torch.log_softmax(logits.double(), -1)
        nll += [-float(logp[len(bos) + j - start - 1, ids[j]]) for j in range(first, end)]
    want = math.fsum(nll) / len(nll)
    print(f"{len(nll)} tokens: NLL {got:.6f} (script) vs {want:.6f} (logits probe)")
    assert len(nll) == len(ids) - (0 if bos else 1)
    assert abs(got - want) <= 1e-9


def test_quantized_activations_within_gate(engine, quant_engine, quant_loaded, ids):
    from tartlet.engine.core.engine import Engine, EngineConfig

    assert quant_engine.cfg.act_bits == 16
    ref = bench_accuracy.text_nll(engine, ids, WINDOW, STRIDE)
    q16 = bench_accuracy.text_nll(quant_engine, ids, WINDOW, STRIDE)
    lm = quant_loaded
    auto = Engine(EngineConfig(kv_cache_mb=16, act_bits="auto"), lm.config, dict(lm.weights), lm.tokenizer)
    try:
        qa = bench_accuracy.text_nll(auto, ids, WINDOW, STRIDE)
    finally:
        auto.close()
    print(f"NLL float32 {ref:.5f}, 16-bit {q16:.5f} ({100 * (q16 / ref - 1):+.3f}%), auto {qa:.5f} ({100 * (qa / ref - 1):+.3f}%)")
    assert abs(q16 / ref - 1) <= bench_accuracy.GATE
    assert abs(qa / ref - 1) <= bench_accuracy.GATE


def test_decode_mode_matches_prefill(engine, ids):
    """``--decode`` (each scored position a decode step of its own) on the
    float32 engine: the same NLL as one prefill pass a window, to rounding."""
    short = ids[:48]
    one_pass = bench_accuracy.text_nll(engine, short, 32, 16)
    steps = bench_accuracy.text_nll(engine, short, 32, 16, decode=True)
    print(f"NLL prefill {one_pass:.6f}, decode steps {steps:.6f}")
    assert abs(one_pass - steps) <= 1e-4
