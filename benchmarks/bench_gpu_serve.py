"""``tartlet serve`` on a CUDA GPU against the engine's own loop (issue 39, item 4).

A random-weight model of Llama-3-8B's shape (bench_gpu.py's ``SHAPES``,
``random_weights`` and word-level tokenizer; bfloat16, generated on the GPU
with a fixed seed) is written as a Hugging Face folder (``config.json``,
``*.safetensors`` shards, ``tokenizer.json``) into a temporary folder
(``/dev/shm`` when it has room), and served by a ``tartlet serve``
subprocess with the model on the GPU (``device = "cuda"``, ``dtype =
"bfloat16"``). The same weights also run in an in-process ``Engine``:
the direct loop of bench_gpu.py (``engine_generate``: every sequence one
request whose continuation feeds the sampled token back on the scheduler
thread). Both sit on the GPU at once (two copies of the weights plus a
KV pool each); each idles while the other is measured.

The served load is bench_vs_llamacpp.py's: ``POST /v1/completions``
streaming (``stream_options.include_usage``), ``temperature`` 0,
``ignore_eos``, ``max_tokens`` 64, a raw prompt of 32 word-tokens
(``"t12 t873 ..."``: one token per word), N requests at once (1, 16, 64,
256). The client runs in ``--clients`` worker processes (each an asyncio
loop over its share of the requests, started together at one instant) so
that parsing the events does not cap the throughput measured. The direct
loop gets the same prompts (as token ids) in the same round; the two sides
alternate which goes first round by round. Throughput counts the
completion tokens of all requests over the wall time of the load; served
TTFT is request sent -> first text chunk, TPOT (last - first text chunk) /
(tokens - 1); the direct loop's TPOT is its decode-only time per step.
By default one round at every concurrency plus a second at 64 (``--rounds``,
``--extra``), each load untimed once first on both sides. ``--set KEY=VALUE``
gives both sides an ``EngineConfig`` field (``overlap=false``, ...).
Prints a table and one JSON line; target: served / direct >= 0.85 at 64.

    python benchmarks/bench_gpu_serve.py                          # Llama-3-8B shape on cuda
    python benchmarks/bench_gpu_serve.py --shape tiny --device cpu  # dry run of the script's logic

On the device machine (Python 3.12, torch, httpx, uvloop, no registry) the
packages the server imports that its image lacks travel as cp312 wheels in
``.whl`` (git-ignored; ``pip download --no-deps`` of the versions in
``.venv``): pydantic, pydantic-core, annotated-types, typing-inspection,
typing-extensions (pydantic needs >= 4.16), starlette, uvicorn, httptools,
websockets, llguidance (imported by the host's grammar module at start),
platformdirs; the command starts with ``python3 -m pip install -q
--no-index --no-deps --no-compile --no-cache-dir --upgrade --target
/tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD``. Not needed:
gguf, wasmtime, tomli-w (not imported by this path), python-multipart,
watchfiles, sniffio (optional imports). Asserts nothing about time. The
server is stopped by PID at exit, errors and SIGTERM included; on an error
the end of its log is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, exit_on_signals, report  # noqa: E402

PROMPT, NEW = 32, 64
SHARD_BYTES = 2 << 30  # safetensors shard size (each moved to the CPU and written on its own)


# --- client worker processes (spawned: they import neither torch nor the engine) -------------------


def _client(url: str, model: str, prompts: list[str], max_tokens: int, start_at: float) -> list[dict[str, Any]]:
    """In a worker process: send ``prompts`` at once at ``start_at`` (a
    ``time.perf_counter`` instant: CLOCK_MONOTONIC, shared by the processes
    of the machine) with bench_vs_llamacpp's ``one_request``; each result
    gains ``end`` (perf_counter instant of its last byte) and ``late``
    (seconds this worker began after ``start_at``)."""
    import httpx

    from bench_vs_llamacpp import one_request

    async def one(c: httpx.AsyncClient, p: str) -> dict[str, Any]:
        r = await one_request(c, url, model, p, max_tokens)
        r["end"] = time.perf_counter()
        r.pop("text")
        return r

    async def go() -> list[dict[str, Any]]:
        n = len(prompts)
        limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
        async with httpx.AsyncClient(timeout=1800, limits=limits, verify=False) as c:  # plain HTTP: no TLS context to build
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            late = time.perf_counter() - start_at  # > 0.05 s: this worker got its share late
            rs = list(await asyncio.gather(*(one(c, p) for p in prompts)))
            for r in rs:
                r["late"] = late
            return rs

    run: Any = asyncio.run
    try:
        import uvloop

        run = uvloop.run  # uvloop >= 0.18
    except (ImportError, AttributeError):
        pass
    return list(run(go()))


def _ready() -> int:
    """In a worker process: import what ``_client`` needs ahead of the first
    load, then hold the worker a moment (so that each worker takes one)."""
    import httpx  # noqa: F401

    import bench_vs_llamacpp  # noqa: F401

    time.sleep(1.0)
    return os.getpid()


def served_load(pool: ProcessPoolExecutor, workers: int, url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """All ``prompts`` at once, split round-robin over up to ``workers``
    client processes; aggregate throughput and median latencies."""
    k = max(1, min(workers, len(prompts)))
    start = time.perf_counter() + 0.25  # every worker has its share by then
    futs: list[Future[list[dict[str, Any]]]] = [pool.submit(_client, url, model, prompts[i::k], max_tokens, start) for i in range(k)]
    rs = [r for f in futs for r in f.result(1800)]
    wall = max(r["end"] for r in rs) - start
    tpots = [r["tpot"] for r in rs if r["tpot"] is not None]
    return {
        "tok_s": sum(r["tokens"] for r in rs) / wall, "wall_s": wall, "late_s": max(r["late"] for r in rs),
        "ttft_p50": statistics.median(r["ttft"] for r in rs), "ttft_max": max(r["ttft"] for r in rs),
        "tpot_p50": statistics.median(tpots) if tpots else None,
        "ok": all(r["usage"] and r["tokens"] == max_tokens for r in rs),
        "tokens": sorted({r["tokens"] for r in rs}),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in rs if r["prompt_tokens"] is not None}),
    }  # fmt: skip


# --- the model folder and the server ---------------------------------------------------------------


def model_dir(need: int, where: str | None) -> Path:
    """A fresh folder with ``need`` bytes free: under ``where``, else
    ``/dev/shm`` (memory: no disk write), else the temp dir."""
    bases = [Path(where)] if where else [Path("/dev/shm"), Path(tempfile.gettempdir())]
    for b in bases:
        if b.is_dir() and shutil.disk_usage(b).free > need * 1.05 + (1 << 30):
            return Path(tempfile.mkdtemp(prefix="tartlet-gpu-serve-", dir=b))
    raise RuntimeError(f"no room for {need / 1e9:.1f} GB of weights in {', '.join(map(str, bases))}")


def write_model(folder: Path, shape: dict[str, Any], weights: dict[str, Any], tokenizer: Any) -> None:
    """``config.json`` (a Llama of ``shape``, no EOS: nothing ends early),
    ``tokenizer.json`` and the weights as safetensors shards of about
    ``SHARD_BYTES``, each moved to the CPU just before it is written."""
    from safetensors.torch import save_file

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
           "rms_norm_eps": 1e-5, "tie_word_embeddings": False, **shape}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tokenizer.backend.save(str(folder / "tokenizer.json"))  # bench_gpu word_tokenizer's tokenizers.Tokenizer
    shard: dict[str, Any] = {}
    size, n = 0, 0

    def flush() -> None:
        nonlocal shard, size, n
        if shard:
            n += 1
            save_file({k: v.to("cpu") for k, v in shard.items()}, str(folder / f"model-{n:05d}.safetensors"))
            shard, size = {}, 0

    for name, t in weights.items():
        shard[name] = t
        size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            flush()
    flush()


def start_server(folder: Path, device: str, kv_cache_mb: int, max_batch_tokens: int, workdir: Path,
                 log_path: Path, options: dict[str, Any]) -> tuple[subprocess.Popen[bytes], str]:
    """``tartlet serve --no-auth`` on 127.0.0.1 serving ``folder`` on
    ``device`` in bfloat16; returns at once (the model loads in the
    background: wait with ``llamacpp.wait_healthy``); its config and data
    dir go in ``workdir``, its output in ``log_path``; ``options``: more
    keys of its ``[[models]]`` table (JSON values are TOML ones here)."""
    import llamacpp

    d = workdir / "tartlet-data"
    d.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "tartlet.toml"
    cfg.write_text(
        f"data_dir = {json.dumps(str(d))}\n[limits]\nmax_instances_per_user = 100000\n"
        f"[[models]]\nmodel = {json.dumps(str(folder))}\ndevice = {json.dumps(device)}\ndtype = \"bfloat16\"\n"
        f"kv_cache_mb = {kv_cache_mb}\nmax_batch_tokens = {max_batch_tokens}\n"
        + "".join(f"{k} = {json.dumps(v)}\n" for k, v in options.items())
    )
    port = llamacpp.free_port()
    cmd = [sys.executable, "-m", "tartlet.cli.main", "serve", "--config", str(cfg), "--host", "127.0.0.1",
           "--port", str(port), "--no-auth"]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def log_tail(log_path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# --- the benchmark ----------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", help="a key of bench_gpu.SHAPES (llama3-8b, small, tiny)")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks this script (tiny shape)")
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds over every concurrency (default 1)")
    ap.add_argument("--extra", default="64:1", help="more rounds at some concurrencies, C:R,... (default 64:1)")
    ap.add_argument("--tokens", type=int, default=NEW, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--clients", type=int, default=8, help="client worker processes (default 8)")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="page pool of each side, MiB (default: room for the largest load)")
    ap.add_argument("--dir", default=None, help="where the model folder goes (default /dev/shm if it has room, else the temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for both sides, e.g. overlap=false, batch_wait_ms=1 (VALUE: JSON, else a string)")
    ap.add_argument("--log", default=None, help="file for the server's output (default: tartlet.log in a temporary folder)")
    a = ap.parse_args()
    conc = [int(x) for x in a.concurrency.split(",") if x.strip()]
    extra = {int(c): int(r) for c, r in (x.split(":") for x in a.extra.split(",") if x.strip())}
    options: dict[str, Any] = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        try:
            options[k.strip()] = json.loads(v)
        except ValueError:
            options[k.strip()] = v
    plan = [c for _ in range(a.rounds) for c in conc] + [c for c, r in extra.items() if c in conc for _ in range(r)]
    t_all = time.perf_counter()
    phases: dict[str, float] = {}
    # the client processes start first (spawned: nothing of CUDA or the engine in them)
    pool = ProcessPoolExecutor(max_workers=a.clients, mp_context=get_context("spawn"))
    for _ in range(a.clients):
        pool.submit(_ready)  # spawns the workers now: they import while the model is written
    exit_on_signals()  # so the server is stopped on SIGTERM / SIGHUP too
    proc: subprocess.Popen[bytes] | None = None
    eng: Any = None
    workdir = Path(tempfile.mkdtemp(prefix="bench-gpu-serve-"))
    log_path = Path(a.log) if a.log else workdir / "tartlet.log"
    folder: Path | None = None
    try:
        import random

        import torch

        import bench_gpu
        import llamacpp
        from bench_vs_llamacpp import model_id
        from tartlet.engine.core.engine import Engine, EngineConfig
        from tartlet.engine.loading.hf_loader import config_from_hf
        from tartlet.engine.text.tokenizer import Tokenizer

        bench_gpu.DEVICE = a.device
        shape = cast(dict[str, Any], bench_gpu.SHAPES[a.shape])
        kv_mb = a.kv_cache_mb or max(1024, max(conc) * (PROMPT + a.tokens + 32) * 2 * 2 * shape["num_hidden_layers"]
                                     * shape["num_key_value_heads"] * shape["head_dim"] // 2**20 + 256)  # fmt: skip
        max_batch = bench_gpu.LONG + 64  # bench_gpu's engines'
        # 1. weights (fixed seed, on the device), written as a Hugging Face folder
        t = time.perf_counter()
        torch.manual_seed(a.seed)
        c = argparse.Namespace(**shape)
        weights = bench_gpu.random_weights(c, torch.bfloat16)
        nbytes = sum(w.numel() * w.element_size() for w in weights.values())
        bench_gpu.sync()
        folder = model_dir(nbytes, a.dir)
        write_model(folder, shape, weights, bench_gpu.word_tokenizer(shape["vocab_size"]))
        phases["write_model_s"] = time.perf_counter() - t
        print(f"model: {nbytes / 1e9:.2f} GB of bfloat16 weights written to {folder} in {phases['write_model_s']:.1f} s", flush=True)
        # 2. the server loads it in the background while the direct engine starts and warms up
        t_srv = time.perf_counter()
        proc, url = start_server(folder, a.device, kv_mb, max_batch, workdir, log_path, options)
        tok = Tokenizer.from_hf_folder(folder)
        mcfg = config_from_hf(folder, json.loads((folder / "config.json").read_text()), tok)  # as the server reads it
        ecfg = EngineConfig(model=str(folder), device=a.device, dtype="bfloat16", kv_cache_mb=kv_mb, max_batch_tokens=max_batch, **options)
        t = time.perf_counter()
        eng = Engine(ecfg, mcfg, weights, tok)
        del weights
        phases["direct_engine_s"] = time.perf_counter() - t
        rng = random.Random(a.seed)

        def prompts(n: int) -> list[list[int]]:
            return [[rng.randrange(3, shape["vocab_size"]) for _ in range(PROMPT)] for _ in range(n)]

        t = time.perf_counter()
        for n in conc:  # Triton compiles, graphs captured for the buckets used, cuBLAS chosen
            bench_gpu.engine_generate(eng, prompts(n), a.tokens)
        phases["direct_warmup_s"] = time.perf_counter() - t
        llamacpp.wait_healthy(url, proc, timeout=900)
        phases["server_ready_s"] = time.perf_counter() - t_srv  # at most: first checked after the direct warm-up
        model = model_id(url)
        print(f"tartlet serve ready at {url} ({model}) {phases['server_ready_s']:.1f} s after its start "
              f"(checked from the end of the direct engine's warm-up, {phases['direct_warmup_s']:.1f} s)", flush=True)  # fmt: skip
        t = time.perf_counter()
        for n in conc:  # the server's own warm-up
            w = served_load(pool, a.clients, url, model, [" ".join(f"t{x}" for x in p) for p in prompts(n)], a.tokens)
            print(f"warm-up served {n:>3} concurrent  {w['tok_s']:9.1f} tok/s (untimed)", flush=True)
        phases["served_warmup_s"] = time.perf_counter() - t
        mem = torch.cuda.mem_get_info() if a.device == "cuda" else None
        # 3. alternating rounds
        per: dict[int, dict[str, list[Any]]] = {n: {"served": [], "direct": [], "ratio": []} for n in conc}
        flagged: list[str] = []
        t = time.perf_counter()
        for i, n in enumerate(plan):
            ids = prompts(n)
            texts = [" ".join(f"t{x}" for x in p) for p in ids]
            got: dict[str, Any] = {}
            for side in (("served", "direct") if i % 2 == 0 else ("direct", "served")):
                if side == "served":
                    got[side] = served_load(pool, a.clients, url, model, texts, a.tokens)
                else:
                    wall, step = bench_gpu.engine_generate(eng, ids, a.tokens)
                    got[side] = {"tok_s": n * a.tokens / wall, "wall_s": wall, "tpot": step}
            s, d = got["served"], got["direct"]
            per[n]["served"].append(s)
            per[n]["direct"].append(d)
            per[n]["ratio"].append(s["tok_s"] / d["tok_s"])
            if not s["ok"] or s["prompt_tokens"] != [PROMPT]:
                flagged.append(f"{n} concurrent: completion tokens {s['tokens']}, prompt tokens {s['prompt_tokens']}")
            if s["late_s"] > 0.05:
                flagged.append(f"{n} concurrent: a client process began {s['late_s'] * 1e3:.0f} ms late")
            tp = f"{s['tpot_p50'] * 1e3:7.2f}" if s["tpot_p50"] is not None else "      -"
            print(f"{n:>3} concurrent  served {s['tok_s']:9.1f} tok/s  TTFT p50 {s['ttft_p50'] * 1e3:8.1f} ms  TPOT p50 {tp} ms"
                  f"  | direct {d['tok_s']:9.1f} tok/s  TPOT {d['tpot'] * 1e3:7.2f} ms  | ratio {s['tok_s'] / d['tok_s']:.3f}"
                  f"{'' if s['ok'] else '  ! tokens ' + str(s['tokens'])}", flush=True)
        phases["rounds_s"] = time.perf_counter() - t
        rows, summary = [], {}
        for n in conc:
            p = per[n]
            med = {"served_tok_s": statistics.median(x["tok_s"] for x in p["served"]),
                   "direct_tok_s": statistics.median(x["tok_s"] for x in p["direct"]),
                   "ratio": statistics.median(p["ratio"]),
                   "ttft_p50_ms": statistics.median(x["ttft_p50"] for x in p["served"]) * 1e3,
                   "tpot_p50_ms": statistics.median(x["tpot_p50"] for x in p["served"] if x["tpot_p50"] is not None) * 1e3
                   if any(x["tpot_p50"] is not None for x in p["served"]) else None,
                   "direct_tpot_ms": statistics.median(x["tpot"] for x in p["direct"]) * 1e3,
                   "rounds": len(p["ratio"]), "ratio_rounds": p["ratio"], "served_rounds": p["served"],
                   "direct_rounds": p["direct"]}  # fmt: skip
            summary[n] = med
            rows.append([n, med["served_tok_s"], med["direct_tok_s"], f"{med['ratio']:.3f}", med["ttft_p50_ms"],
                         med["tpot_p50_ms"] if med["tpot_p50_ms"] is not None else "-", med["direct_tpot_ms"], med["rounds"]])  # fmt: skip
        phases["total_s"] = time.perf_counter() - t_all
        name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
        payload = {"device": name, "shape": a.shape, "weight_bytes": nbytes, "prompt_tokens": PROMPT, "tokens": a.tokens,
                   "kv_cache_mb": kv_mb, "max_batch_tokens": max_batch, "options": options, "clients": a.clients,
                   "gpu_free_total_bytes": mem, "phases_s": phases, "results": summary, "flagged": flagged,
                   "target_ratio_at_64": 0.85}  # fmt: skip
        report(f"tartlet serve vs the engine's direct loop, {a.shape} random weights, bfloat16, {name} "
               f"({PROMPT}-token raw prompts, {a.tokens} tokens, streaming /v1/completions, {a.clients} client processes)",
               ["concurrent", "served tok/s", "direct tok/s", "served/direct", "TTFT p50 ms", "TPOT p50 ms",
                "direct TPOT ms", "rounds"], rows, payload)  # fmt: skip
        print("flagged: " + "; ".join(flagged) if flagged else f"every request got {a.tokens} completion tokens for {PROMPT} prompt tokens (usage)")
        print("phases: " + ", ".join(f"{k} {v:.1f}" for k, v in phases.items()), flush=True)
    except BaseException:
        if proc is not None:
            print(f"failed; the server's log ({log_path}), its end:\n{log_tail(log_path)}", flush=True)
        raise
    finally:
        if proc is not None:
            import llamacpp

            llamacpp.stop(proc)
        if eng is not None:
            eng.close()
        pool.shutdown(cancel_futures=True)
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
