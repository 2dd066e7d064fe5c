"""Served LoRA adapters (issue 34 item 6): tokens/s of concurrent OpenAI
streams with no adapter, one adapter, and rows spread over several
adapters, on ``tartlet serve`` and side by side on llama.cpp's
``llama-server`` serving the same GGUF with the same adapters as GGUF LoRA
files.

Adapters are random (rank ``--rank``, on ``--targets``, scale 1; their cost
depends only on their shapes), written as PEFT folders
(:func:`~tartlet.engine.loading.adapter_writer.save_peft`) for Tartlet's
``[[models]] adapters`` and as GGUF LoRA files for llama-server
(``tests/lora_reference.write_gguf_lora``: what llama.cpp's
``convert_lora_to_gguf.py`` writes, Q/K ``lora_b`` rows permuted for a
llama base; the build of ``benchmarks/llamacpp.py`` keeps no sources, so
not that script itself). Cases, per concurrency (``--concurrency``):

* ``base``: no adapter (Tartlet ``"model": BASE``; llama-server no
  ``lora`` field, its adapters loaded with ``--lora-init-without-apply``);
* ``1 adapter``: every request on adapter 0 (``"model": "BASE:a0"``;
  llama-server ``"lora": [{"id": 0, "scale": 1}]``);
* ``4 adapters``, ``16 adapters``: request ``i`` on adapter ``i % n``.

Each request is a streamed ``/v1/completions`` (plain prompt, temperature
0, ``ignore_eos``, ``--tokens`` tokens, distinct prompts); a load is all of
a concurrency's requests at once, throughput = completion tokens / wall
time. Every (concurrency, case) is measured on both servers one after the
other, round after round (``--rounds``), so drift in the machine's speed
hits both; reported: medians over rounds, each case's ratio to ``base`` on
the same server (median of per-round ratios; issue 34's targets: 4
adapters >= 0.85x, 16 >= 0.7x, one >= 0.9x), and Tartlet / llama-server
per case (targets with one adapter: >= 1.0x at 1 concurrent, >= 1.5x at
16). llama-server batches only requests whose adapters are the same (its
``lora`` field), so its mixed cases run group by group.

    .venv/bin/python benchmarks/bench_adapters.py                 # 2 rounds, 1,16,64 concurrent
    .venv/bin/python benchmarks/bench_adapters.py --quick         # 1 round, 1,4 concurrent, 8 tokens
    .venv/bin/python benchmarks/bench_adapters.py --no-llama      # Tartlet alone

llama-server is built on first use (``benchmarks/llamacpp.py``, cached).
Prints a table and one ``JSON:`` line; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import llamacpp  # noqa: E402
from bench_vs_llamacpp import WORDS, model_id  # noqa: E402
from common import ROOT, exit_on_signals, model_file, report  # noqa: E402

MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
           "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def gguf_shape(model: Path) -> dict[str, int]:
    """The base model's sizes from its GGUF header (llama-style keys)."""
    import gguf

    r = gguf.GGUFReader(str(model))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()

    def num(key: str) -> int:
        f = r.fields[f"{arch}.{key}"]
        return int(f.parts[f.data[0]][0])

    hidden, heads, kv = num("embedding_length"), num("attention.head_count"), num("attention.head_count_kv")
    return {"layers": num("block_count"), "hidden": hidden, "ffn": num("feed_forward_length"), "heads": heads,
            "kv_heads": kv, "head_dim": hidden // heads, "arch": arch}  # type: ignore[dict-item]


def make_adapters(model: Path, n: int, rank: int, targets: list[str], out: Path) -> list[tuple[Path, Path]]:
    """``n`` random adapters: ``(PEFT folder, GGUF LoRA file)`` each."""
    import torch

    from lora_reference import write_gguf_lora
    from tartlet.engine.loading.adapter_writer import save_peft
    from tartlet.engine.models.lora import ModuleLora

    s = gguf_shape(model)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    shapes = {"q": (q, s["hidden"]), "k": (kv, s["hidden"]), "v": (kv, s["hidden"]), "o": (s["hidden"], q),
              "gate": (s["ffn"], s["hidden"]), "up": (s["ffn"], s["hidden"]), "down": (s["hidden"], s["ffn"])}
    made = []
    for i in range(n):
        g = torch.Generator().manual_seed(1000 + i)
        parts = {(layer, MODULES[t]): ModuleLora(torch.randn(rank, shapes[t][1], generator=g) * 0.01,
                                                 torch.randn(shapes[t][0], rank, generator=g) * 0.01, 1.0)
                 for layer in range(s["layers"]) for t in targets}
        folder = out / f"a{i}"
        folder.mkdir(parents=True, exist_ok=True)
        save_peft(parts, folder)
        made.append((folder, write_gguf_lora(folder, out / f"a{i}.gguf", s["heads"], s["kv_heads"], str(s["arch"]))))
    return made


def start_tartlet(model: Path, threads: int, adapters: list[Path], workdir: Path) -> tuple[subprocess.Popen, str]:
    """``tartlet serve`` (no auth) serving ``model`` with ``adapters`` named ``a0``, ``a1``, ..."""
    d = workdir / "tartlet-data"
    d.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "tartlet.toml"
    table = ", ".join(f"a{i} = {json.dumps(str(p))}" for i, p in enumerate(adapters))
    cfg.write_text(f"data_dir = {json.dumps(str(d))}\n[limits]\nmax_instances_per_user = 10000\n"
                   f"[[models]]\nmodel = {json.dumps(str(model))}\nthreads = {threads}\nadapters = {{ {table} }}\n")
    port = llamacpp.free_port()
    cmd = [sys.executable, "-m", "tartlet.cli.main", "serve", "--config", str(cfg), "--host", "127.0.0.1",
           "--port", str(port), "--no-auth"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(workdir / "tartlet.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        llamacpp.wait_healthy(url, proc, timeout=600)
    except BaseException:
        llamacpp.stop(proc)
        raise
    return proc, url


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> int:
    """One streamed completion; its completion tokens (from ``usage``)."""
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                raise RuntimeError(f"{url}: {ev['error']}")
            if ev.get("usage"):
                tokens = int(ev["usage"]["completion_tokens"])
    return tokens


async def load(url: str, bodies: list[dict[str, Any]]) -> tuple[float, bool]:
    """All ``bodies`` at once: (completion tokens / wall second, every request got its max_tokens)."""
    n = len(bodies)
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)) as c:
        t0 = asyncio.get_running_loop().time()
        got = await asyncio.gather(*(one(c, url, b) for b in bodies))
        wall = asyncio.get_running_loop().time() - t0
    return sum(got) / wall, all(g == b["max_tokens"] for g, b in zip(got, bodies))


def bodies(side: str, model: str, case_adapters: int, prompts: list[str], tokens: int) -> list[dict[str, Any]]:
    out = []
    for i, p in enumerate(prompts):
        b: dict[str, Any] = {"model": model, "prompt": p, "max_tokens": tokens, "temperature": 0.0, "ignore_eos": True,
                             "stream": True, "stream_options": {"include_usage": True}}
        if case_adapters:
            a = i % case_adapters
            if side == "tartlet":
                b["model"] = f"{model}:a{a}"
            else:
                b["lora"] = [{"id": a, "scale": 1.0}]
        out.append(b)
    return out


async def bench(a: argparse.Namespace, urls: dict[str, str], models: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(a.seed)
    cases = {"base": 0, "1 adapter": 1, **{f"{n} adapters": n for n in a.adapters_list if n > 1}}
    res: dict[str, Any] = {s: {str(c): {k: [] for k in cases} for c in a.concurrency} for s in urls}
    flagged = []
    for s in urls:  # warm-up: every adapter once, and the largest load (untimed)
        await load(urls[s], bodies(s, models[s], max(cases.values()), [f"warm-up {i}" for i in range(max(cases.values()))], 4))
        await load(urls[s], bodies(s, models[s], 0, [f"warm-up {i}" for i in range(max(a.concurrency))], a.tokens))
    for rnd in range(a.rounds):
        for c in a.concurrency:
            for name, n in cases.items():
                prompts = [f"{rng.choice(WORDS)}{rng.randrange(10**6)}: Write a short story about the number {i}." for i in range(c)]
                for s in urls:
                    tps, ok = await load(urls[s], bodies(s, models[s], n, prompts, a.tokens))
                    res[s][str(c)][name].append(tps)
                    if not ok:
                        flagged.append(f"round {rnd + 1}, {c} concurrent, {name}, {s}")
                    print(f"round {rnd + 1} {c:>3} concurrent  {name:11}  {s:7}  {tps:8.1f} tok/s{'' if ok else '  ! tokens'}",
                          flush=True)
    return {"per_round": res, "flagged": flagged, "cases": list(cases)}


def summarize(out: dict[str, Any], sides: list[str], conc: list[int]) -> list[list[Any]]:
    rows = []
    pr = out["per_round"]
    for c in conc:
        for name in out["cases"]:
            row: list[Any] = [c, name]
            for s in sides:
                xs, base = pr[s][str(c)][name], pr[s][str(c)]["base"]
                row += [f"{statistics.median(xs):.1f}", f"{statistics.median(x / b for x, b in zip(xs, base)):.2f}x"]
            if len(sides) == 2:
                t, ll = pr["tartlet"][str(c)][name], pr["llama"][str(c)][name]
                row.append(f"{statistics.median(x / y for x, y in zip(t, ll)):.2f}x")
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file (default: the default model's)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--adapters", default="4,16",
                    help="mixed cases: numbers of adapters, or '' for none (1 adapter and base always run)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default="q,k,v,o,gate,up,down", help=f"modules adapted, of {','.join(MODULES)}")
    ap.add_argument("--tokens", type=int, default=32, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="1 round, 1,4 concurrent, 8 tokens, 2 mixed adapters")
    ap.add_argument("--no-llama", action="store_true", help="Tartlet only")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--logs", help="folder for adapters, configs and logs (default: a temporary folder)")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.concurrency, a.tokens, a.adapters = 1, "1,4", 8, "2"
    a.concurrency = [int(x) for x in str(a.concurrency).split(",")]
    a.adapters_list = [int(x) for x in str(a.adapters).split(",") if x.strip()]
    targets = [t for t in a.targets.split(",") if t]
    model = model_file(a.model)
    a.model = str(model)
    work = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="bench-adapters-"))
    work.mkdir(parents=True, exist_ok=True)
    exit_on_signals()
    n_ad = max([1, *a.adapters_list])
    made = make_adapters(model, n_ad, a.rank, targets, work)
    procs: list[subprocess.Popen] = []
    try:
        urls = {}
        if not a.no_llama:
            extra = ["--lora", ",".join(str(g) for _, g in made), "--lora-init-without-apply"]
            lp, urls["llama"] = llamacpp.start_llama_server(model, a.threads, max(a.concurrency), 2 * (a.tokens + 64), extra,
                                                            work / "llama-server.log")
            procs.append(lp)
        tp, urls["tartlet"] = start_tartlet(model, a.threads, [p for p, _ in made], work)
        procs.append(tp)
        urls = {s: urls[s] for s in ("tartlet", "llama") if s in urls}
        models = {s: model_id(u) for s, u in urls.items()}
        out = asyncio.run(bench(a, urls, models))
    finally:
        for p in reversed(procs):
            llamacpp.stop(p)
    sides = list(urls)
    cols = ["concurrent", "case"] + [x for s in sides for x in (f"{s} tok/s", f"{s} vs base")]
    if len(sides) == 2:
        cols.append("tartlet / llama")
    meta = {"model": str(model), "threads": a.threads, "rank": a.rank, "targets": targets, "tokens": a.tokens,
            "rounds": a.rounds, "llama_server": None if a.no_llama else llamacpp.server_version()}
    report(f"Served LoRA adapters: {model.name}, rank {a.rank} on {','.join(targets)}, {a.threads} threads, "
           f"{a.tokens} tokens a request, median of {a.rounds} round(s)", cols, summarize(out, sides, a.concurrency),
           {**meta, **out})


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted (servers stopped)", file=sys.stderr)
        sys.exit(130)
