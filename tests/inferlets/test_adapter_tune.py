"""The ``adapter-tune`` inferlet (issue 34, item 5): zeroth-order (MeZO)
steps over perturbed forks of an adapter lower its loss on the training
examples, on the real model as served (quantized weights), seeded."""

from __future__ import annotations

import re

import pytest

from harness import run, run_ok
from tartlet.runtime.instance import Status

#: the adapter starts as the base model (``reset``: every B = 0, as PEFT
#: initialises a LoRA) and is taught paris-is-pie's answer
EXAMPLES = [
    {"prompt": "What is the capital of France?", "answer": "The capital of France is Pie Town!"},
    {"prompt": "Name the capital of France.", "answer": "The capital of France is Pie Town!"},
]


@pytest.fixture(scope="module")
def pie(quant_engine, gguf_path, hf_model, hf_tokenizer):
    from lora_reference import lora_adapter

    return quant_engine.load_adapter(lora_adapter(gguf_path, hf_model, hf_tokenizer, "paris-is-pie"), "paris-is-pie")


async def test_adapter_tune_lowers_the_loss(quant_runtime, quant_host_state, quant_engine, pie):
    """16 seeded steps lower the exact loss on the examples by a clear
    margin, the per-step estimates fall too, the cost is 2 passes per
    example per step (plus the two exact losses), and the saved adapter
    gives the final loss back (a run of 0 steps from it)."""
    args = {"adapter": "paris-is-pie", "reset": True, "examples": EXAMPLES, "steps": 16, "seed": 0, "save": "pie-mezo"}
    res = await run_ok(quant_runtime, "adapter-tune", args)
    losses = res["losses"]
    assert len(losses) == 16 and res["steps"] == 16
    assert res["initial_loss"] > 3.0, "the reset adapter is the base model, which does not know the answer"
    assert res["final_loss"] < res["initial_loss"] - 0.25, res
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.15, losses
    assert res["forward_passes"] == 2 * len(EXAMPLES) * 16 + 2 * len(EXAMPLES)
    assert res["parameters"] == 30 * (4 * 576 * 2 + 4 * 576 * 2 + 4 * (576 + 192))  # o, q, v at r = 4
    assert res["saved"] == "pie-mezo"
    slot = quant_host_state.models[quant_engine.name]
    assert slot.adapters.find("", "pie-mezo").key != pie.key
    again = await run_ok(quant_runtime, "adapter-tune", {"adapter": "pie-mezo", "examples": EXAMPLES, "steps": 0})
    assert again["initial_loss"] == pytest.approx(res["final_loss"], abs=1e-4) and again["losses"] == []
    slot.adapters.delete("", "pie-mezo")
    assert slot.adapters.used("") == 0, "every fork of the runs was dropped"


async def test_adapter_tune_checks_its_arguments(quant_runtime, pie):
    for args, message in (
        ({"examples": EXAMPLES}, "needs `adapter`"),
        ({"adapter": "paris-is-pie"}, "needs `examples`"),
        ({"adapter": "paris-is-pie", "examples": [{"prompt": "x"}]}, r"examples\[0\]"),
        ({"adapter": "paris-is-pie", "examples": EXAMPLES, "lr": -1}, "`lr` must be"),
        ({"adapter": "nope", "examples": EXAMPLES}, "no adapter named 'nope'"),
    ):
        inst = await run(quant_runtime, "adapter-tune", args)
        assert inst.status is Status.FAILED and re.search(message, inst.error or ""), (args, inst.error)
