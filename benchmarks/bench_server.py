"""Server throughput and latency from a separate process on loopback.

1. Concurrent chat completions over the OpenAI API (16 and 64 at once by
   default): TTFT (request sent -> first content chunk), TPOT ((last chunk -
   first chunk) / (tokens - 1)), aggregate completion tokens/s.
2. An agent workload: a ReAct-style loop with ``--steps`` tool calls per
   task (tools served by a local HTTP server with a fixed latency), run
   (a) as an inferlet that calls the tools from inside the server with
   ``tartlet.http`` and keeps its KV cache across steps — installed and run
   natively, and uploaded by the client and so run sandboxed (WASM, the
   server's default for uploads) — and (b) orchestrated by the client over
   the OpenAI API (each step re-sends the conversation). Same prompts, same
   tool latency, same token counts (every thought is exactly
   ``--agent-tokens`` long: ``eos=False`` / ``ignore_eos``), same run. Each inferlet mode is warmed up once first (the
   sandboxed upload's first launch builds its component).

    .venv/bin/python benchmarks/bench_server.py            # full run
    .venv/bin/python benchmarks/bench_server.py --quick    # smoke run
    .venv/bin/python benchmarks/bench_server.py --url http://127.0.0.1:8080  # an existing --no-auth server
                                                                             # (allowing 127.0.0.1:* for HTTP)

Prints tables and one ``JSON:`` line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import json
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tartlet.client import Client  # noqa: E402

MODEL = "smollm2-135m-instruct"

AGENT = """
from tartlet import Model, http

async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.system("You are an agent. Think, then call a tool.")
        ctx.user(args["task"])
        for step in range(args["steps"]):
            thought = await ctx.generate(max_tokens=args["max_tokens"], eos=False).collect_text()
            r = await http.fetch(args["tool_url"] + f"?step={step}")
            ctx.user("Observation: " + r.text())
        return await ctx.generate(max_tokens=args["max_tokens"], eos=False).collect_text()
"""


def start_tools(latency_s: float) -> tuple[http.server.ThreadingHTTPServer, str]:
    class Tools(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            time.sleep(latency_s)
            body = json.dumps({"result": f"tool output for {self.path}"}).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Tools)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}/tool"


def start_server(kv_cache_mb: int) -> tuple[subprocess.Popen, str]:
    """A --no-auth server with the agent installed as ``agent`` (native)."""
    d = Path(tempfile.mkdtemp(prefix="tartlet-bench-"))
    (d / "programs").mkdir()
    (d / "programs" / "agent.py").write_text(textwrap.dedent(AGENT))
    cfg = d / "config.toml"
    cfg.write_text(
        f'data_dir = "{d}"\nprogram_dir = "{d / "programs"}"\n[limits]\nmax_instances_per_user = 1000\n'
        f'[[models]]\nmodel = "{MODEL}"\nkv_cache_mb = {kv_cache_mb}\n'
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "tartlet.cli.main", "serve", "--config", str(cfg), "--port", "0", "--no-auth", "--allow-host", "127.0.0.1:*"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"serving on (http://[\d.]+:\d+)", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("the server did not start")


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


async def agent_inferlet(url: str, target: str | Path, tasks: int, steps: int, max_tokens: int, tool_url: str) -> tuple[list[float], float]:
    """Run ``tasks`` agent inferlets at once (``target``: an installed name,
    or a local file the client uploads); returns their latencies and the wall
    time, both after one untimed warm-up launch."""
    async with await Client.connect(url) as c:
        warm = await c.launch(target, {"task": "warm-up", "steps": 1, "max_tokens": 2, "tool_url": tool_url})
        ex = await warm.wait()
        assert ex.ok, ex.error

        async def one(i: int) -> float:
            t0 = time.perf_counter()
            inst = await c.launch(target, {"task": f"Task {i}: find the weather in city {i}.", "steps": steps,
                                           "max_tokens": max_tokens, "tool_url": tool_url})
            ex = await inst.wait()
            assert ex.ok, ex.error
            return time.perf_counter() - t0

        t0 = time.perf_counter()
        lat = await asyncio.gather(*(one(i) for i in range(tasks)))
        return lat, time.perf_counter() - t0


async def agent_client(url: str, tasks: int, steps: int, max_tokens: int, tool_url: str) -> tuple[list[float], float]:
    t0 = time.perf_counter()
    lat = await _agent_client(url, tasks, steps, max_tokens, tool_url)
    return lat, time.perf_counter() - t0


async def _agent_client(url: str, tasks: int, steps: int, max_tokens: int, tool_url: str) -> list[float]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2 * tasks + 4)) as client:

        async def chat(messages: list) -> str:
            r = await client.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": max_tokens,
                                                                        "ignore_eos": True})
            r.raise_for_status()
            return r.json()["choices"][0]["message"]["content"]

        async def one(i: int) -> float:
            t0 = time.perf_counter()
            messages = [{"role": "system", "content": "You are an agent. Think, then call a tool."},
                        {"role": "user", "content": f"Task {i}: find the weather in city {i}."}]
            for step in range(steps):
                messages.append({"role": "assistant", "content": await chat(messages)})
                obs = (await client.get(tool_url + f"?step={step}")).text
                messages.append({"role": "user", "content": "Observation: " + obs})
            await chat(messages)
            return time.perf_counter() - t0

        return await asyncio.gather(*(one(i) for i in range(tasks)))


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
        proc, url = start_server(a.kv_cache_mb)
    try:
        print(f"server {url}; chat completions, {a.max_tokens} tokens each")
        print(f"{'concurrent':>10} {'TTFT p50 s':>11} {'TTFT max s':>11} {'TPOT p50 ms':>12} {'tokens/s':>9} {'wall s':>7}")
        chats = []
        for n in a.concurrency:
            r = await bench_concurrent(url, n, a.max_tokens)
            chats.append(r)
            print(f"{n:>10} {r['ttft_p50']:>11.3f} {r['ttft_max']:>11.3f} {r['tpot_p50'] * 1000:>12.1f} {r['tok_s']:>9.1f} {r['wall']:>7.2f}")
        prog = Path(tempfile.mkdtemp(prefix="tartlet-agent-")) / "agent.py"
        prog.write_text(textwrap.dedent(AGENT))
        args = (a.tasks, a.steps, a.agent_tokens, tool_url)
        modes = {
            "inferlet, native": await agent_inferlet(url, "agent", *args) if a.url is None else None,
            "inferlet, sandboxed": await agent_inferlet(url, prog, *args),
            "client over OpenAI API": await agent_client(url, *args),
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
