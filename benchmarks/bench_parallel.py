"""Parallel generation: N forks of one prompt against N sequential runs.

On one engine, loaded once, each repeat runs in turn:

* ``forks``: one ``parallel-generation`` instance: the prompt is prefilled
  once and ``--n`` forks (sharing its pages) decode concurrently in batches;
* ``sequential``: ``--n`` ``parallel-generation`` instances with ``n = 1``,
  one after the other, fork ``i``'s seed each, so the outputs are the same
  tokens (checked) and only the scheduling differs.

Every generation runs exactly ``--max-tokens`` tokens (``ignore_eos``).
Cached pages are evicted before each mode; within ``sequential`` the
engine's automatic prefix cache lets later runs reuse the prompt's full
pages, as it would for independent requests.
Columns: median wall seconds over ``--repeats``, generated tokens/s, model
calls and tokens computed by the engine in the last repeat, and the speedup
of the forks over the sequential runs.

Usage: ``.venv/bin/python benchmarks/bench_parallel.py [--quick] [--n N]
[--max-tokens N] [--repeats R]``. Prints a table and one ``JSON:`` line.
Timings depend on the machine and its load; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics

from common import load_engine, report, run_inferlets

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if a.quick:
        a.n, a.max_tokens, a.repeats = 2, 4, 1

    engine = load_engine(kv_cache_mb=512)
    st = engine.scheduler.stats
    common = {"prompt": PROMPT, "max_tokens": a.max_tokens, "ignore_eos": True, "temperature": 0.8}
    times = {"forks": [], "sequential": []}
    counters = {}
    outputs = {}
    evict = lambda: engine.scheduler.command(engine.pool.evict_all_cached).result()  # noqa: E731
    for _ in range(a.repeats):
        evict()
        c0, k0 = st.model_calls, st.tokens_computed
        (res,), dt = run_inferlets(engine, "parallel-generation", [dict(common, n=a.n, seed=0)])
        times["forks"].append(dt)
        counters["forks"] = (st.model_calls - c0, st.tokens_computed - k0)
        outputs["forks"] = res["tokens"]

        evict()
        c0, k0 = st.model_calls, st.tokens_computed
        dt, toks = 0.0, []
        for i in range(a.n):
            (r,), t = run_inferlets(engine, "parallel-generation", [dict(common, n=1, seed=i)])
            dt += t
            toks += r["tokens"]
        times["sequential"].append(dt)
        counters["sequential"] = (st.model_calls - c0, st.tokens_computed - k0)
        outputs["sequential"] = toks
    engine.close()

    total = a.n * a.max_tokens
    seq = statistics.median(times["sequential"])
    identical = outputs["forks"] == outputs["sequential"]
    rows, results = [], []
    for name in ("sequential", "forks"):
        t = statistics.median(times[name])
        calls, computed = counters[name]
        r = {"mode": name, "generations": a.n, "tokens": total, "seconds": t, "tokens_per_s": total / t,
             "model_calls": calls, "tokens_computed": computed, "speedup": seq / t}
        results.append(r)
        rows.append([name, a.n, total, t, r["tokens_per_s"], calls, computed, f"{r['speedup']:.2f}"])
    report(
        f"Parallel generation: {a.n} x {a.max_tokens} tokens, median of {a.repeats} (same tokens both ways: {identical})",
        ["mode", "gens", "tokens", "seconds", "tok/s", "model_calls", "computed", "speedup"],
        rows,
        {"bench": "parallel", "n": a.n, "max_tokens": a.max_tokens, "repeats": a.repeats, "identical": identical, "results": results},
    )


if __name__ == "__main__":
    main()
