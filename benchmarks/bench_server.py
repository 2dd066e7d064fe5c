"""Server throughput and latency from a separate process on loopback.

1. Concurrent chat completions over the OpenAI API (16 and 64 at once by
   default): TTFT (request sent -> first content chunk), TPOT ((last chunk -
   first chunk) / (tokens - 1)), aggregate completion tokens/s.
2. An agent workload: a ReAct-style loop with ``--steps`` tool calls per
   task (tools served by a local HTTP server with a fixed latency), run
   (a) as an inferlet that calls the tools from inside the server with
   ``tartlet.sdk.http`` and keeps its KV cache across steps — installed and run
   natively, and uploaded by the client and so run sandboxed (WASM, the
   server's default for uploads) — and (b) orchestrated by the client over
   the OpenAI API (each step re-sends the conversation). Same prompts, same
   tool latency, same token counts (every thought is exactly
   ``--agent-tokens`` long: ``eos=False`` / ``ignore_eos``), same run. Each
   inferlet mode is warmed up once first (the sandboxed upload's first
   launch builds its component). The agent and its drivers are
   ``bench_agents.py``'s (``react`` workload, loopback); that benchmark
   alternates the modes over rounds and adds more workloads.

    .venv/bin/python benchmarks/bench_server.py            # full run
    .venv/bin/python benchmarks/bench_server.py --quick    # smoke run
    .venv/bin/python benchmarks/bench_server.py --url http://127.0.0.1:8080  # an existing --no-auth server
                                                                             # (allowing 127.0.0.1:* for HTTP)

Prints tables and one ``JSON:`` line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench_agents import AGENT, Workload, run_client, run_inferlet
from common import MODEL, start_server, start_tools


async def one_chat(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    assert first is not None and last is not None
    return {"ttft": first - t0, "tpot": (last - first) / max(1, tokens - 1), "tokens": tokens, "end": last - t0}


async def bench_concurrent(url: str, n: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 4)) as client:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_chat(client, url, f"Write a short poem about the number {i}.", max_tokens) for i in range(n)))
        wall = time.perf_counter() - t0
    return {
        "n": n, "ttft_p50": statistics.median(r["ttft"] for r in rs), "ttft_max": max(r["ttft"] for r in rs),
        "tpot_p50": statistics.median(r["tpot"] for r in rs), "tok_s": sum(r["tokens"] for r in rs) / wall, "wall": wall,
    }


async def agent_mode(mode: str, url: str, prog: Path, w: Workload, tool_url: str) -> tuple[list[float], float]:
    """Latencies and wall time of one run of ``w`` in ``mode`` (see
    bench_agents.py), after one untimed warm-up task of an inferlet mode."""
    if mode != "client":
        await run_inferlet(url, "agent" if mode == "native" else prog, Workload("warm-up", 1, 1, 2), tool_url, 0.0, 0)
    t0 = time.perf_counter()
    if mode == "client":
        lat = await run_client(url, w, tool_url, 0.0, 1)
    else:
        lat = await run_inferlet(url, "agent" if mode == "native" else prog, w, tool_url, 0.0, 1)
    return lat, time.perf_counter() - t0


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    ap.add_argument("--url", help="use a running --no-auth server instead of starting one")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tasks", type=int, default=8, help="concurrent agent tasks")
    ap.add_argument("--steps", type=int, default=8, help="tool calls per agent task")
    ap.add_argument("--agent-tokens", type=int, default=24, help="tokens per agent thought")
    ap.add_argument("--tool-latency-ms", type=float, default=50.0)
    ap.add_argument("--kv-cache-mb", type=int, default=512)
    a = ap.parse_args()
    if a.quick:
        a.concurrency, a.max_tokens, a.tasks, a.steps, a.agent_tokens = [2, 4], 8, 2, 2, 4
    tools, tool_url = start_tools(a.tool_latency_ms / 1000)
    proc = None
    url = a.url
    if url is None:
        proc, url = start_server(a.kv_cache_mb, {"agent": AGENT})
    try:
        print(f"server {url}; chat completions, {a.max_tokens} tokens each")
        print(f"{'concurrent':>10} {'TTFT p50 s':>11} {'TTFT max s':>11} {'TPOT p50 ms':>12} {'tokens/s':>9} {'wall s':>7}")
        chats = []
        for n in a.concurrency:
            r = await bench_concurrent(url, n, a.max_tokens)
            chats.append(r)
            print(f"{n:>10} {r['ttft_p50']:>11.3f} {r['ttft_max']:>11.3f} {r['tpot_p50'] * 1000:>12.1f} {r['tok_s']:>9.1f} {r['wall']:>7.2f}")
        prog = Path(tempfile.mkdtemp(prefix="tartlet-agent-")) / "agent.py"
        prog.write_text(AGENT)
        w = Workload("react", a.tasks, a.steps, a.agent_tokens)
        modes = {
            "inferlet, native": await agent_mode("native", url, prog, w, tool_url) if a.url is None else None,
            "inferlet, sandboxed": await agent_mode("sandboxed", url, prog, w, tool_url),
            "client over OpenAI API": await agent_mode("client", url, prog, w, tool_url),
        }
        modes = {k: v for k, v in modes.items() if v is not None}
        base_lat, base_wall = modes["client over OpenAI API"]
        print(f"\nagent: {a.tasks} tasks x {a.steps} tool calls ({a.tool_latency_ms:g} ms each), {a.agent_tokens} tokens per thought")
        print(f"{'mode':>22} {'latency p50 s':>14} {'tasks/s':>8} {'latency ratio':>14} {'throughput ratio':>17}")
        agent = {}
        for name, (lat, wall) in modes.items():
            agent[name] = {"latency_p50": statistics.median(lat), "tasks_per_s": a.tasks / wall}
            print(f"{name:>22} {statistics.median(lat):>14.3f} {a.tasks / wall:>8.3f} "
                  f"{statistics.median(base_lat) / statistics.median(lat):>13.2f}x {base_wall / wall:>16.2f}x")
        print("ratios: against the client-orchestrated run (>1: faster than it)")
        print("JSON:", json.dumps({"chat": chats, "agent": agent, "tasks": a.tasks, "steps": a.steps,
                                   "tool_latency_ms": a.tool_latency_ms, "agent_tokens": a.agent_tokens}))
    finally:
        tools.shutdown()
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    asyncio.run(main())
