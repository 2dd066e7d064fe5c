"""Speculative decoding on a repetitive task: tokens/s against plain greedy.

The task rewrites a given code block, so most of the output copies the
prompt and the n-gram (prompt lookup) drafter guesses well. On one engine,
loaded once, each repeat runs in turn:

* ``greedy``: plain greedy decoding (``text-completion``);
* ``ngram``: the ``speculative-decoding`` inferlet (n-gram drafter);
* ``jacobi``: the ``jacobi-decoding`` inferlet (window ``--window``).

Each row reports the median wall time over ``--repeats`` runs, tokens/s,
forward passes, tokens per pass, the drafter's acceptance rate, and whether
the tokens equal plain greedy's (they must). ``speedup`` is greedy's median
time over the row's.

Usage: ``.venv/bin/python benchmarks/bench_speculative.py [--quick]
[--max-tokens N] [--repeats R] [--max-draft N] [--window N]``. Prints a
table and one ``JSON:`` line. Timings depend on the machine and its load;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics

from common import load_engine, report, run_inferlets

CODE = '''def summarize_orders(orders, min_total=0.0, currency="EUR"):
    """Group orders by customer and return totals above a threshold."""
    totals = {}
    counts = {}
    for order in orders:
        if order["currency"] != currency:
            continue
        customer = order["customer"]
        totals[customer] = totals.get(customer, 0.0) + order["amount"]
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in sorted(totals.items()):
        if total >= min_total:
            result.append({"customer": customer, "total": round(total, 2), "orders": counts[customer]})
    return result
'''

PROMPT = "Rewrite the following Python function, renaming the variable `totals` to `sums` everywhere. Output only the code.\n\n" + CODE


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--window", type=int, default=8, help="Jacobi window")
    a = ap.parse_args()
    if a.quick:
        a.max_tokens, a.repeats = 12, 1

    engine = load_engine(kv_cache_mb=512)
    runs = {"greedy": [], "ngram": [], "jacobi": []}
    last = {}
    for _ in range(a.repeats):
        for name, prog, args in (
            ("greedy", "text-completion", {"prompt": PROMPT, "max_tokens": a.max_tokens}),
            ("ngram", "speculative-decoding", {"prompt": PROMPT, "max_tokens": a.max_tokens, "max_draft": a.max_draft}),
            ("jacobi", "jacobi-decoding", {"prompt": PROMPT, "max_tokens": a.max_tokens, "window": a.window}),
        ):
            (res,), dt = run_inferlets(engine, prog, [args])
            runs[name].append(dt)
            last[name] = res
    engine.close()

    ref = last["greedy"]["tokens"]
    base = statistics.median(runs["greedy"])
    rows, results = [], []
    for name, res in last.items():
        t = statistics.median(runs[name])
        n = len(res["tokens"])
        passes = res.get("passes", n)
        acc = res.get("acceptance_rate")
        r = {"mode": name, "tokens": n, "seconds": t, "tokens_per_s": n / t, "passes": passes,
             "tokens_per_pass": n / passes, "acceptance_rate": acc, "identical": res["tokens"] == ref, "speedup": base / t}
        results.append(r)
        rows.append([name, n, t, r["tokens_per_s"], passes, r["tokens_per_pass"], "-" if acc is None else f"{acc:.2f}",
                     r["identical"], f"{r['speedup']:.2f}"])
    report(
        f"Speculative decoding: rewrite a {len(CODE.splitlines())}-line function, median of {a.repeats}",
        ["mode", "tokens", "seconds", "tok/s", "passes", "tok/pass", "accept", "identical", "speedup"],
        rows,
        {"bench": "speculative", "max_tokens": a.max_tokens, "repeats": a.repeats, "max_draft": a.max_draft, "window": a.window, "results": results},
    )


if __name__ == "__main__":
    main()
