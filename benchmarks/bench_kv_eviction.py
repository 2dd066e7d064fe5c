"""Quality and cost of KV eviction under a budget (issue 36 part 5).

Two workloads (``--workload``), each cut into a ``--prefix``-token prompt
and a ``--continuation`` scored teacher-forced (the log-probability of each
of its tokens, one decode pass per token):

- ``log``: a synthetic harbour log (seeded template: ships, keepers, cargo
  and numbers that later entries refer back to; not in any training mix).
  Its next tokens depend mostly on the last lines, which favours a recency
  window. Every continuation token is scored.
- ``prose``: grounded question answering over natural English prose that
  ships with Python, the language reference of ``pydoc_data.topics`` (what
  ``help()`` shows; no download). The prompt is a seeded choice of
  reference sections ("Section: <title>" + its first prose paragraphs) and
  an instruction line; the continuation is questions on seeded sections of
  the prompt ("Q: How does the section on <title> begin?") each followed by
  its answer, the section's opening sentence quoted. Only the answer tokens
  are scored: they need tokens far back in the prompt, as the long-context
  QA and retrieval tasks of the eviction papers do (LongBench,
  needle-in-a-haystack); the questions come after the prompt, so SnapKV's
  observation window (the prompt's end) does not see them.

For the full KV cache and, for budgets of 25% / 50% / 75% of it (prefix +
continuation tokens), with each policy of ``tartlet.kv_eviction``: sliding
window + sinks (StreamingLLM), H2O, SnapKV and TOVA, each evicting after
its prefill and after every step. Columns: mean NLL (nats per scored
token) and its ratio to the full cache; KV held (the mean over the
continuation of the pages the context holds, times the bytes of a page:
partly kept pages count whole); decode tokens/s of the scoring loop (the
policies' Python bookkeeping and probe included; noisy on a shared
machine). The last rows are the probe's own cost: the full-cache loop with
an all-layer ``sum`` probe each step versus without (same tokens). Ends
with one ``JSON:`` line. Asserts nothing.

    .venv/bin/python benchmarks/bench_kv_eviction.py                    # log, 1024 + 256 tokens
    .venv/bin/python benchmarks/bench_kv_eviction.py --workload prose   # reference QA, 1024 + 256
    .venv/bin/python benchmarks/bench_kv_eviction.py --quick            # 256 + 32, to check it runs
    .venv/bin/python benchmarks/bench_kv_eviction.py --options '{"h2o": {"score": "mean", "sink": 4}}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import load_engine, report

SHIPS = ["Vesper", "Marigold", "Halcyon", "Tern", "Old Quill", "Saffron", "Brightwater", "Kestrel", "Juniper", "Osprey"]
KEEPERS = ["Ada Lindqvist", "Tomas Brenner", "Ines Okafor", "Rurik Hale", "Mei Tanaka", "Odile Fournier"]
CARGO = ["salt cod", "copper wire", "barley", "lamp oil", "slate", "wool bales", "tea chests", "iron nails"]
PORTS = ["Nordhavn", "Kelby", "Port Arran", "Saltmere", "Greyhook", "Ellisfjord"]


def harbour_log(seed: int, entries: int) -> str:
    """The seeded synthetic text: numbered log entries whose ships, keepers
    and cargo recur, with counts and berth numbers to recall."""
    rng = random.Random(seed)
    berth = {s: rng.randint(1, 40) for s in SHIPS}
    lines = ["Harbour log of the Saltmere light, kept by the watch in turn.\n"]
    for day in range(1, entries + 1):
        ship, keeper, cargo, port = rng.choice(SHIPS), rng.choice(KEEPERS), rng.choice(CARGO), rng.choice(PORTS)
        n, wind = rng.randint(12, 480), rng.choice(["north", "south-west", "east", "calm"])
        lines.append(f"Day {day}. Keeper on watch: {keeper}. Wind {wind}. The {ship} came in from {port} "
                     f"with {n} crates of {cargo} and tied up at berth {berth[ship]}. ")
        if rng.random() < 0.5:
            other = rng.choice(SHIPS)
            lines.append(f"{keeper} noted that the {other} still waits at berth {berth[other]}. ")
        lines.append("\n")
    return "".join(lines)


def reference_sections(seed: int) -> list[tuple[str, str]]:
    """Seeded shuffle of the language reference's topics that ship with the
    standard library (``pydoc_data.topics``): per topic its title and its
    first prose paragraphs (at most ~600 characters, cut at a sentence end),
    unwrapped; grammar productions and code examples (the indented blocks)
    are left out, and a colon that introduced one becomes a full stop."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        head, _, body = topics[key].partition("\n")
        paras: list[str] = []
        for p in body.lstrip("*\n").split("\n\n"):
            letters = sum(c.isalpha() for c in p)
            if not p.strip() or p.startswith(" ") or "::" in p or p.startswith("Source code") \
                    or letters < 0.7 * len(p.replace(" ", "").replace("\n", "")):
                continue
            paras.append(re.sub(r":$", ".", " ".join(p.split())))
            if sum(map(len, paras)) > 400:
                break
        text = " ".join(paras)
        if len(text) > 600:
            cut = text.rfind(". ", 0, 600)
            text = text[:cut + 1] if cut > 200 else text[:600]
        if len(text) >= 200:
            out.append((head.strip(), text))
    random.Random(seed).shuffle(out)
    return out


def opening(text: str) -> str:
    """A section's first sentence (at least 60 characters, at most 220)."""
    m = re.match(r"(.{60,}?[.;])(\s|$)", text)
    return (m.group(1) if m else text)[:220]


def reference_qa(encode: Any, seed: int, prefix: int, continuation: int) -> tuple[list[int], list[int], list[int]]:
    """The ``prose`` workload: ``prefix`` prompt token ids (sections, the
    last one cut to fit, then the instruction line), ``continuation`` ids
    (question + answer pairs on the complete sections, seeded order, cycling
    when they run out) and the indexes of the continuation's answer tokens
    (the scored ones). Pieces are tokenized apart (at line starts), so the
    indexes are exact."""
    rng = random.Random(seed)
    head = encode("Python language reference: selected sections.\n\n")
    tail = encode("\n\nQuestions on the sections above, each answered by quoting the opening sentence of its section.\n\n")
    ids, titles = list(head), []
    for title, text in reference_sections(seed):
        if len(ids) + len(tail) >= prefix:
            break
        sec = encode(f"Section: {title}\n{text}\n\n")
        if len(ids) + len(sec) + len(tail) <= prefix:
            titles.append((title, text))
        ids += sec
    room = prefix - len(tail)
    if len(ids) < room or not titles:
        raise SystemExit(f"the reference sections give fewer than {prefix} tokens")
    ids = ids[:room] + tail
    cont: list[int] = []
    scored: list[int] = []
    order: list[tuple[str, str]] = []
    while len(cont) < continuation:
        if not order:
            order = rng.sample(titles, len(titles))
        title, text = order.pop()
        cont += encode(f"Q: How does the section on {title} begin?\nA:")
        ans = encode(f" {opening(text)}\n\n")
        scored += range(len(cont), len(cont) + len(ans))
        cont += ans
    return ids, cont[:continuation], [i for i in scored if i < continuation]


PROGRAM = '''
import time
from tartlet import Model, forward, kv_eviction

async def main(args):
    model = Model.load()
    prefix, cont, method = args["prefix"], args["continuation"], args["method"]
    policy = None if method in ("full", "full+probe") else kv_eviction.make_policy(method, args["budget"], **args["options"])
    probe = [forward.attention_scores()] if method == "full+probe" else []
    lps, held = [], []
    with model.new_context() as ctx:
        ctx.fill_tokens(prefix)
        slot = [forward.logprobs(0, [cont[0]])]
        if policy is None:
            res = await ctx.forward(outputs=[forward.logprobs(len(prefix) - 1, [cont[0]])])
        else:
            res = await policy.prefill(ctx, slot)
        lps.append(res[0][0])
        t0 = time.perf_counter()
        for t in range(len(cont) - 1):
            slot = [forward.logprobs(0, [cont[t + 1]])]
            if policy is None:
                res = await ctx.forward([cont[t]], outputs=slot + probe)
            else:
                res = await policy.step(ctx, cont[t], slot)
            lps.append(res[0][0])
            held.append(policy.pages_held() if policy else -(-ctx.kv_len // model.page_size))
        dt = time.perf_counter() - t0
        live = (await ctx.stats())["live_pages"]
        kept = policy.kept_tokens if policy else ctx.kv_len
        sinks = sum(1 for j in policy.kept_positions()[:4] if j < 4) if policy else 4
    return {"lps": lps, "mean_pages": sum(held) / len(held), "live_pages": live,
            "tok_s": (len(cont) - 1) / dt, "kept": kept, "first4_kept": sinks}
'''

OPTIONS: dict[str, dict[str, Any]] = {"window": {"sink": 4}, "h2o": {}, "snapkv": {}, "tova": {}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 + 32 tokens, 50%% budget only")
    ap.add_argument("--workload", choices=("log", "prose"), default="log",
                    help="log: the synthetic harbour log; prose: QA over the language reference (pydoc_data)")
    ap.add_argument("--prefix", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--continuation", type=int, default=256, help="continuation tokens (log: all scored; prose: its answers)")
    ap.add_argument("--budgets", default="0.25,0.5,0.75", help="fractions of prefix + continuation")
    ap.add_argument("--methods", default="window,h2o,snapkv,tova")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--options", default="{}", help='JSON: options per method, e.g. {"snapkv": {"pooling": "avg"}}')
    a = ap.parse_args()
    for method, opts in json.loads(a.options).items():
        OPTIONS[method] = {**OPTIONS.get(method, {}), **opts}
    if a.quick:
        a.prefix, a.continuation, a.budgets = 256, 32, "0.5"

    from tartlet.host.state import HostState
    from tartlet.runtime.instance import Status
    from tartlet.runtime.native import NativeRuntime
    from tartlet.runtime.program import load_program

    engine = load_engine(kv_cache_mb=512)
    need = a.prefix + a.continuation
    if a.workload == "prose":
        prefix, cont, scored = reference_qa(engine.tokenizer.encode, a.seed, a.prefix, a.continuation)
    else:
        ids = engine.tokenizer.encode(harbour_log(a.seed, 400))
        if len(ids) < need:
            raise SystemExit(f"the synthetic text has {len(ids)} tokens, fewer than {need}")
        prefix, cont, scored = ids[:a.prefix], ids[a.prefix:need], list(range(a.continuation))
    page_bytes = engine.pool.nbytes() // engine.pool.num_pages
    state = HostState()
    state.add_engine(engine)
    d = Path(tempfile.mkdtemp(prefix="bench-kv-eviction-"))
    (d / "score.py").write_text(textwrap.dedent(PROGRAM))
    prog = load_program(d / "score.py")

    async def score(method: str, budget: int = 0) -> dict[str, Any]:
        rt = NativeRuntime(state)
        inst = rt.launch(prog, {"prefix": prefix, "continuation": cont, "method": method, "budget": budget,
                                "options": OPTIONS.get(method, {})})
        await inst.wait()
        if inst.status is not Status.FINISHED:
            raise RuntimeError(f"{method} @ {budget}: {inst.error}\n{inst.traceback}")
        out: dict[str, Any] = inst.result
        lps = out.pop("lps")
        out["nll"] = -sum(lps[i] for i in scored) / len(scored)
        return out

    async def go() -> tuple[list[list[Any]], dict[str, Any]]:
        full = await score("full")
        rows = [["full", need, full["nll"], 1.0, full["mean_pages"] * page_bytes / 2**20, full["tok_s"]]]
        payload: dict[str, Any] = {"workload": a.workload, "scored": len(scored), "options": OPTIONS,
                                   "prefix": a.prefix, "continuation": a.continuation, "page_bytes": page_bytes,
                                   "full": full, "runs": []}
        for frac in (float(x) for x in a.budgets.split(",")):
            budget = int(frac * need)
            for method in a.methods.split(","):
                r = await score(method, budget)
                rows.append([f"{method} {frac:.0%}", budget, r["nll"], r["nll"] / full["nll"],
                             r["mean_pages"] * page_bytes / 2**20, r["tok_s"]])
                payload["runs"].append({"method": method, "fraction": frac, "budget": budget, **r})
        probed = await score("full+probe")
        off = await score("full")
        rows.append(["full, probe off", need, off["nll"], off["nll"] / full["nll"], off["mean_pages"] * page_bytes / 2**20,
                     off["tok_s"]])
        rows.append(["full, probe on", need, probed["nll"], probed["nll"] / full["nll"],
                     probed["mean_pages"] * page_bytes / 2**20, probed["tok_s"]])
        payload["probe"] = {"off_tok_s": off["tok_s"], "on_tok_s": probed["tok_s"], "ratio": probed["tok_s"] / off["tok_s"]}
        return rows, payload

    rows, payload = asyncio.run(go())
    engine.close()
    what = "the log" if a.workload == "log" else f"the answers ({len(scored)} tokens) of QA over the language reference"
    report(f"KV eviction, workload {a.workload}: teacher-forced NLL of {what}, {a.continuation} tokens after "
           f"{a.prefix} (budget: tokens of KV kept)",
           ["method", "budget", "NLL", "vs full", "KV MiB held", "tok/s"], rows, payload)


if __name__ == "__main__":
    main()
