"""Decode speed with the attention-score probe off and on (issue 36 part 1).

Each of ``B`` contexts (batch 1 and 16 by default) holds a ``--context``-token
prompt; every step runs one forward pass per context (one decode token,
greedy) submitted together, so the ``B`` rows share one model call, as
concurrent inferlets' steps do. With the probe on, every pass asks for the
attention mass of every layer per position (``reduce="sum"``, the H2O
read-out): the C kernels (or the fused decode step) copy their softmax
weights out, the model runner adds them into each request's scores and the
scheduler turns them into an ``AttentionScores`` per pass. Off and on
alternate step by step (each run decodes fresh forks of the same prompts
in both modes), so drifts in machine speed hit both; the table shows the
median tokens/s of each over the runs and the median of the per-run
ratios on/off. Ends with one ``JSON:`` line.

    .venv/bin/python benchmarks/bench_attention_probe.py                  # B = 1, 16; 256-token contexts
    .venv/bin/python benchmarks/bench_attention_probe.py --quick
    .venv/bin/python benchmarks/bench_attention_probe.py --modes off      # the probe-off path only

``--modes off`` imports nothing of the probe, so the same script measures a
tree without it (``PYTHONPATH=/path/to/old/tree``) for a before/after
comparison of the probe-off path. ``--dtype float32`` runs the float32
reference model (op-by-op path, no fused step). Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from common import load_engine, report

PROMPT = ("The history of the printing press begins with woodblock printing in East Asia, long before movable type "
          "reached Europe, where Gutenberg's press changed how books, pamphlets and newspapers were made and read. ")


def step(engine: Any, seqs: list[Any], toks: list[int], probe: Any) -> tuple[list[int], float]:
    """One greedy decode step of ``seqs`` (one pass per sequence, submitted
    together from the scheduler thread: one model call); the next tokens and
    the seconds it took."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    sch = engine.scheduler
    kw = {} if probe is None else {"probe": probe}
    t0 = time.perf_counter()
    reqs = [ForwardRequest(s, [t], outputs=[OutputSlot(0, SamplerSpec())], **kw) for s, t in zip(seqs, toks)]
    futs = sch.command(lambda: [sch.submit(r) for r in reqs]).result(timeout=600)
    res = [f.result(timeout=600) for f in futs]
    return [int(r[0]) for r in res], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens per context")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per run")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--modes", default="off,on", help="off, on, or both (alternating)")
    ap.add_argument("--dtype", default=None, help="float32: the dequantized reference model")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.quick:
        a.batches, a.context, a.steps, a.repeats = "1,2", 32, 4, 1
    modes = a.modes.split(",")

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    cfg: dict[str, Any] = {"kv_cache_mb": 512, "threads": a.threads}
    if a.dtype:
        cfg["dtype"] = a.dtype
    engine = load_engine(**cfg)
    probe = None
    if "on" in modes:
        from tartlet.engine.core.attention_probe import AttentionProbeSpec

        probe = AttentionProbeSpec(tuple(range(engine.config.num_hidden_layers)))
    sch = engine.scheduler
    sch.batch_wait_s = 0.0  # each step's passes are queued at once (step()): no round waits for stragglers
    ids = engine.tokenizer.encode(PROMPT * (a.context // 30 + 2))
    rows, payload = [], {"threads": torch.get_num_threads(), "context": a.context, "steps": a.steps, "results": []}
    try:
        for B in [int(x) for x in a.batches.split(",")]:
            from tartlet.engine.core.requests import ForwardRequest
            from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

            base = [engine.new_sequence() for _ in range(B)]
            first = []
            for i, s in enumerate(base):  # distinct prompts: no page shared between contexts
                toks = [ids[i % 50]] + ids[: a.context - 1]
                first.append(int(sch.submit(ForwardRequest(s, toks, outputs=[OutputSlot(len(toks) - 1, SamplerSpec())]))
                                 .result(timeout=600)[0]))

            def one() -> dict[str, float]:
                """A run: each mode's forks of the prompts decode ``steps``
                steps, the modes alternating step by step; seconds per mode."""
                seqs = {m: [sch.command(s.fork).result(timeout=60) for s in base] for m in modes}
                toks = {m: list(first) for m in modes}
                spent = {m: 0.0 for m in modes}
                try:
                    for _ in range(a.steps):
                        for m in modes:
                            toks[m], dt = step(engine, seqs[m], toks[m], probe if m == "on" else None)
                            spent[m] += dt
                finally:
                    for ss in seqs.values():
                        for s in ss:
                            sch.command(s.free).result(timeout=60)
                return spent

            one()  # warm-up
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(a.repeats):
                for m, dt in one().items():
                    times[m].append(dt)
            tps = {m: B * a.steps / statistics.median(ts) for m, ts in times.items()}
            ratio = (statistics.median(off / on for off, on in zip(times["off"], times["on"]))
                     if len(modes) == 2 else None)
            rows.append([B, *(f"{tps[m]:.1f}" for m in modes), "" if ratio is None else f"{ratio:.3f}"])
            payload["results"].append({"batch": B, "tokens_per_s": tps, "on_over_off": ratio,
                                       "seconds": times})
            for s in base:
                sch.command(s.free).result(timeout=60)
    finally:
        engine.close()
    cols = ["batch", *(f"tok/s probe {m}" for m in modes), "on/off speed"]
    report(f"Decode with the attention probe ({a.context}-token contexts, {a.steps} steps, all layers, per token)",
           cols, rows, payload)


if __name__ == "__main__":
    main()
