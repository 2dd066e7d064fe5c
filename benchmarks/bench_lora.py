"""Decode throughput with LoRA adapters (issue 34): what rows with an
adapter cost, and what mixing adapters in one batch costs.

On the default model as served (quantized weights, float32 compute), for
batches of ``B`` concurrent greedy decode chains of ``--tokens`` steps
each (host-side continuations, ``ForwardRequest.then``, so the numbers are
the engine's, not an inferlet's), measures aggregate decode tokens/s for:

* ``base``: no adapter (the fused C decode step where it applies);
* ``1 adapter``: every row with one adapter (in the fused step too,
  ``decode_step.h``);
* ``4 adapters``, ``16 adapters``: row ``i`` with adapter ``i % n`` (at a
  batch smaller than ``n``, one adapter a row);
* ``1 adapter, op by op``, ``16 adapters, op by op``: the same rows with
  LoRA kept out of the fused step (``FusedDecoder.lora = False``: what
  adapter rows ran on before, the whole batch op by op).

Adapters are random (``r`` = ``--rank``, all seven projections of every
layer): the cost depends only on their shapes. The fused step reads them
in ``--lora-dtype`` (``FusedDecoder.lora_dtype``: float16 by default,
int8, float32; a comma list runs the adapter cases once per
storage, alternating with the others, the storage named in brackets;
``--no-op-by-op`` leaves out the op-by-op cases). Each figure is the median of
``--repeats`` runs, the cases alternating run by run. Prints a table and one ``JSON:`` line. Usage::

    .venv/bin/python benchmarks/bench_lora.py [--quick] [--threads 2]
    .venv/bin/python benchmarks/bench_lora.py --lora-dtype float16,int8 --no-op-by-op
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from common import load_engine, report


def random_adapter(engine: Any, name: str, rank: int, seed: int) -> Any:
    """A LoRA adapter of rank ``rank`` on every projection, random matrices (scale 1)."""
    import torch

    from tartlet.engine.models.lora import ModuleLora, build_adapter, module_shapes

    g = torch.Generator().manual_seed(seed)
    c = engine.config
    modules = {}
    for layer in range(c.num_hidden_layers):
        for mod, (_, _, out, inp) in module_shapes(c, layer).items():
            modules[(layer, mod)] = ModuleLora(torch.randn(rank, inp, generator=g) * 0.01,
                                               torch.randn(out, rank, generator=g) * 0.01, 1.0)
    adapter = build_adapter(name, Path(name), c, modules)
    engine.adapters[name] = adapter
    return adapter


def decode(engine: Any, adapters: list[Any], tokens: int) -> float:
    """Seconds for ``len(adapters)`` greedy chains (one per entry: its
    adapter or None) of ``tokens`` decode steps each after a short prompt,
    queued together; the prefill is not timed."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    sched = engine.scheduler
    pick = [OutputSlot(0, SamplerSpec(temperature=0.0))]
    prompt = engine.tokenizer.encode("Write a long story about a lighthouse keeper.")
    seqs = [engine.new_sequence() for _ in adapters]
    first = [OutputSlot(len(prompt) - 1, SamplerSpec(temperature=0.0))]
    last = []
    for seq, a in zip(seqs, adapters):  # prefill, then each chain's pending token
        last.append(int(sched.submit(ForwardRequest(seq, list(prompt), outputs=first, adapter=a)).result(600)[0]))
    reqs = []
    for seq, a, tok in zip(seqs, adapters, last):
        count = [0]

        def then(results: list[object], count: list[int] = count) -> Any:
            count[0] += 1
            return ([int(results[0])], pick) if count[0] < tokens else None  # type: ignore[call-overload]

        reqs.append(ForwardRequest(seq, [tok], outputs=pick, then=then, adapter=a))
    t0 = time.perf_counter()
    with sched._cond:  # queued before the scheduler looks: one batch
        futs = [sched.submit(r) for r in reqs]
    for f in futs:
        f.result(600)
    dt = time.perf_counter() - t0
    for seq in seqs:
        sched.command(seq.free, seq).result(60)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per chain")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--lora-dtype", default="float16",
                    help="what the fused step reads adapters as: float16, int8, float32, or a comma list of them")
    ap.add_argument("--no-op-by-op", action="store_true", help="leave out the op-by-op cases")
    a = ap.parse_args()
    dtypes = a.lora_dtype.split(",")
    if not dtypes or any(d not in ("float16", "int8", "float32") for d in dtypes):
        ap.error(f"--lora-dtype {a.lora_dtype!r}: not float16, int8, float32 or a comma list of them")
    if a.quick:
        a.tokens, a.repeats, a.batches = 4, 1, "1,3"
    import torch

    engine = load_engine(kv_cache_mb=256, threads=a.threads)
    n_adapters = 2 if a.quick else 16
    ads = [random_adapter(engine, f"a{i}", a.rank, i + 1) for i in range(n_adapters)]
    fused = engine.runner.fused
    results = []
    names: list[str] = []
    try:
        for B in [int(x) for x in a.batches.split(",")]:
            # name: (each row's adapter, LoRA in the fused step, the storage it reads)
            cases: dict[str, tuple[list[Any], bool, str]] = {"base": ([None] * B, True, dtypes[0])}
            for d in dtypes:
                tag = f" [{d}]" if len(dtypes) > 1 else ""
                cases[f"1 adapter{tag}"] = ([ads[0]] * B, True, d)
                cases[f"4 adapters{tag}"] = ([ads[i % min(4, n_adapters)] for i in range(B)], True, d)
                cases[f"{n_adapters} adapters{tag}"] = ([ads[i % n_adapters] for i in range(B)], True, d)
            if not a.no_op_by_op:
                cases["1 adapter, op by op"] = ([ads[0]] * B, False, dtypes[0])
                cases[f"{n_adapters} adapters, op by op"] = ([ads[i % n_adapters] for i in range(B)], False, dtypes[0])
            names = list(cases)
            decode(engine, [None] * B, 2)  # warm-up (and each storage's copies of the adapters)
            for d in dtypes:
                if fused is not None:
                    fused.lora_dtype = d
                decode(engine, ads[:B], 2)
            times: dict[str, list[float]] = {name: [] for name in cases}
            for _ in range(a.repeats):  # the cases alternate, so a drift in machine speed hits them all
                for name, (rows_ads, lora_fused, d) in cases.items():
                    if fused is not None:
                        fused.lora, fused.lora_dtype = lora_fused, d
                    times[name].append(decode(engine, rows_ads, a.tokens))
                if fused is not None:
                    fused.lora = True
            for name in cases:
                tps = B * a.tokens / statistics.median(times[name])
                results.append({"batch": B, "case": name, "tokens_per_s": tps, "adapters": len({id(x) for x in cases[name][0] if x}),
                                "lora_dtype": cases[name][2]})
    finally:
        engine.close()
    base = {r["batch"]: r["tokens_per_s"] for r in results if r["case"] == "base"}
    for r in results:
        r["vs_base"] = r["tokens_per_s"] / base[r["batch"]]
    rows = []
    for B in base:
        by = {r["case"]: r for r in results if r["batch"] == B}
        rows.append([B, round(base[B], 1), *[f"{by[n]['tokens_per_s']:.1f} ({by[n]['vs_base']:.2f}x)" for n in names[1:]]])
    report(f"LoRA decode throughput, tokens/s (vs base) (rank {a.rank}, {', '.join(dtypes)} in the fused step, "
           f"{torch.get_num_threads()} threads, {a.tokens} steps per chain, median of {a.repeats})",
           ["batch", *names], rows,
           {"rank": a.rank, "lora_dtype": a.lora_dtype, "threads": torch.get_num_threads(), "results": results})


if __name__ == "__main__":
    main()
