"""Soak: 32 well-behaved clients with and without a hostile user (issue 12).

Starts a real ``tartlet serve`` (auth on, users ``good`` and ``evil``,
``max_pages_per_instance = 64``, the default ``pool_fraction_per_user =
0.5``) and runs, in alternating phases A, B, A, B ... (``--rounds`` pairs,
``--seconds`` each, alternating because these VMs drift by ~25%):

- A: ``--clients`` (32) well-behaved clients of user ``good``, each in a
  closed loop: half send ``POST /v1/chat/completions`` (httpx, max_tokens
  16, temperature 0), half launch ``text-completion`` (max_tokens 16) over
  the WebSocket client and wait for it.
- B: the same clients while user ``evil`` runs, in a loop, ``--forkers``
  fork storms (a context whose last page is partly filled, forked up to 3000
  times until a fork raises) and ``--savers`` save storms (``ctx.save`` until
  it raises, then ``Context.delete`` of every snapshot), all at once.

The good clients run without pause across the phases; a request counts in
the phase it started in (requests started while the evil workers finish
their last instance count nowhere). Reported per phase: requests completed,
errors of good clients (target 0; the first texts are printed), p50/p95
latency, evil's storms and quota errors (``KvQuotaError`` / ``LimitError``,
caught or failing the instance), and the peaks of KV pages used
(``/metrics``) and server RSS (``/proc/PID/status`` ``VmRSS``), sampled
every second. Before the first phase and after the last (every client
stopped, everything drained): KV pages used (should be back where they
started), server RSS and snapshot files on disk. Ratios: pooled phase B
p50/p95 over pooled phase A. The hostile programs are uploads run natively
(``uploaded_runtime = "native"``): the quotas are host-side, and that keeps
componentize-py builds out of the measurement.

    .venv/bin/python benchmarks/bench_soak.py                         # 2 rounds x 30 s per phase
    .venv/bin/python benchmarks/bench_soak.py --rounds 2 --seconds 25 --json soak.json
    .venv/bin/python benchmarks/bench_soak.py --quick                 # smoke run

Prints tables and one ``JSON:`` line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import report  # noqa: E402
from tartlet.client import Client  # noqa: E402

MODEL = "smollm2-135m-instruct"
TARTLET = [sys.executable, "-m", "tartlet.cli.main"]
PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea.",
    "List three colours:",
    "What is 12 times 7?",
    "Name a famous physicist.",
    "Translate 'good morning' into Spanish.",
    "Give a synonym for 'happy'.",
    "The opposite of hot is",
]
#: a quota hit, caught in the storm or failing its instance (its first flush
#: may find the user's pages taken by its other storms)
QUOTA_ERROR = re.compile(r"(instance failed: )?(KvQuotaError|LimitError): ")

FORK_STORM = """
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill("storm " * 21)
    if len(ctx.tokens) % 16 == 0:
        ctx.fill(" storm")
    await ctx.flush()  # a partly filled last page: every fork copies it
    forks = []
    try:
        for _ in range(args["n"]):
            forks.append(ctx.fork())
    except Exception as e:
        return {"count": len(forks), "error": f"{type(e).__name__}: {e}"}
    return {"count": len(forks), "error": None}
"""
SAVE_STORM = """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill("save storm " * 9)
    await ctx.flush()
    names, error = [], None
    for i in range(args["n"]):
        try:
            ctx.save(f"{args['prefix']}{i}")
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            break
        names.append(f"{args['prefix']}{i}")
    for name in names:
        Context.delete(model, name)
    return {"count": len(names), "error": error}
"""


def kv_pages(metrics: str) -> dict[str, int]:
    return {s: int(float(n)) for s, n in re.findall(rf'tartlet_kv_pages\{{model="{MODEL}",state="(\w+)"\}} (\S+)', metrics)}


# -- the server -------------------------------------------------------------------------
class Server:
    """``tartlet serve --port 0`` on a fresh data dir, auth on, with users
    ``good`` and ``evil``."""

    def __init__(self, workdir: Path, kv_cache_mb: int) -> None:
        cfg, self.data = workdir / "config.toml", workdir / "data"
        cfg.write_text(
            f'data_dir = "{self.data}"\n'
            "[limits]\nmax_pages_per_instance = 64\n"
            '[programs]\nuploaded_runtime = "native"\n'
            f'[[models]]\nmodel = "{MODEL}"\nkv_cache_mb = {kv_cache_mb}\nthreads = 2\n'
        )
        self.keys = {}
        for user in ("good", "evil"):
            r = subprocess.run(TARTLET + ["auth", "add", user, "--config", str(cfg)], capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                raise RuntimeError(f"tartlet auth add {user}: {r.stderr}")
            self.keys[user] = r.stdout.strip()
        self.log_path = workdir / "server.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            TARTLET + ["serve", "--config", str(cfg), "--port", "0"], stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT
        )
        assert self.proc.stdout is not None
        deadline = time.time() + 240
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if m := re.search(r"serving on (http://[\d.]+:\d+)", line):
                self.url = m.group(1)
                return
        self.stop()
        raise RuntimeError(f"server did not start; log: {self.log_path.read_text()[-2000:]}")

    def pages(self) -> dict[str, int]:
        """KV pages by state (used, cached, free) from /metrics."""
        return kv_pages(httpx.get(self.url + "/metrics", timeout=30).text)

    async def apages(self, http: httpx.AsyncClient) -> dict[str, int]:
        return kv_pages((await http.get(self.url + "/metrics")).text)

    def rss_mb(self) -> float:
        """The server's resident set size, MiB."""
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def snapshot_files(self) -> int:
        """Persisted snapshot files in the data dir."""
        return sum(1 for _ in (self.data / "snapshots").glob("**/*.safetensors"))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


# -- bookkeeping ------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    evil_storms: int = 0
    evil_quota_errors: int = 0
    evil_other_errors: list[str] = field(default_factory=list)
    peak_pages_used: int = 0
    peak_rss_mb: float = 0.0


class Recorder:
    """The phase now running (None while draining) and what each phase got."""

    def __init__(self) -> None:
        self.current: Phase | None = None
        self.phases: list[Phase] = []
        self.stopping = False

    def begin(self, name: str) -> Phase:
        self.current = Phase(name)
        self.phases.append(self.current)
        return self.current


async def openai_request(http: httpx.AsyncClient, prompt: str) -> str | None:
    """One chat completion; the error text, or None."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0}
    try:
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return f"openai: HTTP {r.status_code}: {r.text[:300]}"
        if not isinstance(r.json()["choices"][0]["message"]["content"], str):
            return f"openai: no content: {r.text[:300]}"
    except Exception as e:  # noqa: BLE001 - every failure is a finding
        return f"openai: {type(e).__name__}: {e}"
    return None


async def ws_request(client: Client, prompt: str) -> str | None:
    """One ``text-completion`` instance; the error text, or None."""
    ex = await (await client.launch("text-completion", {"prompt": prompt, "max_tokens": 16})).wait()
    return None if ex.status == "finished" else f"ws: {ex.status}: {ex.error}"


def openai_http(srv: Server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {srv.keys['good']}"}, timeout=300)


async def openai_client(i: int, srv: Server, rec: Recorder) -> None:
    """A closed loop of chat completions."""
    async with openai_http(srv) as http:
        n = i
        while not rec.stopping:
            phase, t0 = rec.current, time.perf_counter()
            record(phase, t0, await openai_request(http, PROMPTS[n % len(PROMPTS)]))
            n += 1


async def ws_client(i: int, srv: Server, rec: Recorder) -> None:
    """A closed loop of ``text-completion`` launches on one connection
    (reconnecting after an error)."""
    n, client = i, None
    while not rec.stopping:
        phase, t0 = rec.current, time.perf_counter()
        try:
            if client is None:
                client = await Client.connect(srv.url, srv.keys["good"])
            err = await ws_request(client, PROMPTS[n % len(PROMPTS)])
        except Exception as e:  # noqa: BLE001
            err = f"ws: {type(e).__name__}: {e}"
            if client is not None:
                await client.close()
                client = None
        record(phase, t0, err)
        n += 1
    if client is not None:
        await client.close()


def record(phase: Phase | None, t0: float, err: str | None) -> None:
    if phase is None:
        return
    if err is None:
        phase.latencies_ms.append((time.perf_counter() - t0) * 1000)
    else:
        phase.errors.append(err)


async def evil_worker(k: int, program: Path, n: int, srv: Server, rec: Recorder, stop: asyncio.Event) -> None:
    """One hostile loop: launch the storm, wait, again, until ``stop``."""
    it = 0
    async with await Client.connect(srv.url, srv.keys["evil"]) as c:
        while not stop.is_set():
            phase = rec.current
            args = {"n": n, "prefix": f"w{k}-{it}-"}
            try:
                ex = await (await c.launch(program, args)).wait()
                error = ex.result["error"] if ex.status == "finished" else f"instance {ex.status}: {ex.error}"
            except Exception as e:  # noqa: BLE001
                error = f"launch: {type(e).__name__}: {e}"
            if phase is not None:
                phase.evil_storms += 1
                if error and QUOTA_ERROR.match(error):
                    phase.evil_quota_errors += 1
                elif error:
                    phase.evil_other_errors.append(error)
            it += 1


async def sample_pages(srv: Server, rec: Recorder) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        while not rec.stopping:
            if (phase := rec.current) is not None:
                phase.peak_pages_used = max(phase.peak_pages_used, (await srv.apages(http)).get("used", 0))
                phase.peak_rss_mb = max(phase.peak_rss_mb, srv.rss_mb())
            await asyncio.sleep(1)


async def wait_pages(srv: Server, target: int, timeout: float) -> dict[str, int]:
    deadline = time.time() + timeout
    pages = srv.pages()
    while pages["used"] > target and time.time() < deadline:
        await asyncio.sleep(0.5)
        pages = srv.pages()
    return pages


# -- the run ----------------------------------------------------------------------------
async def soak(srv: Server, progs: dict[str, Path], a: argparse.Namespace) -> dict[str, Any]:
    # warm up: both routes and both storms once (uploads, first-call costs)
    async with openai_http(srv) as http, await Client.connect(srv.url, srv.keys["good"]) as c:
        for err in (await openai_request(http, PROMPTS[0]), await ws_request(c, PROMPTS[0])):
            if err:
                raise RuntimeError(f"a request failed on a quiet server: {err}")
    async with await Client.connect(srv.url, srv.keys["evil"]) as c:
        for prog in progs.values():
            ex = await (await c.launch(prog, {"n": 1, "prefix": "warm-"})).wait()
            if ex.status != "finished":
                raise RuntimeError(f"{prog.name} failed on a quiet server: {ex.error}")
    before = await wait_pages(srv, 0, 30)
    rss_before, files_before = srv.rss_mb(), srv.snapshot_files()

    rec = Recorder()
    good = [asyncio.create_task((openai_client if i % 2 == 0 else ws_client)(i, srv, rec)) for i in range(a.clients)]
    sampler = asyncio.create_task(sample_pages(srv, rec))
    for r in range(1, a.rounds + 1):
        for kind in ("A", "B"):
            rec.begin(f"{kind}{r}")
            stop, evil = asyncio.Event(), []
            if kind == "B":
                evil = [asyncio.create_task(evil_worker(k, progs["fork"], 3000, srv, rec, stop)) for k in range(a.forkers)]
                evil += [asyncio.create_task(evil_worker(a.forkers + k, progs["save"], 100_000, srv, rec, stop)) for k in range(a.savers)]
            await asyncio.sleep(a.seconds)
            rec.current = None  # evil finishing its last storms counts nowhere
            stop.set()
            await asyncio.gather(*evil)
    rec.stopping = True
    await asyncio.gather(*good, sampler)
    after = await wait_pages(srv, before["used"], 60)
    return {
        "phases": rec.phases,
        "pages_before": before, "pages_after": after,
        "rss_before_mb": rss_before, "rss_after_mb": srv.rss_mb(),
        "snapshot_files_before": files_before, "snapshot_files_after": srv.snapshot_files(),
    }  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(x: float) -> int | str:
    return "-" if x != x else round(x)


def summarize(res: dict[str, Any], a: argparse.Namespace) -> dict[str, Any]:
    phases: list[Phase] = res["phases"]
    rows, out = [], []
    for p in phases:
        rows.append([p.name, len(p.latencies_ms), len(p.errors), ms(pct(p.latencies_ms, 0.5)), ms(pct(p.latencies_ms, 0.95)),
                     p.evil_storms, p.evil_quota_errors, len(p.evil_other_errors), p.peak_pages_used, round(p.peak_rss_mb)])  # fmt: skip
        out.append({"phase": p.name, "requests": len(p.latencies_ms), "req_per_s": len(p.latencies_ms) / a.seconds,
                    "errors": len(p.errors), "first_errors": p.errors[:5], "p50_ms": pct(p.latencies_ms, 0.5),
                    "p95_ms": pct(p.latencies_ms, 0.95), "evil_storms": p.evil_storms, "evil_quota_errors": p.evil_quota_errors,
                    "evil_other_errors": p.evil_other_errors[:5], "peak_pages_used": p.peak_pages_used,
                    "peak_rss_mb": p.peak_rss_mb})  # fmt: skip
    pooled = {k: [x for p in phases if p.name.startswith(k) for x in p.latencies_ms] for k in "AB"}
    ratios = {f"{q}": pct(pooled["B"], v) / pct(pooled["A"], v) for q, v in (("p50", 0.5), ("p95", 0.95))}
    payload = {
        "config": {"clients": a.clients, "rounds": a.rounds, "seconds": a.seconds, "forkers": a.forkers, "savers": a.savers,
                   "kv_cache_mb": a.kv_cache_mb, "max_pages_per_instance": 64, "pool_fraction_per_user": 0.5},  # fmt: skip
        "phases": out,
        "pooled": {k: {"requests": len(v), "p50_ms": pct(v, 0.5), "p95_ms": pct(v, 0.95)} for k, v in pooled.items()},
        "ratio_B_over_A": ratios,
        "good_errors": sum(len(p.errors) for p in phases),
        "pages_before": res["pages_before"],
        "pages_after": res["pages_after"],
        "rss_before_mb": res["rss_before_mb"],
        "rss_after_mb": res["rss_after_mb"],
        "snapshot_files_before": res["snapshot_files_before"],
        "snapshot_files_after": res["snapshot_files_after"],
    }
    report(
        f"Soak: {a.clients} good clients (half OpenAI, half WebSocket), B = + user evil "
        f"({a.forkers} fork storms, {a.savers} save storms), {a.seconds:g} s per phase",
        ["phase", "requests", "errors", "p50 ms", "p95 ms", "evil storms", "evil quota errs", "evil other errs", "peak pages used", "peak RSS MiB"],
        rows, None,
    )  # fmt: skip
    report(
        "Pooled over the rounds",
        ["metric", "A", "B", "B / A"],
        [["requests", len(pooled["A"]), len(pooled["B"]), ""],
         ["p50 ms", ms(pct(pooled["A"], 0.5)), ms(pct(pooled["B"], 0.5)), f"{ratios['p50']:.2f}x"],
         ["p95 ms", ms(pct(pooled["A"], 0.95)), ms(pct(pooled["B"], 0.95)), f"{ratios['p95']:.2f}x"]],
        None,
    )  # fmt: skip
    pb, pa = res["pages_before"], res["pages_after"]
    report(
        "Server state (after: every client stopped, everything drained)",
        ["metric", "before first phase", "after last phase"],
        [["KV pages used", pb["used"], pa["used"]], ["KV pages cached", pb["cached"], pa["cached"]],
         ["KV pages free", pb["free"], pa["free"]], ["server RSS MiB", round(res["rss_before_mb"]), round(res["rss_after_mb"])],
         ["snapshot files on disk", res["snapshot_files_before"], res["snapshot_files_after"]]],
        payload,
    )  # fmt: skip
    errors = [e for p in phases for e in p.errors]
    if errors:
        print(f"\nfirst errors of good clients ({len(errors)} in all):")
        for e in errors[:5]:
            print("  " + e)
    evil_other = [e for p in phases for e in p.evil_other_errors]
    if evil_other:
        print(f"\nevil storms that ended on something other than a quota ({len(evil_other)}):")
        for e in evil_other[:5]:
            print("  " + e)
    return payload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="A/B pairs")
    ap.add_argument("--seconds", type=float, default=30, help="length of each phase")
    ap.add_argument("--clients", type=int, default=32, help="well-behaved clients (half OpenAI, half WebSocket)")
    ap.add_argument("--forkers", type=int, default=2, help="fork-storm instances of user evil at once")
    ap.add_argument("--savers", type=int, default=2, help="save-storm instances of user evil at once")
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="page pool (256 MiB: 364 pages of 16 tokens)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 8 s phases, 8 clients")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.clients = 1, 8, 8
    with tempfile.TemporaryDirectory(prefix="tartlet-soak-") as tmp:
        d = Path(tmp)
        progs = {"fork": d / "fork_storm.py", "save": d / "save_storm.py"}
        progs["fork"].write_text(textwrap.dedent(FORK_STORM))
        progs["save"].write_text(textwrap.dedent(SAVE_STORM))
        srv = Server(d, a.kv_cache_mb)
        try:
            res = asyncio.run(soak(srv, progs, a))
        finally:
            srv.stop()
        payload = summarize(res, a)
    if a.json:
        a.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
