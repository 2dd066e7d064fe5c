"""Quality and cost of KV eviction under a budget (issue 36 part 5).

Three workloads (``--workload``), each a prompt and a continuation scored
teacher-forced (the log-probability of each of its tokens, one decode pass
per token); ``log`` and ``prose`` are one sample cut into a
``--prefix``-token prompt and a ``--continuation``:

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
- ``prose-q``: the same QA with the question inside the prompt, the
  setting of the papers' LongBench and needle-in-a-haystack runs: one
  sample per complete section of ``prose``'s prompt (``--samples N``: a
  seeded choice of N), each prompt being ``prose``'s ``--prefix`` tokens
  (same sections, same instruction line) followed by one question
  ("Q: How does the section on <title> begin?\nA:"); the continuation is
  its answer (the section's opening sentence, as ``prose`` quotes it), all
  of it scored. SnapKV's observation window and TOVA's last query read the
  question, and H2O's prompt scores include its queries. NLL is the mean
  over the answer tokens of every sample; the budget of a sample is the
  fraction of its own prompt + answer (the table shows their mean). Two
  more columns: the mean fraction of the asked section's opening sentence
  (the tokens the answer copies: ``source``) and of the document kept
  after the prefill ("src kept", "doc kept"); the JSON gives per sample
  and run the same for the section's heading, the whole section and the
  question, after the prefill and at the end.

For the full KV cache and, for budgets of 25% / 50% / 75% of it (prompt +
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
    .venv/bin/python benchmarks/bench_kv_eviction.py --workload prose-q # question in the prompt, 1024 + ~15 + answer
    .venv/bin/python benchmarks/bench_kv_eviction.py --quick            # 256 + 32, to check it runs
    .venv/bin/python benchmarks/bench_kv_eviction.py --options '{"h2o": {"score": "mean", "sink": 4}}'
    .venv/bin/python benchmarks/bench_kv_eviction.py --methods h2o,snapkv,tova \
        --options '{"h2o": {"chunk": 16}, "snapkv": {"chunk": 16}, "tova": {"chunk": 16}}'  # ChunkKV, page chunks
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import textwrap
from dataclasses import dataclass, field
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


@dataclass
class Sample:
    """One scored run: ``prompt`` token ids (prefilled), ``cont`` ids (fed
    one decode pass each, teacher-forced), ``scored``: the indexes into
    ``cont`` whose log-probabilities count, and ``spans``: named ``[start,
    end)`` ranges of prompt positions whose kept tokens the diagnostics
    count (``prose-q``: ``source``, ``title``, ``section``, ``question``,
    ``document``)."""

    prompt: list[int]
    cont: list[int]
    scored: list[int]
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)


def section_piece(title: str, text: str) -> str:
    return f"Section: {title}\n{text}\n\n"


def question_piece(title: str) -> str:
    return f"Q: How does the section on {title} begin?\nA:"


def answer_piece(text: str) -> str:
    return f" {opening(text)}\n\n"


def reference_prompt(encode: Any, seed: int, prefix: int) -> tuple[list[int], list[tuple[str, str, int]]]:
    """``prose``'s prompt: ``prefix`` token ids (a heading, the seeded
    sections with the last one cut to fit, then the instruction line) and
    the complete sections as ``(title, text, first position)``, in prompt
    order. Pieces are tokenized apart (at line starts), so positions are
    exact. Raises SystemExit when the sections give fewer tokens."""
    head = encode("Python language reference: selected sections.\n\n")
    tail = encode("\n\nQuestions on the sections above, each answered by quoting the opening sentence of its section.\n\n")
    ids, titles = list(head), []
    for title, text in reference_sections(seed):
        if len(ids) + len(tail) >= prefix:
            break
        sec = encode(section_piece(title, text))
        if len(ids) + len(sec) + len(tail) <= prefix:
            titles.append((title, text, len(ids)))
        ids += sec
    room = prefix - len(tail)
    if len(ids) < room or not titles:
        raise SystemExit(f"the reference sections give fewer than {prefix} tokens")
    return ids[:room] + tail, titles


def reference_qa(encode: Any, seed: int, prefix: int, continuation: int) -> tuple[list[int], list[int], list[int]]:
    """The ``prose`` workload: ``prefix`` prompt token ids
    (:func:`reference_prompt`), ``continuation`` ids (question + answer
    pairs on the complete sections, seeded order, cycling when they run
    out) and the indexes of the continuation's answer tokens (the scored
    ones)."""
    rng = random.Random(seed)
    ids, titles = reference_prompt(encode, seed, prefix)
    cont: list[int] = []
    scored: list[int] = []
    order: list[tuple[str, str, int]] = []
    while len(cont) < continuation:
        if not order:
            order = rng.sample(titles, len(titles))
        title, text, _ = order.pop()
        cont += encode(question_piece(title))
        ans = encode(answer_piece(text))
        scored += range(len(cont), len(cont) + len(ans))
        cont += ans
    return ids, cont[:continuation], [i for i in scored if i < continuation]


def reference_qa_in_prompt(encode: Any, seed: int, prefix: int, samples: int = 0) -> list[Sample]:
    """The ``prose-q`` workload: per asked section, ``prose``'s prompt
    (:func:`reference_prompt`, the same for every sample) followed by one
    question on it, then its answer as the continuation, every token scored.
    ``samples`` <= 0 asks every complete section once, in prompt order;
    otherwise a ``seed``-seeded choice of that many (at most all).

    ``spans`` of each sample (prompt positions): ``source``, the asked
    section's opening sentence (what the answer quotes); ``title``, its
    heading line (what the question names); ``section``, the whole section;
    ``question``; ``document``, the prompt before the question."""
    body, titles = reference_prompt(encode, seed, prefix)
    picks = titles if samples <= 0 else random.Random(seed).sample(titles, min(samples, len(titles)))
    out = []
    for title, text, start in picks:
        q = encode(question_piece(title))
        ans = encode(answer_piece(text))
        head = len(encode(f"Section: {title}\n"))
        src = len(encode(f"Section: {title}\n{opening(text)}"))
        spans = {"source": (start + head, start + src), "title": (start, start + head),
                 "section": (start, start + len(encode(section_piece(title, text)))),
                 "question": (len(body), len(body) + len(q)), "document": (0, len(body))}
        out.append(Sample(body + q, ans, list(range(len(ans))), spans))
    return out


def kept_fractions(sample: Sample, kept: list[int] | None) -> dict[str, float]:
    """Per span of ``sample``, the fraction of its positions in ``kept``
    (ascending positions; None: all kept)."""
    if kept is None:
        return {name: 1.0 for name in sample.spans}
    have = set(kept)
    return {name: sum(1 for j in range(a, b) if j in have) / max(1, b - a) for name, (a, b) in sample.spans.items()}


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
        after = policy.kept_positions() if policy is not None and args.get("positions") else None
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
        end = policy.kept_positions() if policy is not None and args.get("positions") else None
    out = {"lps": lps, "mean_pages": sum(held) / len(held), "live_pages": live,
           "tok_s": (len(cont) - 1) / dt, "kept": kept, "first4_kept": sinks}
    if args.get("positions"):
        out["kept_prefill"], out["kept_end"] = after, end
    return out
'''

OPTIONS: dict[str, dict[str, Any]] = {"window": {"sink": 4}, "h2o": {}, "snapkv": {}, "tova": {}}
#: ``--workload`` values.
WORKLOADS = ("log", "prose", "prose-q")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="256 + 32 tokens (prose-q: 2 samples), 50%% budget only")
    ap.add_argument("--workload", choices=WORKLOADS, default="log",
                    help="log: the synthetic harbour log; prose: QA over the language reference (pydoc_data), "
                         "questions after the prompt; prose-q: one question at the prompt's end per sample")
    ap.add_argument("--prefix", type=int, default=1024, help="prompt tokens (prose-q: before the question)")
    ap.add_argument("--continuation", type=int, default=256,
                    help="continuation tokens (log: all scored; prose: its answers; prose-q: unused, the answer)")
    ap.add_argument("--samples", type=int, default=0,
                    help="prose-q: questions, one sample each (0: every complete section of the prompt)")
    ap.add_argument("--budgets", default="0.25,0.5,0.75", help="fractions of prompt + continuation")
    ap.add_argument("--methods", default="window,h2o,snapkv,tova")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--model", default=None, help="model name or GGUF path (default: the default model)")
    ap.add_argument("--options", default="{}", help='JSON: options per method, e.g. {"snapkv": {"pooling": "avg"}}')
    a = ap.parse_args()
    for method, opts in json.loads(a.options).items():
        OPTIONS[method] = {**OPTIONS.get(method, {}), **opts}
    if a.quick:
        a.prefix, a.continuation, a.budgets = 256, 32, "0.5"
        a.samples = a.samples or 2

    from tartlet.host.state import HostState
    from tartlet.runtime.instance import Status
    from tartlet.runtime.native import NativeRuntime
    from tartlet.runtime.program import load_program

    engine = load_engine(kv_cache_mb=512, **({"model": a.model} if a.model else {}))
    samples = build_samples(a.workload, engine.tokenizer.encode, a.seed, a.prefix, a.continuation, a.samples)
    scored_n = sum(len(s.scored) for s in samples)
    page_bytes = engine.pool.nbytes() // engine.pool.num_pages
    state = HostState()
    state.add_engine(engine)
    d = Path(tempfile.mkdtemp(prefix="bench-kv-eviction-"))
    (d / "score.py").write_text(textwrap.dedent(PROGRAM))
    prog = load_program(d / "score.py")
    diag = a.workload == "prose-q"

    async def score_one(s: Sample, method: str, budget: int) -> dict[str, Any]:
        rt = NativeRuntime(state)
        inst = rt.launch(prog, {"prefix": s.prompt, "continuation": s.cont, "method": method, "budget": budget,
                                "options": OPTIONS.get(method, {}), "positions": diag})
        await inst.wait()
        if inst.status is not Status.FINISHED:
            raise RuntimeError(f"{method} @ {budget}: {inst.error}\n{inst.traceback}")
        out: dict[str, Any] = inst.result
        lps = out.pop("lps")
        out["lp_sum"] = sum(lps[i] for i in s.scored)
        if diag:
            out["kept_prefill"] = kept_fractions(s, out.pop("kept_prefill"))
            out["kept_end"] = kept_fractions(s, out.pop("kept_end"))
        return out

    async def score(method: str, frac: float = 1.0) -> dict[str, Any]:
        """Every sample with ``method`` at ``frac`` of its prompt + continuation."""
        per = []
        for s in samples:
            budget = int(frac * (len(s.prompt) + len(s.cont)))
            r = await score_one(s, method, budget)
            per.append({"budget": budget, "steps": len(s.cont) - 1, "scored": len(s.scored), **r})
        return aggregate(per)

    async def go() -> tuple[list[list[Any]], dict[str, Any]]:
        full = await score("full")

        def row(label: str, r: dict[str, Any]) -> list[Any]:
            out = [label, round(r["budget"]), r["nll"], r["nll"] / full["nll"], r["mean_pages"] * page_bytes / 2**20,
                   r["tok_s"]]
            return out + [r["source_kept"], r["document_kept"]] if diag else out

        rows = [row("full", full)]
        payload: dict[str, Any] = {"model": engine.cfg.model, "workload": a.workload, "scored": scored_n, "options": OPTIONS,
                                   "prefix": a.prefix, "continuation": a.continuation, "page_bytes": page_bytes,
                                   "full": full, "runs": []}
        if diag:
            payload.update(seed=a.seed, samples=len(samples), continuation=None)
        for frac in (float(x) for x in a.budgets.split(",")):
            for method in a.methods.split(","):
                r = await score(method, frac)
                rows.append(row(f"{method} {frac:.0%}", r))
                payload["runs"].append({"method": method, "fraction": frac, **r})
        probed = await score("full+probe")
        off = await score("full")
        rows.append(row("full, probe off", off))
        rows.append(row("full, probe on", probed))
        payload["probe"] = {"off_tok_s": off["tok_s"], "on_tok_s": probed["tok_s"], "ratio": probed["tok_s"] / off["tok_s"]}
        return rows, payload

    rows, payload = asyncio.run(go())
    engine.close()
    what = {"log": "the log",
            "prose": f"the answers ({scored_n} tokens) of QA over the language reference",
            "prose-q": f"the answers ({scored_n} tokens, {len(samples)} samples) to a question at the prompt's end "
                       "on the language reference"}[a.workload]
    after = "their prompts" if diag else f"{a.prefix}"
    report(f"KV eviction, {Path(engine.cfg.model).name}, workload {a.workload}: teacher-forced NLL of {what}, "
           f"{a.continuation if not diag else 'answer'} tokens after {after} (budget: tokens of KV kept"
           f"{', mean over samples' if diag else ''})",
           ["method", "budget", "NLL", "vs full", "KV MiB held", "tok/s"] + (["src kept", "doc kept"] if diag else []),
           rows, payload)


def build_samples(workload: str, encode: Any, seed: int, prefix: int, continuation: int, samples: int) -> list[Sample]:
    """The samples of ``workload`` (:data:`WORKLOADS`): one for ``log`` and
    ``prose``, one per question for ``prose-q``. Raises SystemExit when the
    text is too short."""
    if workload == "prose-q":
        return reference_qa_in_prompt(encode, seed, prefix, samples)
    if workload == "prose":
        return [Sample(*reference_qa(encode, seed, prefix, continuation))]
    need = prefix + continuation
    ids = encode(harbour_log(seed, 400))
    if len(ids) < need:
        raise SystemExit(f"the synthetic text has {len(ids)} tokens, fewer than {need}")
    return [Sample(ids[:prefix], ids[prefix:need], list(range(continuation)))]


def aggregate(per: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures over its samples: NLL over every scored token,
    pages held per decode step, tokens/s over all steps, the means of the
    budget, the kept tokens and the pages live at the end, the fewest of the
    first 4 tokens kept; with diagnostics, ``source_kept`` (the mean
    fraction of the answer's source sentence kept after the prefill),
    ``document_kept`` (the same for the document), ``source_whole`` (the
    samples that kept every token of it) and the samples' own figures.
    One sample: its own figures."""
    steps = sum(r["steps"] for r in per)
    out: dict[str, Any] = {
        "budget": statistics.mean(r["budget"] for r in per),
        "mean_pages": sum(r["mean_pages"] * r["steps"] for r in per) / steps,
        "live_pages": statistics.mean(r["live_pages"] for r in per),
        "tok_s": steps / sum(r["steps"] / r["tok_s"] for r in per),
        "kept": statistics.mean(r["kept"] for r in per),
        "first4_kept": min(r["first4_kept"] for r in per),
        "nll": -sum(r["lp_sum"] for r in per) / sum(r["scored"] for r in per),
    }
    if "kept_prefill" in per[0]:
        out["source_kept"] = statistics.mean(r["kept_prefill"]["source"] for r in per)
        out["document_kept"] = statistics.mean(r["kept_prefill"]["document"] for r in per)
        out["source_whole"] = sum(r["kept_prefill"]["source"] == 1.0 for r in per)
        out["samples"] = [{k: v for k, v in r.items() if k not in ("steps", "tok_s")} | {"nll": -r["lp_sum"] / r["scored"]}
                          for r in per]
    return out


if __name__ == "__main__":
    main()
