"""Snapshot writes per turn of a Responses conversation (issue 35): the
``tartlet-kv-snapshot/1`` files (the whole conversation's KV in each turn's
snapshot file) against ``/2`` (snapshot files naming shared page files; a
turn writes only its new pages).

Each round starts a ``tartlet serve`` (the default model) with
``TARTLET_SNAPSHOT_FORMAT`` set to the format, runs one conversation of
``--turns`` turns over ``/v1/responses`` with ``previous_response_id``
(each turn: a short user input, ``--output-tokens`` tokens generated with
``ignore_eos``), and after each turn waits for the snapshot writer (the
server's ``tartlet_snapshot_write_seconds`` counter) and reads the bytes and
seconds (wall and the writer thread's CPU) spent on that turn's snapshot. The formats alternate,
``--rounds`` rounds each; the table gives per turn the median bytes and
writer milliseconds of each format and their ratio (/1 over /2).

Usage: ``.venv/bin/python benchmarks/bench_snapshot_turns.py [--turns 10]
[--rounds 3] [--output-tokens 24]``. Prints a table and one ``JSON:`` line.
Timings depend on the machine and its load; nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import httpx

from common import MODEL, exit_on_signals, report, start_server


def counters(client: httpx.Client, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(client.get(url + "/metrics").text):
        if fam.name.startswith("tartlet_snapshot_"):
            out[fam.name] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return out


def conversation(fmt: str, turns: int, output_tokens: int) -> list[tuple[float, float, float, int]]:
    """(bytes written, writer seconds, writer CPU seconds, tokens held) per turn with format ``fmt``."""
    os.environ["TARTLET_SNAPSHOT_FORMAT"] = fmt
    proc, url = start_server(64)
    try:
        out = []
        with httpx.Client(timeout=300) as client:
            prev = None
            for turn in range(turns):
                before = counters(client, url)
                body = {"model": MODEL, "input": f"Step {turn}: the tool said the answer is {turn * 7}. What next?",
                        "max_output_tokens": output_tokens, "ignore_eos": True}
                if prev:
                    body["previous_response_id"] = prev
                r = client.post(url + "/v1/responses", json=body)
                r.raise_for_status()
                res = r.json()
                prev = res["id"]
                deadline = time.time() + 60
                while True:
                    after = counters(client, url)
                    if after.get("tartlet_snapshot_write_seconds", 0) > before.get("tartlet_snapshot_write_seconds", 0) or time.time() > deadline:
                        break
                    time.sleep(0.02)
                held = res["usage"]["input_tokens"] + res["usage"]["output_tokens"]
                out.append(tuple(after[k] - before.get(k, 0) for k in ("tartlet_snapshot_bytes_written", "tartlet_snapshot_write_seconds",
                                                                       "tartlet_snapshot_write_cpu_seconds")) + (held,))
        return out
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--output-tokens", type=int, default=24)
    a = ap.parse_args()
    exit_on_signals()
    runs: dict[str, list[list[tuple[float, float, float, int]]]] = {"1": [], "2": []}
    for _ in range(a.rounds):
        for fmt in ("1", "2"):
            runs[fmt].append(conversation(fmt, a.turns, a.output_tokens))
    rows, payload = [], []
    for t in range(a.turns):
        b1 = statistics.median(r[t][0] for r in runs["1"])
        b2 = statistics.median(r[t][0] for r in runs["2"])
        s1 = statistics.median(r[t][1] for r in runs["1"]) * 1e3
        s2 = statistics.median(r[t][1] for r in runs["2"]) * 1e3
        c1 = statistics.median(r[t][2] for r in runs["1"]) * 1e3
        c2 = statistics.median(r[t][2] for r in runs["2"]) * 1e3
        held = runs["2"][0][t][3]
        rows.append([t + 1, held, int(b1), int(b2), round(b1 / b2, 2), s1, s2, c1, c2, round(c1 / c2, 2) if c2 else None])
        payload.append({"turn": t + 1, "tokens": held, "bytes_v1": b1, "bytes_v2": b2, "ms_v1": s1, "ms_v2": s2, "cpu_ms_v1": c1, "cpu_ms_v2": c2})
    report(f"Snapshot writes per Responses turn ({a.rounds} alternating rounds, medians)",
           ["turn", "tokens held", "bytes /1", "bytes /2", "x", "writer ms /1", "writer ms /2", "cpu ms /1", "cpu ms /2", "x cpu"],
           rows, {"turns": payload})


if __name__ == "__main__":
    main()
