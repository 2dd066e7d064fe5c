"""Standard inferlets as WASM components give the same output as their
native runs (greedy or seeded, short generations). A representative subset
keeps the suite fast (each new component costs a ~10 s build and a ~10 s
compile on a cold cache): forks + seeded sampling, distribution probes,
logprob/entropy probes, hidden-state slots, and grammar matchers over the WIT."""

from __future__ import annotations

import pytest

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from harness import assert_no_leaks, run  # noqa: E402
from tartlet.runtime.instance import Status  # noqa: E402
from tartlet.runtime.program import list_programs  # noqa: E402
from tartlet.runtime.wasm import WasmRuntime  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.wasm]  # every bundled inferlet built into a component

CASES = {
    "parallel-generation": {"prompt": "Name a fruit.", "n": 3, "max_tokens": 8, "seed": 7},
    "beam-search": {"prompt": "The capital of France is", "k": 2, "max_tokens": 6},
    "logit-probe": {"prompt": "Is the sky blue? Answer yes or no.", "k": 5},
    "embedding": {"prompt": ["A cat sat on the mat.", "Two dogs."], "pooling": "mean", "layer": -3},  # hidden slots over the WIT
    "json-output": {"question": "Give a color.", "schema": {"type": "object", "properties": {"color": {"type": "string"}}, "required": ["color"]}, "max_tokens": 24},
}
AVAILABLE = list_programs()


@pytest.fixture(scope="module")
def wasm_rt(host_state):
    return WasmRuntime(host_state)


@pytest.mark.parametrize("name", [n for n in CASES if n in AVAILABLE])
async def test_inferlet_as_component_matches_native(name, runtime, wasm_rt, host_state):
    args = CASES[name]
    native = await run(runtime, name, args)
    assert native.status is Status.FINISHED, native.error
    sandboxed = await run(wasm_rt, AVAILABLE[name], args)
    assert sandboxed.status is Status.FINISHED, f"{sandboxed.error}\n{sandboxed.traceback}"
    # tokens and text exactly; floats (log-probs, scores) to 1e-4: batched
    # kernels give float noise between any two runs, native ones included
    assert _approx_equal(sandboxed.result, _jsonish(native.result))
    assert sandboxed.output == native.output
    assert_no_leaks(host_state)


def _approx_equal(a, b) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys()
        return all(_approx_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b)
        return all(_approx_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float) or isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
        return True
    assert a == b
    return True


def _jsonish(v):
    """A native result as it looks after the JSON trip of a component."""
    import json

    return json.loads(json.dumps(v))
