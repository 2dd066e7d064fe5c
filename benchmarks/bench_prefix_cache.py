"""Prefix caching: time to first token (TTFT) for requests sharing a long
system prompt, with and without the ``prefix-cache`` inferlet.

``--requests`` requests (default 16) share a system prompt of about
``--system-tokens`` tokens (default 1,000) and each ask their own question.
All requests of a mode are launched at once on one engine, loaded once; the
modes run one after the other in the same process, with the engine's cached
pages evicted in between:

* ``no-reuse``: ``text-completion``; each system prompt starts with a
  request number, so nothing can be shared (the cost without any caching);
* ``auto-prefix``: ``text-completion`` with the identical system prompt; the
  engine's automatic prefix cache (content-addressed pages) may share the
  full pages of the prompt among requests that find them committed;
* ``prefix-cache``: one ``prefix-cache`` instance prefills and saves the
  system prompt as a snapshot (its time is the ``build`` row), then every
  request is a ``prefix-cache`` instance that opens the snapshot.

Columns: TTFT (launch to first streamed text, seconds) median / p90 / max,
wall time of the whole mode, and prefill tokens the engine computed
(scheduler ``tokens_computed`` minus single-token steps) plus tokens it
reused from the prefix cache. Ratios are against ``no-reuse``.

Usage: ``.venv/bin/python benchmarks/bench_prefix_cache.py [--quick]
[--requests N] [--system-tokens N] [--max-tokens N]``. Prints a table and
one ``JSON:`` line. Timings depend on the machine and its load; nothing is
asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time

from common import load_engine, report

QUESTIONS = [
    "When do you open?", "Do you sell bread?", "Can I order a cake?", "Where are you?",
    "Do you deliver?", "Is there parking?", "Do you have gluten-free options?", "Can I pay by card?",
    "Are you open on Sunday?", "Do you sell coffee?", "Can I book a table?", "Do you cater events?",
    "What is your best pastry?", "Do you have vegan cakes?", "How much is a baguette?", "Do you hire staff?",
]


def system_prompt(tokenizer, n_tokens: int) -> str:
    """A help-desk system prompt of at least ``n_tokens`` tokens."""
    rules = ["You are the help desk of the Tartlet bakery. Follow every rule below."]
    i = 0
    while len(tokenizer.encode(" ".join(rules))) < n_tokens:
        i += 1
        rules.append(f"Rule {i}: be polite, answer in one sentence, and mention the opening hours (7 to 19) when relevant.")
    return " ".join(rules)


async def run_mode(state, program, args_list):
    """Launch every request at once; returns (results, ttfts, wall seconds)."""
    from tartlet.host.session import Session
    from tartlet.runtime.instance import Status
    from tartlet.runtime.native import NativeRuntime

    rt = NativeRuntime(state)
    first: list[float | None] = [None] * len(args_list)
    starts: list[float] = []
    insts = []
    t0 = time.perf_counter()
    for i, a in enumerate(args_list):
        s = Session()

        def on_msg(msg, i=i):
            if first[i] is None and msg:
                first[i] = time.perf_counter()

        s.listen(on_msg)
        starts.append(time.perf_counter())
        insts.append(rt.launch(program, a, s))
    for inst in insts:
        await inst.wait()
        if inst.status is not Status.FINISHED:
            raise RuntimeError(f"{program.name}: {inst.status.value}: {inst.error}")
    wall = time.perf_counter() - t0
    ttft = [(f if f is not None else time.perf_counter()) - s for f, s in zip(first, starts)]
    return [i.result for i in insts], ttft, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens generated per answer")
    a = ap.parse_args()
    if a.quick:
        a.requests, a.system_tokens, a.max_tokens = 2, 80, 2

    from tartlet.host.state import HostState
    from tartlet.runtime.program import find_program

    engine = load_engine(kv_cache_mb=2048)  # no-reuse holds 16 x ~1,000-token prompts at once
    state = HostState()
    state.add_engine(engine)
    sched = engine.scheduler
    system = system_prompt(engine.tokenizer, a.system_tokens)
    sys_tokens = len(engine.tokenizer.encode(system))
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(a.requests)]
    tc, pc = find_program("text-completion"), find_program("prefix-cache")

    def measure(name, program, args_list):
        sched.command(engine.pool.evict_all_cached).result()
        st = sched.stats
        k0, d0, r0 = st.tokens_computed, st.decode_steps, st.prefix_tokens_reused
        res, ttft, wall = asyncio.run(run_mode(state, program, args_list))
        prefill = (st.tokens_computed - k0) - (st.decode_steps - d0)
        return {"mode": name, "requests": len(args_list), "ttft_median_s": statistics.median(ttft),
                "ttft_p90_s": sorted(ttft)[math.ceil(0.9 * len(ttft)) - 1], "ttft_max_s": max(ttft), "wall_s": wall,
                "prefill_computed": prefill, "prefix_reused": st.prefix_tokens_reused - r0}, res

    results = []
    r, _ = measure("no-reuse", tc, [{"system": f"Request {i}. " + system, "prompt": q, "max_tokens": a.max_tokens} for i, q in enumerate(questions)])
    results.append(r)
    r, _ = measure("auto-prefix", tc, [{"system": system, "prompt": q, "max_tokens": a.max_tokens} for q in questions])
    results.append(r)
    snap = "bench-prefix-cache"
    base = {"system": system, "snapshot": snap, "max_tokens": a.max_tokens}
    r, res = measure("build", pc, [dict(base, questions=[questions[0]])])
    assert res[0]["created"]
    results.append(r)
    r, res = measure("prefix-cache", pc, [dict(base, questions=[q]) for q in questions])
    r["prefill_saved_reported"] = sum(x["prefill_tokens_saved"] for x in res)
    results.append(r)
    # clean up the snapshot
    from tartlet.host.api import HostApi

    HostApi(state).snapshot_delete(None, snap)
    engine.close()

    ref = results[0]
    rows = []
    for r in results:
        r["ttft_ratio"] = r["ttft_median_s"] / ref["ttft_median_s"] if r["mode"] != "build" else None
        rows.append([r["mode"], r["requests"], r["ttft_median_s"], r["ttft_p90_s"], r["ttft_max_s"], r["wall_s"],
                     r["prefill_computed"], r["prefix_reused"], "-" if r["ttft_ratio"] is None else f"{r['ttft_ratio']:.2f}"])
    report(
        f"Prefix caching: {a.requests} requests, {sys_tokens}-token system prompt, {a.max_tokens} tokens each",
        ["mode", "reqs", "ttft_med_s", "ttft_p90_s", "ttft_max_s", "wall_s", "prefill_tok", "reused_tok", "ttft_vs_no_reuse"],
        rows,
        {"bench": "prefix_cache", "requests": a.requests, "system_tokens": sys_tokens, "max_tokens": a.max_tokens, "results": results},
    )


if __name__ == "__main__":
    main()
