"""Agent throughput: an inferlet in the server vs a client over the OpenAI API.

One ReAct-style agent loop, run three ways on the same ``tartlet serve``
process, alternating round by round (the VM's speed drifts by 25% and more
within minutes, so only ratios from one round are compared):

* **inferlet, native**: the agent installed in the server (trusted Python,
  asyncio); it calls the tools from inside the server (``tartlet.sdk.http``)
  and keeps its KV cache across steps;
* **inferlet, sandboxed**: the same source uploaded by the client, so run
  as a WASM component (the server's default for uploads);
* **client**: the same loop driven over ``/v1/chat/completions`` (prefix
  caching on, as always): each step re-sends the conversation, and the
  client calls the tools itself.

Every thought is exactly ``--thought-tokens`` long (``eos=False`` in the
inferlet, ``ignore_eos`` over the API), so all modes generate the same
tokens. Workloads (``--workloads``):

* ``react``: ``--steps`` tool calls per task, one per step, short results;
  run at each ``--tasks`` concurrency (8 and 32);
* ``parallel``: 3 independent tool calls per step; each step's thought is
  followed by 3 calls of ``--call-tokens`` tokens. The inferlet starts each
  tool call as soon as its tokens are generated (the call overlaps the rest
  of the generation); the client gets the whole reply first, then runs the
  3 calls concurrently (as a client of OpenAI's parallel tool calls does);
* ``long``: each tool result is ``--long-chars`` characters long; the
  inferlet masks the observation once the next thought has read it and
  frees its KV pages (``mask_token_range`` + ``drop_masked_pages``), the
  client keeps re-sending it (dropping it would cost a re-prefill).

Round trips. The tools are served next to the server (a local HTTP server
with ``--tool-latency-ms`` latency), so an inferlet pays no network time for
them. ``--rtt-ms`` emulates the client-to-server network: with ``R`` ms,
every HTTP request of the client (completions and tool calls) is delayed
``R/2`` ms before it is sent and ``R/2`` ms after its response arrives
(httpx event hooks), and an inferlet launch pays ``R/2`` before the launch
and ``R/2`` after its result, i.e. one round trip per task. ``0`` is
loopback.

Per mode the server's scheduler counters (``/metrics``) are read around
each run: rows (tokens) per model call, requests per call, mixed
prefill+decode calls, time in model calls, in the scheduler's batching
wait, and the scheduler's own time outside model calls; and the CPU
seconds the server process and this process (the client mode's
orchestration, the tool server, the launch client) used during it. On a
shared 2-core VM wall time depends on what else runs; CPU seconds are the
work each mode did, which the load changes much less.

    .venv/bin/python benchmarks/bench_agents.py              # full run
    .venv/bin/python benchmarks/bench_agents.py --quick      # smoke run

Prints a table per workload and one ``JSON:`` line; asserts nothing about
time. Ratios are inferlet / client tasks per second, median over rounds
(>1: the inferlet is faster); ``client cpu / cpu`` is the client run's
server CPU seconds over this mode's, per round (>1: the inferlet made the
server do less work for the same tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common import MODEL, report, start_server, start_tools
from tartlet.client import Client

SYSTEM = "You are an agent. Think, then call tools."

#: The agent, as an inferlet. ``args``: task, steps, thought_tokens,
#: calls (per step), call_tokens, chars (tool output size), drop, tool_url.
AGENT = '''
import asyncio
from tartlet import Model
from tartlet.sdk import http

SYSTEM = "You are an agent. Think, then call tools."


async def main(args):
    model = Model.load()
    n, calls, call_tokens = args["thought_tokens"], args["calls"], args["call_tokens"]
    url = args["tool_url"]
    masked = dropped = 0
    with model.new_context() as ctx:
        ctx.system(SYSTEM)
        ctx.user(args["task"])
        seen = None  # token range of the last observation, to drop once read
        for step in range(args["steps"] + 1):
            await ctx.generate(max_tokens=n, eos=False).collect_text()
            fired = []
            for call in range(calls if step < args["steps"] else 0):
                if call_tokens:  # this call's tokens, then it starts while the next are generated
                    await ctx.generate(max_tokens=call_tokens, eos=False).collect_text()
                q = f"?step={step}&call={call}&chars={args['chars']}"
                fired.append(asyncio.ensure_future(http.fetch(url + q)))
            if seen is not None:  # the thought just written has read it
                ctx.mask_token_range(*seen)
                masked += seen[1] - seen[0]
                dropped += await ctx.drop_masked_pages()
                seen = None
            if not fired:
                break
            obs = [r.text() for r in await asyncio.gather(*fired)]
            start = ctx.seq_len
            ctx.user("Observation: " + "\\n".join(obs))
            if args["drop"]:
                seen = (start, ctx.seq_len)
    return {"masked_tokens": masked, "dropped_pages": dropped}
'''

MODES = ("native", "sandboxed", "client")


@dataclass
class Workload:
    """One agent workload (see the module docstring)."""

    name: str
    tasks: int
    steps: int
    thought_tokens: int
    calls: int = 1
    call_tokens: int = 0
    chars: int = 0
    drop: bool = False

    def args(self, i: int, tool_url: str, run: int = 0) -> dict[str, Any]:
        """Arguments of task ``i`` of run ``run`` (tasks of different runs
        differ, so a run never reuses another mode's cached KV pages)."""
        return {"task": f"Task {run}.{i}: find the weather in city {i}.", "steps": self.steps,
                "thought_tokens": self.thought_tokens, "calls": self.calls, "call_tokens": self.call_tokens,
                "chars": self.chars, "drop": self.drop, "tool_url": tool_url}

    def tokens_per_task(self) -> int:
        """Tokens generated per task (every mode)."""
        return self.steps * (self.thought_tokens + self.calls * self.call_tokens) + self.thought_tokens


async def run_inferlet(url: str, target: str | Path, w: Workload, tool_url: str, rtt_s: float, run: int) -> list[float]:
    """Run ``w.tasks`` agent inferlets at once; returns each task's latency
    in seconds (launch to result, plus one emulated round trip)."""
    async with await Client.connect(url) as c:

        async def one(i: int) -> float:
            t0 = time.perf_counter()
            await asyncio.sleep(rtt_s / 2)
            ex = await (await c.launch(target, w.args(i, tool_url, run))).wait()
            assert ex.ok, ex.error
            await asyncio.sleep(rtt_s / 2)
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(w.tasks))))


async def run_client(url: str, w: Workload, tool_url: str, rtt_s: float, run: int) -> list[float]:
    """The same loop orchestrated over the OpenAI API; every request pays
    the emulated round trip ``rtt_s`` (half before sending, half after the
    response)."""

    async def delay(_: object) -> None:
        await asyncio.sleep(rtt_s / 2)

    hooks = {"request": [delay], "response": [delay]} if rtt_s else {}
    limits = httpx.Limits(max_connections=(w.calls + 1) * w.tasks + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, event_hooks=hooks) as client:

        async def chat(messages: list[dict[str, str]], max_tokens: int) -> str:
            r = await client.post(url + "/v1/chat/completions", json={
                "model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        async def one(i: int) -> float:
            t0 = time.perf_counter()
            a = w.args(i, tool_url, run)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": a["task"]}]
            for step in range(w.steps):
                messages.append({"role": "assistant", "content": await chat(messages, w.thought_tokens + w.calls * w.call_tokens)})
                rs = await asyncio.gather(*(client.get(tool_url, params={"step": step, "call": k, "chars": w.chars})
                                            for k in range(w.calls)))
                messages.append({"role": "user", "content": "Observation: " + "\n".join(r.text for r in rs)})
            await chat(messages, w.thought_tokens)
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(w.tasks))))


#: (column, /metrics counter) read around each run.
COUNTERS = {
    "calls": "tartlet_model_calls", "requests": "tartlet_forward_requests", "rows": "tartlet_tokens_computed",
    "mixed": "tartlet_mixed_model_calls", "forward_s": "tartlet_forward_seconds",
    "batch_wait_s": "tartlet_batch_wait_seconds", "sched_s": "tartlet_scheduler_overhead_seconds",
    "queue_wait_s": "tartlet_queue_wait_seconds",
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The scheduler counters of the server's (one) model."""
    text = (await client.get(url + "/metrics")).text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return {k: values.get(name + "_total", 0.0) for k, name in COUNTERS.items()}


_runs = itertools.count(1)


async def one_run(mode: str, url: str, prog: Path, w: Workload, tool_url: str, rtt_s: float,
                  server_pid: int) -> dict[str, Any]:
    """One timed run of ``mode``: tasks/s, latency p50, the scheduler's
    counters and CPU seconds over the run (its tasks' texts are new to the
    server)."""
    run = next(_runs)
    async with httpx.AsyncClient(timeout=60) as mc:
        before = await scrape(mc, url)
        cpu0, own0 = cpu_seconds(server_pid), time.process_time()
        t0 = time.perf_counter()
        if mode == "client":
            lat = await run_client(url, w, tool_url, rtt_s, run)
        else:
            lat = await run_inferlet(url, "agent" if mode == "native" else prog, w, tool_url, rtt_s, run)
        wall = time.perf_counter() - t0
        cpu, own = cpu_seconds(server_pid) - cpu0, time.process_time() - own0
        after = await scrape(mc, url)
    d = {k: after[k] - before[k] for k in COUNTERS}
    calls = max(1.0, d["calls"])
    return {"tasks_per_s": w.tasks / wall, "wall_s": wall, "latency_p50_s": statistics.median(lat),
            "rows_per_call": d["rows"] / calls, "requests_per_call": d["requests"] / calls,
            "model_calls": int(d["calls"]), "mixed_calls": int(d["mixed"]), "rows": int(d["rows"]),
            "forward_s": d["forward_s"], "batch_wait_s": d["batch_wait_s"], "sched_s": d["sched_s"],
            "queue_wait_per_request_ms": 1000 * d["queue_wait_s"] / max(1.0, d["requests"]),
            "server_cpu_s": cpu, "bench_cpu_s": own, "load_avg": os.getloadavg()[0]}


async def bench(url: str, prog: Path, tool_url: str, workloads: list[Workload], rtts_ms: list[float],
                rounds: int, modes: tuple[str, ...], server_pid: int) -> list[dict[str, Any]]:
    """Every workload at every round trip, modes alternating, their order
    rotating from round to round (and from configuration to configuration,
    so that one round per configuration does not always run the same mode
    first); prints a table each."""
    out = []
    turn = itertools.count()
    for w in workloads:
        for rtt in rtts_ms:
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for _ in range(rounds):
                k = next(turn) % len(modes)
                for m in modes[k:] + modes[:k]:
                    runs[m].append(await one_run(m, url, prog, w, tool_url, rtt / 1000, server_pid))
            rows, res = [], {"workload": w.name, "tasks": w.tasks, "rtt_ms": rtt, "modes": {}}
            for m in modes:
                rs = runs[m]
                med = {k: statistics.median(x[k] for x in rs) for k in rs[0]}
                ratio = (statistics.median(a["tasks_per_s"] / b["tasks_per_s"] for a, b in zip(rs, runs["client"]))
                         if "client" in runs and m != "client" else None)
                res["modes"][m] = {**med, "ratio_vs_client": ratio, "rounds": rs}
                cpu_ratio = (statistics.median(b["server_cpu_s"] / a["server_cpu_s"] for a, b in zip(rs, runs["client"]))
                             if "client" in runs and m != "client" else None)
                res["modes"][m]["cpu_ratio_vs_client"] = cpu_ratio
                rows.append([m, med["tasks_per_s"], med["latency_p50_s"], f"{ratio:.2f}x" if ratio else "-",
                             med["rows_per_call"], med["requests_per_call"], med["mixed_calls"],
                             med["forward_s"], med["batch_wait_s"], med["sched_s"], med["queue_wait_per_request_ms"],
                             med["server_cpu_s"], f"{cpu_ratio:.2f}x" if cpu_ratio else "-", med["bench_cpu_s"]])
            report(f"{w.name}: {w.tasks} tasks x {w.steps} steps x {w.calls} call(s), {w.tokens_per_task()} tokens/task, "
                   f"RTT {rtt:g} ms (median of {rounds} rounds)",
                   ["mode", "tasks/s", "lat p50 s", "vs client", "rows/call", "reqs/call", "mixed calls", "forward s",
                    "batch wait s", "sched s", "queue ms/req", "server cpu s", "client cpu / cpu", "bench cpu s"],
                   rows, None)
            out.append(res)
    return out


def workloads(a: argparse.Namespace) -> list[Workload]:
    ws = []
    for name in a.workloads:
        if name == "react":
            ws += [Workload("react", t, a.steps, a.thought_tokens) for t in a.tasks]
        elif name == "parallel":
            ws.append(Workload("parallel", a.tasks[0], a.steps, a.thought_tokens, calls=3, call_tokens=a.call_tokens))
        elif name == "long":
            ws.append(Workload("long", a.tasks[0], a.steps, a.thought_tokens, chars=a.long_chars, drop=True))
        else:
            raise SystemExit(f"unknown workload {name!r} (react, parallel, long)")
    return ws


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one round: a smoke run")
    ap.add_argument("--workloads", nargs="+", default=["react", "parallel", "long"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--tasks", type=int, nargs="+", default=[8, 32],
                    help="concurrent tasks (react: each; parallel and long: the first)")
    ap.add_argument("--steps", type=int, default=8, help="steps (tool-calling turns) per task")
    ap.add_argument("--thought-tokens", type=int, default=24, help="tokens per thought")
    ap.add_argument("--call-tokens", type=int, default=8, help="parallel: tokens of each of the 3 calls")
    ap.add_argument("--long-chars", type=int, default=600, help="long: characters of each tool result")
    ap.add_argument("--tool-latency-ms", type=float, default=50.0)
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 20.0], help="emulated client-server round trips")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds per workload and round trip")
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    a = ap.parse_args()
    if a.quick:
        a.tasks, a.steps, a.thought_tokens, a.call_tokens, a.long_chars, a.rounds = [2], 2, 4, 2, 200, 1
    modes = tuple(a.modes)
    tools, tool_url = start_tools(a.tool_latency_ms / 1000)
    proc, url = start_server(a.kv_cache_mb, {"agent": AGENT})
    prog = Path(tempfile.mkdtemp(prefix="tartlet-agent-")) / "agent.py"
    prog.write_text(AGENT)
    try:
        warm = Workload("warm-up", 1, 1, 2, calls=1, call_tokens=1, chars=100, drop=True)
        for m in modes:  # the sandboxed upload's first launch builds its component
            await one_run(m, url, prog, warm, tool_url, 0.0, proc.pid)
        load = os.getloadavg()
        t0 = time.perf_counter()
        results = await bench(url, prog, tool_url, workloads(a), a.rtt_ms, a.rounds, modes, proc.pid)
        print(f"\nload average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {time.perf_counter() - t0:.0f} s")
        print("JSON: " + json.dumps({"results": results, "tool_latency_ms": a.tool_latency_ms, "rounds": a.rounds,
                                     "load_avg_start": load[0], "load_avg_end": os.getloadavg()[0]}))
    finally:
        tools.shutdown()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
