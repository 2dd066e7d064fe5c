"""Agents: per-task latency of an inferlet in the server against a client
over the OpenAI API, and against the ideal.

One agent loop (think, call tools, read their results, think again), run
four ways on the same ``tartlet serve`` process:

* **native**: the agent installed in the server (trusted Python, asyncio);
  it calls the tools from inside the server (``tartlet.sdk.http``) and keeps
  its KV cache across steps;
* **sandboxed**: the same source uploaded by the client, so run as a WASM
  component (the server's default for uploads);
* **chat**: a client drives the same loop over ``/v1/chat/completions``
  (prefix caching on, as always): each step re-sends the conversation, and
  the client calls the tools itself;
* **responses**: a client drives it over ``/v1/responses`` with
  ``previous_response_id`` (``store`` on): each step sends only the new
  observation, and the server opens the previous response's KV snapshot,
  so it prefills only that. Plain httpx with the wire format of OpenAI's
  client (``responses.create``), as for the chat client: the official
  client's own CPU (pydantic models) would load the 2 cores that the server
  runs on for this mode only.

and the **ideal** row: what a program that wastes nothing would take. Its
model time comes from the engine's counters (``tartlet_forward_seconds``,
the time in batched model calls): one counter covers every task of a run,
so a per-task model time is not read directly; it is taken from an extra
run of the native agent with the same tasks, at the same concurrency, that
generates the same token sequence with no tool or network wait (each tool
result is computed in the inferlet: the same text, ``common.tool_text``;
its ``rows`` column, tokens through the model, equals the native run's).
Its tasks run in lockstep, every model call holding each task's tokens, so
each task's model time is that run's ``forward s``. Ideal latency = that
model time + the tool time on the critical path (``steps`` x
``--tool-latency-ms``: one call per step, or the last of a step's parallel
calls) + one round trip (``--rtt-ms``: a task has to be sent and its result
returned); its ``chat p50 / p50`` (the chat client's p50 / ideal) is the
ceiling of every mode's ratio to the chat client. ``over ideal`` is a mode's
p50 latency / ideal - 1; ``waste s``
is its p50 minus its own run's model time, tool time and round trip (what
the ideal would not spend, beside the model's speed, which drifts from run
to run on a shared VM; at several tasks the run's model time is that of all
tasks' batched calls, so it is a task's only while they run in lockstep).

Every thought is exactly ``--thought-tokens`` long (``eos=False`` in the
inferlet, ``ignore_eos`` over both APIs), so all modes generate the same
tokens. Workloads (``--workloads``), each at every ``--tasks`` concurrency:

* ``react``: ``--steps`` tool calls per task, one per step, short results;
* ``parallel``: 3 independent tool calls per step; each step's thought is
  followed by 3 calls of ``--call-tokens`` tokens. The inferlet starts each
  tool call as soon as its tokens are generated (the call overlaps the rest
  of the generation); a client gets the whole reply first, then runs the
  3 calls concurrently (as a client of OpenAI's parallel tool calls does);
* ``long``: each tool result is ``--long-chars`` characters long; the
  inferlet masks the observation once the next thought has read it and
  frees its KV pages (``mask_token_range`` + ``drop_masked_pages``), the
  clients keep it (dropping it would cost a re-prefill).

Round trips. The tools are served next to the server (a local HTTP server
with ``--tool-latency-ms`` latency), so an inferlet pays no network time for
them. ``--rtt-ms`` emulates the client-to-server network: with ``R`` ms,
every HTTP request of a client (model calls and tool calls) is delayed
``R/2`` ms before it is sent and ``R/2`` ms after its response arrives
(httpx event hooks), and an inferlet launch pays ``R/2`` before the launch
and ``R/2`` after its result, i.e. one round trip per task.

Rounds. These VMs drift by 25% and more within minutes, so per workload
and concurrency each round runs the ideal run, then at each round trip the
four modes back to back, their order rotating from block to block; ratios
are taken within a round and the table shows medians over rounds (each
sandboxed run follows an untimed one-token launch of the upload, so that a
rebuild, after the SDK's source changed, is not timed). Per run:
per-task latency p50 and p95 (launch or first request to result), tasks/s,
the engine's counters over the run (``model s``: time in model calls;
``rows``: tokens through the model), and the CPU seconds of the server
process per task (``/proc/<pid>/stat``, every thread: the WASM instances
and the model run in it), of its main thread alone (``loop cpu ms/task``:
the event loop, which runs native inferlets, the HTTP and WebSocket
handlers, chat templates and tokenizing; the rest is the scheduler thread
with the model's OpenMP workers, and the pools for HTTP fetches and
WASM), and of this process (the clients, the tool server, the launch
client). Ratios against the chat client: ``chat p50 /
p50`` (>1: the mode's tasks finish sooner), ``tasks/s / chat``, ``cpu /
chat cpu`` (server CPU per task; <1: the mode made the server do less).

    .venv/bin/python benchmarks/bench_agents.py              # full run (hours on 2 cores: 32 tasks dominate)
    .venv/bin/python benchmarks/bench_agents.py --tasks 1 4 --rtt-ms 20 --rounds 3   # the latency targets
    .venv/bin/python benchmarks/bench_agents.py --quick      # smoke run (about 2 minutes)

Prints a table per workload, concurrency and round trip, then one ``JSON:``
line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import itertools
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from common import MODEL, report, start_server, start_tools, tool_text
from tartlet.client import Client

SYSTEM = "You are an agent. Think, then call tools."

#: The agent, as an inferlet. ``args``: task, steps, thought_tokens,
#: calls (per step), call_tokens, chars (tool output size), drop, tool_url
#: (None: the ideal run, each tool result computed here at once).
AGENT = '''
import asyncio
import json

from tartlet import Model
from tartlet.sdk import http

SYSTEM = "You are an agent. Think, then call tools."


''' + inspect.getsource(tool_text) + '''

async def observe(url, query, chars):
    """A tool call's result; ``url`` None: the same text, without the call."""
    if url is None:
        return json.dumps({"result": tool_text("/tool" + query, chars)})
    return (await http.fetch(url + query)).text()


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
                fired.append(asyncio.ensure_future(observe(url, q, args["chars"])))
            if seen is not None:  # the thought just written has read it
                ctx.mask_token_range(*seen)
                masked += seen[1] - seen[0]
                dropped += await ctx.drop_masked_pages()
                seen = None
            if not fired:
                break
            obs = await asyncio.gather(*fired)
            start = ctx.seq_len
            ctx.user("Observation: " + "\\n".join(obs))
            if args["drop"]:
                seen = (start, ctx.seq_len)
    return {"masked_tokens": masked, "dropped_pages": dropped}
'''

#: The modes, in the order of a round's first block (the ideal run is extra).
MODES = ("native", "sandboxed", "chat", "responses")


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

    def args(self, i: int, tool_url: str | None, run: int = 0) -> dict[str, Any]:
        """Arguments of task ``i`` of run ``run`` (tasks of different runs
        differ, so a run never reuses another mode's cached KV pages)."""
        return {"task": f"Task {run}.{i}: find the weather in city {i}.", "steps": self.steps,
                "thought_tokens": self.thought_tokens, "calls": self.calls, "call_tokens": self.call_tokens,
                "chars": self.chars, "drop": self.drop, "tool_url": tool_url}

    def tokens_per_task(self) -> int:
        """Tokens generated per task (every mode)."""
        return self.steps * (self.thought_tokens + self.calls * self.call_tokens) + self.thought_tokens


async def run_inferlet(url: str, target: str | Path, w: Workload, tool_url: str | None, rtt_s: float, run: int) -> list[float]:
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


def _client(w: Workload, rtt_s: float) -> httpx.AsyncClient:
    """An HTTP client whose every request pays the emulated round trip
    ``rtt_s`` (half before sending, half after the response)."""

    async def delay(_: object) -> None:
        await asyncio.sleep(rtt_s / 2)

    hooks = {"request": [delay], "response": [delay]} if rtt_s else {}
    limits = httpx.Limits(max_connections=(w.calls + 1) * w.tasks + 4)
    return httpx.AsyncClient(timeout=600, limits=limits, event_hooks=hooks)


async def _tools(client: httpx.AsyncClient, tool_url: str, w: Workload, step: int) -> str:
    """The step's observation: its tool calls, run concurrently."""
    rs = await asyncio.gather(*(client.get(tool_url, params={"step": step, "call": k, "chars": w.chars}) for k in range(w.calls)))
    return "Observation: " + "\n".join(r.text for r in rs)


async def run_client(url: str, w: Workload, tool_url: str, rtt_s: float, run: int) -> list[float]:
    """The loop over ``/v1/chat/completions``: each step re-sends the
    conversation. Returns each task's latency in seconds."""
    async with _client(w, rtt_s) as client:

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
                messages.append({"role": "user", "content": await _tools(client, tool_url, w, step)})
            await chat(messages, w.thought_tokens)
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(w.tasks))))


@dataclass
class ResponsesLog:
    """What a Responses run stored and reused: response ids (deleted after
    the run), and usage summed over its turns after the first."""

    ids: list[str] = field(default_factory=list)
    input_tokens: int = 0
    cached_tokens: int = 0


async def run_responses(url: str, w: Workload, tool_url: str, rtt_s: float, run: int, log: ResponsesLog | None = None) -> list[float]:
    """The loop over ``/v1/responses``: the first turn sends the system
    prompt (``instructions``) and the task, each later one only the new
    observation with ``previous_response_id``. Returns each task's latency
    in seconds."""
    log = log if log is not None else ResponsesLog()
    async with _client(w, rtt_s) as client:

        async def respond(item: str, prev: str | None, max_tokens: int) -> str:
            body: dict[str, Any] = {"model": MODEL, "input": item if prev is None else [{"role": "user", "content": item}],
                                    "max_output_tokens": max_tokens, "ignore_eos": True}
            if prev is None:
                body["instructions"] = SYSTEM
            else:
                body["previous_response_id"] = prev
            r = await client.post(url + "/v1/responses", json=body)
            r.raise_for_status()
            out = r.json()
            log.ids.append(out["id"])
            if prev is not None:
                log.input_tokens += out["usage"]["input_tokens"]
                log.cached_tokens += out["usage"]["input_tokens_details"]["cached_tokens"]
            return out["id"]

        async def one(i: int) -> float:
            t0 = time.perf_counter()
            step_tokens = w.thought_tokens + w.calls * w.call_tokens  # a step's reply; the last reply: a thought
            prev = await respond(w.args(i, tool_url, run)["task"], None, step_tokens if w.steps else w.thought_tokens)
            for step in range(w.steps):
                obs = await _tools(client, tool_url, w, step)
                prev = await respond(obs, prev, step_tokens if step + 1 < w.steps else w.thought_tokens)
            return time.perf_counter() - t0

        return list(await asyncio.gather(*(one(i) for i in range(w.tasks))))


#: (key, /metrics counter) read around each run.
COUNTERS = {"calls": "tartlet_model_calls", "rows": "tartlet_tokens_computed", "forward_s": "tartlet_forward_seconds"}


def cpu_seconds(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads,
    or only its thread ``thread`` (a Linux thread id: ``pid`` itself is the
    main thread) (Linux)."""
    stat = Path(f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The scheduler counters of the server's (one) model."""
    text = (await client.get(url + "/metrics")).text
    values = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
    return {k: values.get(name + "_total", 0.0) for k, name in COUNTERS.items()}


def p95(xs: list[float]) -> float:
    """The 95th percentile (linear interpolation between order statistics, as numpy's default)."""
    return statistics.quantiles(xs, n=20, method="inclusive")[18] if len(xs) > 1 else xs[0]


_runs = itertools.count(1)


async def one_run(mode: str, url: str, prog: Path, w: Workload, tool_url: str, rtt_s: float, server_pid: int) -> dict[str, Any]:
    """One timed run of ``mode`` (or ``ideal``: the native agent without
    waits): latencies, tasks/s, the engine's counters and CPU seconds over
    the run (its tasks' texts are new to the server)."""
    run = next(_runs)
    log = ResponsesLog()
    if mode == "sandboxed":  # untimed: a build of the upload (the SDK's source changed meanwhile) is not the mode's cost
        await run_inferlet(url, prog, Workload("warm-up", 1, 0, 1), tool_url, 0.0, next(_runs))  # tasks of their own
    async with httpx.AsyncClient(timeout=60) as mc:
        before = await scrape(mc, url)
        cpu0, loop0, own0 = cpu_seconds(server_pid), cpu_seconds(server_pid, server_pid), time.process_time()
        t0 = time.perf_counter()
        if mode == "chat":
            lat = await run_client(url, w, tool_url, rtt_s, run)
        elif mode == "responses":
            lat = await run_responses(url, w, tool_url, rtt_s, run, log)
        else:
            lat = await run_inferlet(url, prog if mode == "sandboxed" else "agent", w, None if mode == "ideal" else tool_url,
                                     0.0 if mode == "ideal" else rtt_s, run)
        wall = time.perf_counter() - t0
        cpu, own = cpu_seconds(server_pid) - cpu0, time.process_time() - own0
        loop = cpu_seconds(server_pid, server_pid) - loop0
        after = await scrape(mc, url)
        # outside the measured window: the stored responses go (bounded state across runs)
        for k in range(0, len(log.ids), 16):
            await asyncio.gather(*(mc.delete(f"{url}/v1/responses/{rid}") for rid in log.ids[k:k + 16]))
    d = {k: after[k] - before[k] for k in COUNTERS}
    out = {"latency_p50_s": statistics.median(lat), "latency_p95_s": p95(lat), "tasks_per_s": w.tasks / wall, "wall_s": wall,
           "forward_s": d["forward_s"], "rows": int(d["rows"]), "model_calls": int(d["calls"]),
           "server_cpu_per_task_s": cpu / w.tasks, "server_loop_cpu_per_task_s": loop / w.tasks, "bench_cpu_s": own,
           "load_avg": os.getloadavg()[0], "latencies_s": lat}
    if mode == "responses":
        out["cached_fraction"] = log.cached_tokens / max(1, log.input_tokens)
    return out


def _med(rs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rs)


def x(v: float | None) -> str:
    """A ratio for the table."""
    return "-" if v is None else f"{v:.2f}x"


def summarize(w: Workload, rtt_ms: float, tool_s: float, ideal: list[dict[str, Any]], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """The table of one workload, concurrency and round trip (medians over
    rounds of per-round values; ratios against the chat client and the
    ideal within each round); returns its JSON result."""
    ideal_s = [r["forward_s"] + w.steps * tool_s + rtt_ms / 1000 for r in ideal]
    chat = runs.get("chat")
    res: dict[str, Any] = {"workload": w.name, "tasks": w.tasks, "rtt_ms": rtt_ms, "steps": w.steps, "calls": w.calls,
                           "tokens_per_task": w.tokens_per_task(),
                           "ideal": {"latency_s": statistics.median(ideal_s), "model_s": _med(ideal, "forward_s"),
                                     "tool_s": w.steps * tool_s, "rtt_s": rtt_ms / 1000, "rows": _med(ideal, "rows"),
                                     "no_wait_run": ideal},
                           "modes": {}}
    # the ceiling of every mode's ratio to the chat client: no mode beats the ideal
    bound = statistics.median(c["latency_p50_s"] / i for c, i in zip(chat, ideal_s)) if chat else None
    res["ideal"]["chat_p50_over_ideal"] = bound
    rows: list[list[Any]] = [["ideal", res["ideal"]["latency_s"], "-", "-", "-", x(bound), "-", "-", res["ideal"]["model_s"],
                              int(res["ideal"]["rows"]), "-", "-", "-", "-"]]
    for m, rs in runs.items():
        over = statistics.median(r["latency_p50_s"] / i - 1 for r, i in zip(rs, ideal_s))
        # beside the model's own speed, which drifts from run to run on a shared VM
        waste = statistics.median(r["latency_p50_s"] - r["forward_s"] - w.steps * tool_s - rtt_ms / 1000 for r in rs)
        vs: dict[str, float | None] = {"latency": None, "tasks_per_s": None, "cpu": None}
        if chat is not None and m != "chat":
            vs = {"latency": statistics.median(c["latency_p50_s"] / r["latency_p50_s"] for r, c in zip(rs, chat)),
                  "tasks_per_s": statistics.median(r["tasks_per_s"] / c["tasks_per_s"] for r, c in zip(rs, chat)),
                  "cpu": statistics.median(r["server_cpu_per_task_s"] / c["server_cpu_per_task_s"] for r, c in zip(rs, chat))}
        med = {k: _med(rs, k) for k in ("latency_p50_s", "latency_p95_s", "tasks_per_s", "forward_s", "rows",
                                        "server_cpu_per_task_s", "server_loop_cpu_per_task_s", "bench_cpu_s")}
        res["modes"][m] = {**med, "over_ideal": over, "waste_s": waste, "chat_p50_over_p50": vs["latency"], "tasks_per_s_vs_chat": vs["tasks_per_s"],
                           "cpu_per_task_vs_chat": vs["cpu"], "rounds": rs}
        if m == "responses":
            res["modes"][m]["cached_fraction"] = _med(rs, "cached_fraction")

        rows.append([m, med["latency_p50_s"], med["latency_p95_s"], f"{100 * over:+.0f}%", waste, x(vs["latency"]), med["tasks_per_s"],
                     x(vs["tasks_per_s"]), med["forward_s"], int(med["rows"]), med["server_cpu_per_task_s"], x(vs["cpu"]),
                     1000 * med["server_loop_cpu_per_task_s"], med["bench_cpu_s"]])
    report(f"{w.name}: {w.tasks} task(s) x {w.steps} steps x {w.calls} call(s), {w.tokens_per_task()} tokens/task, "
           f"RTT {rtt_ms:g} ms (median of {len(ideal)} round(s))",
           ["mode", "p50 s", "p95 s", "over ideal", "waste s", "chat p50 / p50", "tasks/s", "tasks/s / chat", "model s", "rows",
            "server cpu s/task", "cpu / chat cpu", "loop cpu ms/task", "bench cpu s"], rows, None)
    return res


async def bench(url: str, prog: Path, tool_url: str, tool_s: float, workloads: list[Workload], tasks: list[int],
                rtts_ms: list[float], rounds: int, modes: tuple[str, ...], server_pid: int) -> list[dict[str, Any]]:
    """Every workload at every concurrency: ``rounds`` rounds, each the
    ideal run, then per round trip the modes back to back, their order
    rotating from block to block (so that no mode always runs first);
    prints a table per workload, concurrency and round trip."""
    out = []
    turn = itertools.count()
    for w0 in workloads:
        for n in tasks:
            w = replace(w0, tasks=n)
            ideal: list[dict[str, Any]] = []
            runs: dict[tuple[float, str], list[dict[str, Any]]] = {(r, m): [] for r in rtts_ms for m in modes}
            for _ in range(rounds):
                ideal.append(await one_run("ideal", url, prog, w, tool_url, 0.0, server_pid))
                for rtt in rtts_ms:
                    k = next(turn) % len(modes)
                    for m in modes[k:] + modes[:k]:
                        runs[rtt, m].append(await one_run(m, url, prog, w, tool_url, rtt / 1000, server_pid))
            for rtt in rtts_ms:
                out.append(summarize(w, rtt, tool_s, ideal, {m: runs[rtt, m] for m in modes}))
    return out


def workloads(a: argparse.Namespace) -> list[Workload]:
    ws = []
    for name in a.workloads:
        if name == "react":
            ws.append(Workload("react", 1, a.steps, a.thought_tokens))
        elif name == "parallel":
            ws.append(Workload("parallel", 1, a.steps, a.thought_tokens, calls=3, call_tokens=a.call_tokens))
        elif name == "long":
            ws.append(Workload("long", 1, a.steps, a.thought_tokens, chars=a.long_chars, drop=True))
        else:
            raise SystemExit(f"unknown workload {name!r} (react, parallel, long)")
    return ws


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 and 2 tasks, one round: a smoke run")
    ap.add_argument("--workloads", nargs="+", default=["react", "parallel", "long"])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--tasks", type=int, nargs="+", default=[1, 4, 32], help="concurrent tasks (each workload at each)")
    ap.add_argument("--steps", type=int, default=8, help="steps (tool-calling turns) per task")
    ap.add_argument("--thought-tokens", type=int, default=24, help="tokens per thought")
    ap.add_argument("--call-tokens", type=int, default=8, help="parallel: tokens of each of the 3 calls")
    ap.add_argument("--long-chars", type=int, default=600, help="long: characters of each tool result")
    ap.add_argument("--tool-latency-ms", type=float, default=50.0)
    ap.add_argument("--rtt-ms", type=float, nargs="+", default=[0.0, 20.0, 50.0], help="emulated client-server round trips")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per workload and concurrency")
    ap.add_argument("--kv-cache-mb", type=int, default=1024)
    a = ap.parse_args()
    if a.quick:
        a.tasks, a.rtt_ms, a.steps, a.thought_tokens, a.call_tokens, a.long_chars, a.rounds = [1, 2], [0.0, 20.0], 2, 4, 2, 200, 1
    modes = tuple(a.modes)
    tools, tool_url = start_tools(a.tool_latency_ms / 1000)
    proc, url = start_server(a.kv_cache_mb, {"agent": AGENT})
    prog = Path(tempfile.mkdtemp(prefix="tartlet-agent-")) / "agent.py"
    prog.write_text(AGENT)
    try:
        q = "?step=0&call=1&chars=50"  # the ideal run computes what the tool server answers
        assert httpx.get(tool_url + q).text == json.dumps({"result": tool_text("/tool" + q, 50)})
        warm = Workload("warm-up", 1, 1, 2, calls=1, call_tokens=1, chars=100, drop=True)
        for m in ("ideal",) + modes:  # the sandboxed upload's first launch builds its component
            await one_run(m, url, prog, warm, tool_url, 0.0, proc.pid)
        load = os.getloadavg()
        t0 = time.perf_counter()
        results = await bench(url, prog, tool_url, a.tool_latency_ms / 1000, workloads(a), a.tasks, a.rtt_ms, a.rounds, modes, proc.pid)
        print(f"\nload average {load[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end; {time.perf_counter() - t0:.0f} s")
        print("JSON: " + json.dumps({"results": results, "tool_latency_ms": a.tool_latency_ms, "rounds": a.rounds,
                                     "load_avg_start": load[0], "load_avg_end": os.getloadavg()[0]}))
    finally:
        tools.shutdown()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
