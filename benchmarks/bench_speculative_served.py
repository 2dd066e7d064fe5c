"""Speculative decoding in the served path: a grounded workload through the
OpenAI chat route, ``[[models]] speculative`` on against off.

Two ``tartlet serve`` processes on the default model, identical but for
``speculative = { method = "ngram", max_draft, max_ngram, min_ngram,
max_batch }`` (docs/server.md), take the same greedy chat requests in
alternating rounds (off, on, off, on, ...), so a drift in machine speed hits
both (and which side goes first alternates too, after a pause). The workload is grounded: each request gives a passage and asks to
repeat or lightly edit it, so the output copies the prompt (high n-gram
overlap). At each concurrency ``c`` a round runs ``c`` streamed requests at
once, ``--requests-per-load`` times in a row for ``c`` 1 (so one load lasts
long enough to time); throughput is completion tokens over wall time. The
outputs of both servers must be equal (``identical``); ``speedup`` is the
median over rounds of on/off tokens/s. Timings depend on the machine and
its load; nothing is asserted.

Usage: ``.venv/bin/python benchmarks/bench_speculative_served.py [--quick]
[--rounds R] [--concurrency 1,16] [--max-tokens N] [--max-draft K]
[--max-ngram N] [--min-ngram M] [--max-batch B]``. Prints a table and one
``JSON:`` line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import httpx

from common import GROUNDED_PROMPTS as PROMPTS
from common import MODEL, report, start_server


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed greedy chat completion: its text, completion tokens and times (s)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    text, usage = [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(str(ev["error"]))
            usage = ev.get("usage") or usage
            for ch in ev.get("choices") or []:
                if (ch.get("delta") or {}).get("content"):
                    first = first or time.perf_counter()
                    text.append(ch["delta"]["content"])
    end = time.perf_counter()
    assert usage is not None, "no usage chunk"
    return {"text": "".join(text), "tokens": int(usage["completion_tokens"]), "ttft": (first or end) - t0, "seconds": end - t0}


async def load(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """``prompts`` in waves of ``concurrency`` at once; aggregate tokens/s."""
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=concurrency + 4)) as c:
        t0 = time.perf_counter()
        rs: list[dict[str, Any]] = []
        for i in range(0, len(prompts), concurrency):
            rs += await asyncio.gather(*(one_request(c, url, p, max_tokens) for p in prompts[i : i + concurrency]))
        wall = time.perf_counter() - t0
    return {"tok_s": sum(r["tokens"] for r in rs) / wall, "tokens": sum(r["tokens"] for r in rs), "wall_s": wall,
            "ttft_p50": statistics.median(r["ttft"] for r in rs), "texts": [r["text"] for r in rs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--concurrency", default="1,16", help="comma-separated")
    ap.add_argument("--requests-per-load", type=int, default=4, help="sequential requests of a 1-concurrent load")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--max-ngram", type=int, default=3)
    ap.add_argument("--min-ngram", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--pause", type=float, default=2.0, help="seconds of rest before each load")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.concurrency, a.requests_per_load, a.max_tokens = 1, "1,4", 1, 24
    conc = [int(x) for x in a.concurrency.split(",") if x.strip()]
    spec = {"method": "ngram", "max_draft": a.max_draft, "max_ngram": a.max_ngram, "min_ngram": a.min_ngram,
            "max_batch": a.max_batch}
    servers = {"off": start_server(a.kv_cache_mb), "on": start_server(a.kv_cache_mb, model_options={"speculative": spec})}
    try:
        urls = {k: url for k, (_, url) in servers.items()}
        for url in urls.values():  # warm-up (untimed): first calls, prefix cache of the instructions
            asyncio.run(load(url, PROMPTS[: max(conc)], max(conc), 16))
        runs: dict[int, dict[str, list[dict[str, Any]]]] = {c: {"off": [], "on": []} for c in conc}
        for rnd in range(a.rounds):
            for c in conc:
                prompts = [PROMPTS[(rnd * 7 + i) % len(PROMPTS)] for i in range(c if c > 1 else a.requests_per_load)]
                for side in ("off", "on") if rnd % 2 == 0 else ("on", "off"):  # neither always runs second
                    time.sleep(a.pause)  # the last load's trailing work (OpenMP threads spinning down) is over
                    r = asyncio.run(load(urls[side], prompts, c, a.max_tokens))
                    runs[c][side].append(r)
                    print(f"round {rnd + 1} {c:>3} concurrent {side:3} {r['tok_s']:7.1f} tok/s ({r['tokens']} tokens)", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    rows, results = [], []
    for c in conc:
        off, on = runs[c]["off"], runs[c]["on"]
        same = all(x["texts"] == y["texts"] for x, y in zip(off, on))
        t_off, t_on = statistics.median(r["tok_s"] for r in off), statistics.median(r["tok_s"] for r in on)
        speedup = statistics.median(y["tok_s"] / x["tok_s"] for x, y in zip(off, on))
        rows.append([c, round(t_off, 1), round(t_on, 1), round(speedup, 2), same])
        results.append({"concurrency": c, "tok_s_off": t_off, "tok_s_on": t_on, "speedup": speedup, "identical": same})
    report(f"Served speculative decoding, grounded chat workload, median of {a.rounds} alternating rounds",
           ["concurrent", "tok/s off", "tok/s on", "speedup", "identical"], rows,
           {"bench": "speculative_served", "speculative": spec, "max_tokens": a.max_tokens, "rounds": a.rounds,
            "results": results})


if __name__ == "__main__":
    main()
