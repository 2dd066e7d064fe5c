"""Soak: well-behaved clients beside a hostile user, one hostile mix at a time (issues 12, 40).

Starts a real ``tartlet serve`` (auth on, users ``good`` and ``evil``,
``max_pages_per_instance = 64``, the default ``pool_fraction_per_user =
0.5`` and rate limits; uploads run sandboxed, ``uploaded_runtime =
"wasm"``, ``sandbox_memory_mb = 128``, ``max_sandbox_memory_mb_per_user =
512``; a private build cache, so the build loop builds for real) and runs,
for each of ``--rounds`` rounds and each mix of ``--mixes``, a quiet phase Q
then the mix's phase, ``--seconds`` each (alternating because these VMs
drift by ~25%):

- every phase: ``--clients`` well-behaved clients of user ``good``, each in
  a closed loop: half send ``POST /v1/chat/completions`` (httpx, max_tokens
  16, temperature 0), half launch ``text-completion`` (max_tokens 16) over
  the WebSocket client and wait for it. They run without pause across the
  phases; a request counts in the phase it started in.
- a mix phase adds user ``evil`` running, in a loop, until the phase ends:

  ``fork``    fork storms: a context whose last page is partly filled, forked
              up to 3000 times until a fork raises (``--forkers`` at once)
  ``save``    save storms: ``ctx.save`` until it raises, then
              ``Context.delete`` of every snapshot (``--savers``)
  ``launch``  launch storms: ``--storm-launches`` launches of the bundled
              ``text-completion`` (max_tokens 16) sent at once over
              ``--launchers`` connections; a storm ends refused ``limit`` or
              held to ``max_launches_per_s`` (counted as the limit at work)
  ``store``   store floods: ``store.set`` of ~1 MB values until it raises
              (``max_store_bytes_per_user``), then delete them (``--flooders``)
  ``memory``  memory hogs: sandboxed uploads that allocate 8 MiB blocks until
              ``MemoryError``, ``--hogs`` launched at once (more than
              ``max_sandbox_memory_mb_per_user`` reserves: some get ``limit``)
  ``build``   build loop: ``--builders`` new uploads at once (a connection each), each different,
              so each needs a componentize-py build, until ``limit``
              (``max_builds_per_user``, ``max_builds_per_min``)

  Each hostile storm should end in its own quota or limit error
  (``KvQuotaError``, ``LimitError``, ``MemoryError`` or a launch refused
  ``limit``), never crash the server.

Reported per mix, against the quiet phases just before it: good clients'
p50/p95 and the ratios (targets: p50 <= 1.3x, p95 <= 2x), good clients'
errors and ``internal`` errors (target 0), evil's storms, quota errors and
other errors, and server RSS (``/proc/PID/status`` ``VmRSS``, sampled every
0.5 s): at the phase start, its peak, and after evil's last storm ended.
Before the first phase (after warm-up) and after the last (every client
stopped, everything drained): KV pages used, RSS (target: after within 15%
of after warm-up), snapshot files, store keys of evil, tracebacks in the
server log, whether the server is still up. The benchmark process shares
the machine's CPUs with the server.

    .venv/bin/python benchmarks/bench_soak.py                                   # all mixes, 2 rounds x 20 s
    .venv/bin/python benchmarks/bench_soak.py --mixes fork,save --rounds 2 --seconds 25 --json soak.json
    .venv/bin/python benchmarks/bench_soak.py --quick                           # smoke run
    .venv/bin/python benchmarks/bench_soak.py --soak 600 --clients 8 --json soak.json  # 10-minute hostile soak
    .venv/bin/python benchmarks/bench_soak.py --cache /tmp/soak-cache ...      # reuse the warm-up's builds next time

``--soak S``: one quiet phase, then the mixes in turn (``--seconds`` each,
no quiet phases between them) for ``S`` seconds; each mix is compared with
that quiet phase, and the RSS report (after warm-up, peak, after the drain;
a sample every 30 s in the JSON) is the issue's "RSS after a 10-minute
hostile soak within 15% of its value after warm-up".

``evil launches/s`` counts the launches the server admitted (answered
``launched``) while the phase ran, over the phase's length: the launch
mix's figure against ``max_launches_per_s``.

Prints tables and one ``JSON:`` line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import report  # noqa: E402
from tartlet import paths  # noqa: E402
from tartlet.client import Client  # noqa: E402
from tartlet.client.client import TartletError  # noqa: E402

MODEL = "smollm2-135m-instruct"
TARTLET = [sys.executable, "-m", "tartlet.cli.main"]
MIXES = ("fork", "save", "launch", "store", "memory", "build")
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
#: a quota or limit hit, caught in the storm or failing its instance (its
#: first flush may find the user's pages taken by its other storms)
QUOTA_ERROR = re.compile(r"(instance failed: )?(KvQuotaError|LimitError|MemoryError|limit): ")
SANDBOX_MB, SANDBOX_MB_PER_USER = 128, 512
LAUNCHES_PER_S = 20  # the default max_launches_per_s

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
STORE_FLOOD = """
from tartlet import store

async def main(args):
    value = "v" * 1_000_000
    names, error = [], None
    for i in range(args["n"]):
        try:
            store.set(f"{args['prefix']}{i}", value)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            break
        names.append(f"{args['prefix']}{i}")
    for name in names:
        store.delete(name)
    return {"count": len(names), "error": error}
"""
MEMORY_HOG = """
async def main(args):
    blocks, error = [], None
    try:
        for _ in range(args["n"]):
            blocks.append(b"\\x01" * (8 << 20))
    except MemoryError as e:
        error = f"MemoryError: {e}"
    count = len(blocks)
    blocks.clear()
    return {"count": count, "error": error}
"""
BUILD_ME = """
# build loop {tag}
async def main(args):
    return {{"count": 1, "error": None}}
"""


def kv_pages(metrics: str) -> dict[str, int]:
    return {s: int(float(n)) for s, n in re.findall(rf'tartlet_kv_pages\{{model="{MODEL}",state="(\w+)"\}} (\S+)', metrics)}


# -- the server -------------------------------------------------------------------------
class Server:
    """``tartlet serve --port 0`` on a fresh data dir and build cache, auth
    on, with users ``good`` and ``evil``."""

    def __init__(self, workdir: Path, kv_cache_mb: int, cache: Path | None = None) -> None:
        cfg, self.data = workdir / "config.toml", workdir / "data"
        cfg.write_text(
            f'data_dir = "{self.data}"\n'
            f"[limits]\nmax_pages_per_instance = 64\nmax_sandbox_memory_mb_per_user = {SANDBOX_MB_PER_USER}\n"
            f'[programs]\nuploaded_runtime = "wasm"\nsandbox_memory_mb = {SANDBOX_MB}\n'
            f'[[models]]\nmodel = "{MODEL}"\nkv_cache_mb = {kv_cache_mb}\nthreads = 2\n'
        )
        # a private build cache (the build loop's builds are thrown away with
        # it); models and compiled C kernels from the usual one
        cache = cache or workdir / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        if paths.kernels_dir().is_dir() and not (cache / "kernels").exists():
            (cache / "kernels").symlink_to(paths.kernels_dir())
        env = {**os.environ, "TARTLET_CACHE_DIR": str(cache), "TARTLET_MODELS_DIR": str(paths.models_dir())}
        self.keys = {}
        for user in ("good", "evil"):
            r = subprocess.run(TARTLET + ["auth", "add", user, "--config", str(cfg)], capture_output=True, text=True, cwd=ROOT, env=env)
            if r.returncode:
                raise RuntimeError(f"tartlet auth add {user}: {r.stderr}")
            self.keys[user] = r.stdout.strip()
        self.log_path = workdir / "server.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            TARTLET + ["serve", "--config", str(cfg), "--port", "0"], stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT, env=env
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

    def rss_mb(self) -> float:
        """The server's resident set size, MiB (0 when it is gone)."""
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return 0.0
        return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024

    def snapshot_files(self) -> int:
        """Persisted snapshot files in the data dir."""
        return sum(1 for _ in (self.data / "snapshots").glob("**/*.safetensors"))

    def tracebacks(self) -> int:
        self.log.flush()
        return self.log_path.read_text(errors="replace").count("Traceback")

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
    mix: str  # "quiet" or a mix
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    evil_storms: int = 0
    evil_launches: int = 0
    evil_admitted: int = 0  # launches answered `launched` while this phase ran
    evil_quota_errors: int = 0
    evil_other_errors: list[str] = field(default_factory=list)
    rss_start_mb: float = 0.0
    peak_rss_mb: float = 0.0
    rss_end_mb: float = 0.0

    @property
    def internal_errors(self) -> int:
        return sum(1 for e in self.errors if is_internal(e))


def is_internal(err: str) -> bool:
    return "HTTP 500" in err or "internal" in err.lower()


class Recorder:
    """The phase now running (None while draining) and what each phase got."""

    def __init__(self) -> None:
        self.current: Phase | None = None
        self.phases: list[Phase] = []
        self.stopping = False

    def begin(self, name: str, mix: str) -> Phase:
        self.current = Phase(name, mix)
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


# -- the hostile user -------------------------------------------------------------------
async def run_one(c: Client, program: str | Path, args: dict[str, Any], admitted: Any = None) -> str | None:
    """Launch, wait; the storm's error (None: it ended without one).
    ``admitted()`` is called when the server accepted the launch."""
    try:
        inst = await c.launch(program, args)
        if admitted is not None:
            admitted()
        ex = await inst.wait()
    except TartletError as e:
        return f"{e.code}: {e}"
    except Exception as e:  # noqa: BLE001
        return f"launch: {type(e).__name__}: {e}"
    if ex.status != "finished":
        return f"instance {ex.status}: {ex.error}"
    return ex.result.get("error") if isinstance(ex.result, dict) else None


async def run_many(cs: list[Client], launches: list[tuple[str | Path, dict[str, Any]]], admitted: Any = None) -> str | None:
    """Launch all at once, spread over the connections ``cs`` (one connection
    answers its requests in order); the first quota error, else the first
    other error, else None."""
    errors = [e for e in await asyncio.gather(*(run_one(cs[j % len(cs)], p, a, admitted) for j, (p, a) in enumerate(launches))) if e]
    quota = [e for e in errors if QUOTA_ERROR.match(e)]
    return (quota or errors or [None])[0]


def storm(mix: str, k: int, it: int, progs: dict[str, Path], a: argparse.Namespace, workdir: Path):
    """The launches of one storm of ``mix`` by worker ``k``, iteration ``it``."""
    prefix = f"w{k}-{it}-"
    if mix == "fork":
        return [(progs["fork"], {"n": 3000, "prefix": prefix})]
    if mix == "save":
        return [(progs["save"], {"n": 100_000, "prefix": prefix})]
    if mix == "store":
        return [(progs["store"], {"n": 100_000, "prefix": prefix})]
    if mix == "launch":
        return [("text-completion", {"prompt": PROMPTS[it % len(PROMPTS)], "max_tokens": 16})] * a.storm_launches
    if mix == "memory":
        return [(progs["memory"], {"n": 10_000})] * a.hogs
    if mix == "build":
        out = []
        for j in range(a.builders):
            p = workdir / f"build_{k}_{it}_{j}.py"
            p.write_text(textwrap.dedent(BUILD_ME.format(tag=uuid.uuid4().hex)))
            out.append((p, {}))
        return out
    raise ValueError(mix)


def workers(mix: str, a: argparse.Namespace) -> int:
    """Hostile loops at once."""
    return {"fork": a.forkers, "save": a.savers, "launch": 1, "store": a.flooders, "memory": 1, "build": 1}[mix]


def connections(mix: str, a: argparse.Namespace) -> int:
    """Connections of one hostile loop."""
    return {"launch": a.launchers, "build": a.builders}.get(mix, 1)


async def evil_worker(mix: str, k: int, progs: dict[str, Path], a: argparse.Namespace, workdir: Path, srv: Server,
                      rec: Recorder, stop: asyncio.Event) -> None:  # fmt: skip
    """One hostile loop: a storm, wait for it, again, until ``stop``."""
    it = 0
    cs = [await Client.connect(srv.url, srv.keys["evil"]) for _ in range(connections(mix, a))]
    try:
        while not stop.is_set():
            phase = rec.current
            launches = storm(mix, k, it, progs, a, workdir)
            t0 = time.perf_counter()

            def admitted(phase: Phase | None = phase) -> None:
                if phase is not None and rec.current is phase:
                    phase.evil_admitted += 1

            error = await run_many(cs, launches, admitted)
            if mix == "launch" and error is None and len(launches) / (time.perf_counter() - t0) <= 1.1 * LAUNCHES_PER_S:
                # no launch refused, but all held to the rate: the limit at work
                error = f"limit: paced, {len(launches)} launches in {time.perf_counter() - t0:.1f} s"
            if phase is not None:
                phase.evil_storms += 1
                phase.evil_launches += len(launches)
                if error and QUOTA_ERROR.match(error):
                    phase.evil_quota_errors += 1
                else:
                    phase.evil_other_errors.append(error or "ended without a quota error")
            it += 1
            await asyncio.sleep(0.05)
    finally:
        for c in cs:
            await c.close()


async def sample_rss(srv: Server, rec: Recorder) -> None:
    while not rec.stopping:
        if (phase := rec.current) is not None:
            phase.peak_rss_mb = max(phase.peak_rss_mb, srv.rss_mb())
        await asyncio.sleep(0.5)


async def wait_pages(srv: Server, target: int, timeout: float) -> dict[str, int]:
    deadline = time.time() + timeout
    pages = srv.pages()
    while pages["used"] > target and time.time() < deadline:
        await asyncio.sleep(0.5)
        pages = srv.pages()
    return pages


async def evil_store_keys(srv: Server) -> int:
    async with await Client.connect(srv.url, srv.keys["evil"]) as c:
        ex = await (await c.launch(Path(srv.data.parent / "store_count.py"), {})).wait()
    return ex.result["keys"] if ex.status == "finished" else -1


# -- the run ----------------------------------------------------------------------------
async def soak(srv: Server, progs: dict[str, Path], mixes: list[str], a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    # warm up: both routes, and each mix's upload once (its build, first-call costs)
    t0 = time.perf_counter()
    async with openai_http(srv) as http, await Client.connect(srv.url, srv.keys["good"]) as c:
        for err in (await openai_request(http, PROMPTS[0]), await ws_request(c, PROMPTS[0])):
            if err:
                raise RuntimeError(f"a request failed on a quiet server: {err}")
    async with await Client.connect(srv.url, srv.keys["evil"]) as c:
        warm = [progs["count"]] + [progs[m] for m in mixes if m in progs]
        for prog in warm:
            ex = await (await c.launch(prog, {"n": 1, "prefix": "warm-"})).wait()
            if ex.status != "finished":
                raise RuntimeError(f"{prog.name} failed on a quiet server: {ex.error}")
    print(f"warm-up (builds of {len(warm)} uploads): {time.perf_counter() - t0:.0f} s", flush=True)
    before = await wait_pages(srv, 0, 30)
    rss_before, files_before = srv.rss_mb(), srv.snapshot_files()

    rec = Recorder()
    good = [asyncio.create_task((openai_client if i % 2 == 0 else ws_client)(i, srv, rec)) for i in range(a.clients)]
    sampler = asyncio.create_task(sample_rss(srv, rec))
    t_start, rss_samples = time.perf_counter(), [(0.0, rss_before)]

    async def run_phase(name: str, kind: str) -> None:
        phase = rec.begin(name, kind)
        phase.rss_start_mb = phase.peak_rss_mb = srv.rss_mb()
        stop, evil = asyncio.Event(), []
        if kind != "quiet":
            evil = [asyncio.create_task(evil_worker(kind, k, progs, a, workdir, srv, rec, stop)) for k in range(workers(kind, a))]
        await asyncio.sleep(a.seconds)
        rec.current = None  # evil finishing its last storms counts nowhere
        stop.set()
        await asyncio.gather(*evil)
        phase.rss_end_mb = srv.rss_mb()
        if time.perf_counter() - t_start >= 30 * len(rss_samples):
            rss_samples.append((time.perf_counter() - t_start, phase.rss_end_mb))
        print(f"  {phase.name}: {len(phase.latencies_ms)} requests, {len(phase.errors)} errors, "
              f"{phase.evil_storms} storms, RSS {phase.rss_start_mb:.0f}/{phase.peak_rss_mb:.0f}/{phase.rss_end_mb:.0f} MiB",
              flush=True)  # fmt: skip

    if a.soak:  # one quiet phase, then the mixes in turn for a.soak seconds
        await run_phase("Q0", "quiet")
        n = 0
        while time.perf_counter() - t_start < a.seconds + a.soak:
            mix = mixes[n % len(mixes)]
            await run_phase(f"{mix}{n // len(mixes) + 1}", mix)
            n += 1
    else:
        for r in range(1, a.rounds + 1):
            for mix in mixes:
                await run_phase(f"Q{r}-{mix}", "quiet")
                await run_phase(f"{mix}{r}", mix)
    rec.stopping = True
    await asyncio.gather(*good, sampler)
    after = await wait_pages(srv, before["used"], 60)
    await asyncio.sleep(2)
    return {
        "phases": rec.phases,
        "pages_before": before, "pages_after": after,
        "rss_before_mb": rss_before, "rss_after_mb": srv.rss_mb(), "rss_samples": rss_samples,
        "snapshot_files_before": files_before, "snapshot_files_after": srv.snapshot_files(),
        "evil_store_keys_after": await evil_store_keys(srv),
        "server_up": srv.proc.poll() is None, "server_tracebacks": srv.tracebacks(),
    }  # fmt: skip


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(x: float) -> int | str:
    return "-" if x != x else round(x)


def summarize(res: dict[str, Any], mixes: list[str], a: argparse.Namespace) -> dict[str, Any]:
    phases: list[Phase] = res["phases"]
    per_phase = [{"phase": p.name, "mix": p.mix, "requests": len(p.latencies_ms), "errors": len(p.errors),
                  "internal_errors": p.internal_errors, "first_errors": p.errors[:5], "p50_ms": pct(p.latencies_ms, 0.5),
                  "p95_ms": pct(p.latencies_ms, 0.95), "evil_storms": p.evil_storms, "evil_launches": p.evil_launches, "evil_quota_errors": p.evil_quota_errors,
                  "evil_other_errors": p.evil_other_errors[:5], "n_evil_other_errors": len(p.evil_other_errors),
                  "rss_start_mb": p.rss_start_mb, "peak_rss_mb": p.peak_rss_mb, "rss_end_mb": p.rss_end_mb}
                 for p in phases]  # fmt: skip
    rows, out = [], {}
    for mix in mixes:
        # each mix phase against the quiet phase just before it, pooled over the rounds
        idx = [i for i, p in enumerate(phases) if p.mix == mix]
        hot = [phases[i] for i in idx]
        # the nearest quiet phase before each (--soak: the one at the start), each once
        quiet = list({id(q): q for q in ([p for p in phases[:i] if p.mix == "quiet"][-1] for i in idx)}.values())
        lq = [x for p in quiet for x in p.latencies_ms]
        lh = [x for p in hot for x in p.latencies_ms]
        r50, r95 = pct(lh, 0.5) / pct(lq, 0.5), pct(lh, 0.95) / pct(lq, 0.95)
        errs, internal = sum(len(p.errors) for p in hot), sum(p.internal_errors for p in hot)
        m = {"quiet_requests": len(lq), "requests": len(lh), "quiet_p50_ms": pct(lq, 0.5), "quiet_p95_ms": pct(lq, 0.95),
             "p50_ms": pct(lh, 0.5), "p95_ms": pct(lh, 0.95), "p50_ratio": r50, "p95_ratio": r95,
             "good_errors": errs, "good_internal_errors": internal, "quiet_errors": sum(len(p.errors) for p in quiet),
             "evil_storms": sum(p.evil_storms for p in hot),
             "evil_launches_per_s": sum(p.evil_admitted for p in hot) / (a.seconds * len(hot)), "evil_quota_errors": sum(p.evil_quota_errors for p in hot),
             "evil_other_errors": sum(len(p.evil_other_errors) for p in hot),
             "rss_start_mb": hot[0].rss_start_mb, "peak_rss_mb": max(p.peak_rss_mb for p in hot), "rss_end_mb": hot[-1].rss_end_mb,
             "meets": {"p50": r50 <= 1.3, "p95": r95 <= 2.0, "errors": errs == 0}}  # fmt: skip
        out[mix] = m
        ok = "yes" if all(m["meets"].values()) else "no"
        rows.append([mix, f"{len(lq)} / {len(lh)}", f"{ms(m['quiet_p50_ms'])} / {ms(m['p50_ms'])}", f"{r50:.2f}x",
                     f"{ms(m['quiet_p95_ms'])} / {ms(m['p95_ms'])}", f"{r95:.2f}x", f"{errs} ({internal})",
                     f"{m['evil_storms']} / {m['evil_quota_errors']} / {m['evil_other_errors']}", f"{m['evil_launches_per_s']:.1f}",
                     f"{m['rss_start_mb']:.0f} / {m['peak_rss_mb']:.0f} / {m['rss_end_mb']:.0f}", ok])  # fmt: skip
    rss_growth = res["rss_after_mb"] / res["rss_before_mb"] - 1
    peak_rss = max([res["rss_before_mb"]] + [p.peak_rss_mb for p in phases])
    good_errors = sum(len(p.errors) for p in phases)
    good_internal = sum(p.internal_errors for p in phases)
    payload = {
        "config": {
            "mixes": mixes,
            "clients": a.clients,
            "rounds": a.rounds,
            "soak_s": a.soak,
            "seconds": a.seconds,
            "forkers": a.forkers,
            "savers": a.savers,
            "launchers": a.launchers,
            "storm_launches": a.storm_launches,
            "flooders": a.flooders,
            "hogs": a.hogs,
            "builders": a.builders,
            "kv_cache_mb": a.kv_cache_mb,
            "max_pages_per_instance": 64,
            "pool_fraction_per_user": 0.5,
            "sandbox_memory_mb": SANDBOX_MB,
            "max_sandbox_memory_mb_per_user": SANDBOX_MB_PER_USER,
        },  # fmt: skip
        "mixes": out,
        "phases": per_phase,
        "good_errors": good_errors,
        "good_internal_errors": good_internal,
        "pages_before": res["pages_before"],
        "pages_after": res["pages_after"],
        "rss_before_mb": res["rss_before_mb"],
        "rss_after_mb": res["rss_after_mb"],
        "peak_rss_mb": peak_rss,
        "rss_samples": res["rss_samples"],
        "rss_growth": rss_growth,
        "snapshot_files_before": res["snapshot_files_before"],
        "snapshot_files_after": res["snapshot_files_after"],
        "evil_store_keys_after": res["evil_store_keys_after"],
        "server_up": res["server_up"],
        "server_tracebacks": res["server_tracebacks"],
        "targets": {
            "p50_le_1.3x": all(m["meets"]["p50"] for m in out.values()),
            "p95_le_2x": all(m["meets"]["p95"] for m in out.values()),
            "good_errors_0": good_errors == 0,
            "good_internal_0": good_internal == 0,
            "rss_after_within_15pct": abs(rss_growth) <= 0.15,
        },  # fmt: skip
    }
    report(
        f"Soak: {a.clients} good clients (half OpenAI, half WebSocket) against quiet phases, "
        + (f"a {a.soak:g} s hostile soak after one quiet phase" if a.soak else f"{a.rounds} round(s)")
        + f" of {a.seconds:g} s phases (targets: p50 <= 1.3x, p95 <= 2x, 0 errors)",
        ["mix", "requests Q / mix", "p50 ms Q / mix", "p50 ratio", "p95 ms Q / mix", "p95 ratio", "good errors (internal)",
         "evil storms / quota errs / other", "evil launches/s", "RSS MiB start / peak / end", "targets met"],
        rows, None,
    )  # fmt: skip
    pb, pa = res["pages_before"], res["pages_after"]
    report(
        "Server state (before: after warm-up; after: every client stopped, everything drained)",
        ["metric", "before first phase", "after last phase"],
        [["KV pages used", pb["used"], pa["used"]], ["KV pages cached", pb["cached"], pa["cached"]],
         ["server RSS MiB", round(res["rss_before_mb"]), f"{res['rss_after_mb']:.0f} ({rss_growth:+.1%}; target within 15%); peak {peak_rss:.0f}"],
         ["snapshot files on disk", res["snapshot_files_before"], res["snapshot_files_after"]],
         ["evil's store keys", "", res["evil_store_keys_after"]],
         ["server up / tracebacks in its log", "", f"{res['server_up']} / {res['server_tracebacks']}"]],
        payload,
    )  # fmt: skip
    errors = [e for p in phases for e in p.errors]
    if errors:
        print(f"\nfirst errors of good clients ({len(errors)} in all):")
        for e in errors[:5]:
            print("  " + e)
    for mix in mixes:
        other = [e for p in phases if p.mix == mix for e in p.evil_other_errors]
        if other:
            print(f"\n{mix}: evil storms that ended on something other than a quota ({len(other)}):")
            for e in dict.fromkeys(other[:20]):
                print("  " + (e or "")[:300])
    return payload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mixes", default=",".join(MIXES), help=f"comma list of hostile mixes (default all: {','.join(MIXES)})")
    ap.add_argument("--rounds", type=int, default=2, help="rounds of quiet/mix pairs")
    ap.add_argument("--seconds", type=float, default=20, help="length of each phase")
    ap.add_argument("--clients", type=int, default=32, help="well-behaved clients (half OpenAI, half WebSocket)")
    ap.add_argument("--forkers", type=int, default=2, help="fork-storm instances of user evil at once")
    ap.add_argument("--savers", type=int, default=2, help="save-storm instances of user evil at once")
    ap.add_argument("--launchers", type=int, default=4, help="connections of user evil a launch storm is spread over")
    ap.add_argument("--storm-launches", type=int, default=200, help="launches (text-completion, 16 tokens) sent at once per launch storm")
    ap.add_argument("--flooders", type=int, default=1, help="store-flood instances of user evil at once")
    ap.add_argument("--hogs", type=int, default=SANDBOX_MB_PER_USER // SANDBOX_MB + 2, help="memory hogs launched at once")
    ap.add_argument("--builders", type=int, default=2, help="new uploads launched at once (one connection each) per build storm")
    ap.add_argument("--kv-cache-mb", type=int, default=256, help="page pool (256 MiB: 364 pages of 16 tokens)")
    ap.add_argument("--soak", type=float, default=0, metavar="S",
                    help="a long hostile soak instead of rounds: one quiet phase, then the mixes in turn for S seconds (600: the 10-minute soak)")
    ap.add_argument("--cache", type=Path, help="build cache to keep and reuse across runs (default: a fresh one): the warm-up's "
                    "uploads are built once; the build loop's uploads are new every time, so they still build")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round of 6 s phases, 4 clients")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.seconds, a.clients = 1, 6, 4
    mixes = [m.strip() for m in a.mixes.split(",") if m.strip()]
    if bad := [m for m in mixes if m not in MIXES]:
        ap.error(f"unknown mix {', '.join(bad)} (known: {', '.join(MIXES)})")
    with tempfile.TemporaryDirectory(prefix="tartlet-soak-") as tmp:
        d = Path(tmp)
        progs = {}
        for name, src in (("fork", FORK_STORM), ("save", SAVE_STORM), ("store", STORE_FLOOD), ("memory", MEMORY_HOG),
                          ("count", "from tartlet import store\n\nasync def main(args):\n    return {'keys': len(store.keys())}\n")):  # fmt: skip
            progs[name] = d / f"{name}_storm.py" if name != "count" else d / "store_count.py"
            progs[name].write_text(textwrap.dedent(src))
        srv = Server(d, a.kv_cache_mb, a.cache)
        try:
            res = asyncio.run(soak(srv, progs, mixes, a, d))
        finally:
            srv.stop()
        payload = summarize(res, mixes, a)
    if a.json:
        a.json.write_text(json.dumps(payload, indent=2) + "\n")


if __name__ == "__main__":
    main()
