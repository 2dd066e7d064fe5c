"""Shared helpers of the benchmarks: engine and reference loading, timing,
and printing a table plus one JSON line."""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load_engine(**cfg: Any):
    """A started :class:`Engine` on the default model with ``EngineConfig``'s
    defaults (its GGUF weights kept quantized, float32 compute) unless ``cfg``
    says otherwise (``dtype="float32"``: the dequantized reference path)."""
    from tartlet.engine.engine import Engine, EngineConfig

    return Engine.load(EngineConfig(**cfg))


def load_hf_reference(dtype: str = "float32"):
    """transformers' model and tokenizer dequantized from the same GGUF."""
    import torch
    import transformers

    from tartlet.engine.model_store import DEFAULT_MODEL, resolve

    path = resolve(DEFAULT_MODEL)
    kw = dict(gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=getattr(torch, dtype), **kw).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), **kw)
    return model, tok


def run_inferlets(engine: Any, program: str, args_list: list[dict[str, Any]]) -> tuple[list[Any], float]:
    """Run one instance per args dict concurrently on ``engine``; returns the
    results and the wall time in seconds."""
    from tartlet.host.state import HostState
    from tartlet.runtime.instance import Status
    from tartlet.runtime.native import NativeRuntime
    from tartlet.runtime.program import find_program

    state = HostState()
    state.add_engine(engine)
    prog = find_program(program)

    async def go() -> list[Any]:
        rt = NativeRuntime(state)
        insts = [rt.launch(prog, a) for a in args_list]
        for i in insts:
            await i.wait()
            if i.status is not Status.FINISHED:
                raise RuntimeError(f"{program} {i.status.value}: {i.error}")
        return [i.result for i in insts]

    t0 = time.perf_counter()
    res = asyncio.run(go())
    return res, time.perf_counter() - t0


def paired(ours: Callable[[], float], theirs: Callable[[], float], repeats: int) -> tuple[float, float, float]:
    """Run the two systems alternately ``repeats`` times (ours, theirs, ours,
    ...), so that a drift in machine speed hits both; returns the median
    seconds of each and the median of the per-pair ratios theirs/ours."""
    pairs = [(ours(), theirs()) for _ in range(repeats)]
    a, b = zip(*pairs)
    return statistics.median(a), statistics.median(b), statistics.median(y / x for x, y in pairs)


def report(title: str, columns: list[str], rows: list[list[Any]], payload: dict[str, Any] | None) -> None:
    """Print a fixed-width table, then ``JSON: {...}`` on one line (none
    when ``payload`` is None: a later table carries it)."""
    widths = [max(len(str(c)), *(len(_fmt(r[i])) for r in rows)) for i, c in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(str(c).ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(_fmt(v).ljust(w) for v, w in zip(r, widths)))
    if payload is not None:
        print("JSON: " + json.dumps(payload))


def _fmt(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)
