"""Cost of constrained decoding: time per output token (TPOT) with and without
a JSON Schema constraint, the constraint's share of each step, and the
first-mask latency (grammar compile) of a large schema.

Same engine, same prompt, same run: free and constrained generations
alternate, ``--reps`` times each, at batch 1 and at ``--batch`` concurrent
inferlets, in each of ``--modes``: ``step`` (``async for`` over
``ctx.generate``: one forward round trip through the inferlet per token)
and ``stream`` (the same with ``overlap=True``, as the OpenAI-API inferlet
generates: the host queues each next pass itself, and a host grammar is
masked and advanced there by its own copy of the matcher). The constrained
schema is an array of at least ``--tokens`` strings, so the constraint
never completes before ``max_tokens``.

Columns:
    tpot_ms: wall time per output token after the first (decode only), the
        median over repetitions and inferlets (the mean until 2026-11-26:
        one slow repetition on this noisy VM moved it by several percent).
    overhead: constrained TPOT / free TPOT - 1.
    mask_us / advance_us / check_us: llguidance time per step (mask: on the
        sampler's thread when it is its batch's only one, else on a worker
        thread; advance inline in the inferlet, and in ``stream`` mode
        also the host's copy on the scheduler thread; check: the greedy
        token validated before any mask, on the scheduler thread).
    masks/step: masks computed per step (greedy steps compute one only
        when the grammar forbids the unmasked best token).
    wait_us: per step, time the sampler waited for masks once the logits
        were there (a mask computed then, or the part of one not hidden).

Usage: ``python benchmarks/bench_constrained.py [--quick] [--tokens N]
[--reps R] [--batch B] [--modes step,stream] [--model NAME] [--mask-first]``. Prints a table, then one JSON line.
Timings depend on the machine and its load; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

from common import load_engine

PROGRAM = """
import time
from tartlet import JsonSchema, Model, Sampler

async def main(args):
    model = Model.load()
    out = {}
    if args.get("compile_schema") is not None:
        t0 = time.perf_counter()
        c = JsonSchema(args["compile_schema"])
        t1 = time.perf_counter()
        c.mask()
        t2 = time.perf_counter()
        c.close()
        out["compile_s"], out["first_mask_s"] = t1 - t0, t2 - t1
        return out
    c = JsonSchema(args["schema"]) if args["constrained"] else None
    with model.new_context() as ctx:
        ctx.user(args["prompt"])
        await ctx.flush()
        gen = ctx.generate(Sampler.greedy(), max_tokens=args["tokens"], eos=False, constraint=c,
                           overlap=args["overlap"])
        times = []
        async for step in gen:
            times.append(time.perf_counter())
        out["tokens"] = len(gen.tokens)
        out["decode_s"] = times[-1] - times[0]
        out["finish_reason"] = gen.finish_reason
    if c is not None:
        c.close()
    return out
"""


def large_schema(n: int = 60, nonce: str = "") -> dict:
    """A flat object of ``n`` mixed properties (strings, bounded ints, enums,
    pattern arrays, nested objects, bounded numbers)."""
    props: dict = {}
    for i in range(n):
        k = i % 6
        if k == 0:
            props[f"name_{i}"] = {"type": "string", "maxLength": 20}
        elif k == 1:
            props[f"count_{i}"] = {"type": "integer", "minimum": 0, "maximum": 1000}
        elif k == 2:
            props[f"kind_{i}"] = {"enum": ["alpha", "beta", "gamma", "delta"]}
        elif k == 3:
            props[f"tags_{i}"] = {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "maxItems": 4}
        elif k == 4:
            props[f"obj_{i}"] = {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "boolean"}, "z": {"type": ["string", "null"]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        else:
            props[f"ratio_{i}"] = {"type": "number", "minimum": -1.5, "maximum": 2.5}
    return {"description": nonce, "type": "object", "properties": props, "required": list(props)[: n // 2], "additionalProperties": False}


def long_schema(tokens: int) -> dict:
    return {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": tokens}},
        "required": ["items"],
        "additionalProperties": False,
    }


async def _bench(rt, prog, args_list):
    from tartlet.host.session import Session

    insts = [rt.launch(prog, a, Session()) for a in args_list]
    for i in insts:
        await i.wait()
        if i.result is None:
            raise RuntimeError(f"benchmark inferlet failed: {i.error}")
    return [i.result for i in insts]


async def main_async(opts) -> dict:
    from tartlet.engine.loading.model_store import DEFAULT_MODEL
    from tartlet.host import grammar
    from tartlet.host.state import HostState
    from tartlet.runtime.native import NativeRuntime
    from tartlet.runtime.program import load_program

    # the engine as users run it (EngineConfig defaults: a GGUF's matrices kept
    # quantized); loading the weights dequantized measured the float32
    # reference path, ~5x slower a token, until 2026-11-24
    engine = load_engine(model=opts.model or DEFAULT_MODEL, kv_cache_mb=256)
    state = HostState()
    state.add_engine(engine)
    rt = NativeRuntime(state)
    tmp = Path(tempfile.mkdtemp())
    (tmp / "bench_constrained_inferlet.py").write_text(textwrap.dedent(PROGRAM))
    prog = load_program(tmp / "bench_constrained_inferlet.py")
    report: dict = {"tokens": opts.tokens, "reps": opts.reps, "rows": []}
    try:
        # grammar compile: tokenizer bridge (once per model), then a large schema cold and cached
        t0 = time.perf_counter()
        grammar.ll_tokenizer(engine.tokenizer, engine.config.vocab_size)
        report["tokenizer_bridge_s"] = time.perf_counter() - t0
        big = large_schema(60, uuid.uuid4().hex)
        (cold,) = await _bench(rt, prog, [{"compile_schema": big}])
        (warm,) = await _bench(rt, prog, [{"compile_schema": big}])
        report["large_schema"] = {
            "properties": 60,
            "compile_ms": cold["compile_s"] * 1e3,
            "first_mask_ms": cold["first_mask_s"] * 1e3,
            "cached_compile_ms": warm["compile_s"] * 1e3,
        }
        prompt = "List as many fruits as you can."
        schema = long_schema(opts.tokens)
        for mode, batch in [(m, b) for m in opts.modes for b in sorted({1, opts.batch})]:
            tp: dict[bool, list[float]] = {False: [], True: []}
            share: dict[str, float] = {}
            for _ in range(opts.reps):
                for constrained in (False, True):
                    s0 = dict(vars(grammar.STATS))
                    args = [{"prompt": prompt, "tokens": opts.tokens, "constrained": constrained, "schema": schema,
                             "overlap": mode == "stream"}] * batch
                    res = await _bench(rt, prog, args)
                    for r in res:
                        tp[constrained].append(r["decode_s"] / max(1, r["tokens"] - 1))
                    if constrained:
                        steps = sum(r["tokens"] for r in res)
                        for k in ("mask_seconds", "advance_seconds", "wait_seconds", "check_seconds", "masks"):
                            share[k] = share.get(k, 0.0) + (vars(grammar.STATS)[k] - s0[k]) / steps / opts.reps
            free, con = statistics.median(tp[False]), statistics.median(tp[True])
            report["rows"].append({
                "mode": mode,
                "batch": batch,
                "free_tpot_ms": free * 1e3,
                "constrained_tpot_ms": con * 1e3,
                "overhead": con / free - 1,
                "mask_us": share["mask_seconds"] * 1e6,
                "advance_us": share["advance_seconds"] * 1e6,
                "wait_us": share["wait_seconds"] * 1e6,
                "check_us": share["check_seconds"] * 1e6,
                "masks_per_step": share["masks"],
                "mask_share_of_step": share["mask_seconds"] / con,
            })
    finally:
        engine.close()
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 tokens, 1 repetition, batch 2 (a smoke run)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--modes", default="step,stream",
                    help="comma-separated: step (a round trip per token), stream (overlap=True)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--mask-first", action="store_true",
                    help="compute every step's mask up front, greedy steps too (the behaviour before the greedy check)")
    opts = ap.parse_args()
    opts.modes = [m.strip() for m in opts.modes.split(",") if m.strip()]
    if not opts.modes or set(opts.modes) - {"step", "stream"}:
        ap.error(f"--modes takes step and/or stream, got {opts.modes}")
    if opts.quick:
        opts.tokens, opts.reps, opts.batch = 16, 1, 2
    if opts.mask_first:
        from tartlet.host import grammar

        grammar.GrammarOutputSlot.check_first = False
    report = asyncio.run(main_async(opts))
    report["mask_first"] = opts.mask_first
    ls = report["large_schema"]
    print(f"tokenizer bridge (once per model): {report['tokenizer_bridge_s'] * 1e3:.0f} ms")
    print(f"large schema ({ls['properties']} properties): compile {ls['compile_ms']:.1f} ms, "
          f"first mask {ls['first_mask_ms']:.2f} ms, cached compile {ls['cached_compile_ms']:.2f} ms")
    print(f"{'mode':>6} {'batch':>5} {'free ms/tok':>12} {'json ms/tok':>12} {'overhead':>9} {'mask us':>8} {'masks/step':>10} "
          f"{'check us':>8} {'advance us':>10} {'wait us':>8} {'mask share':>10}")
    for r in report["rows"]:
        print(f"{r['mode']:>6} {r['batch']:>5} {r['free_tpot_ms']:>12.2f} {r['constrained_tpot_ms']:>12.2f} {r['overhead']:>8.1%} "
              f"{r['mask_us']:>8.0f} {r['masks_per_step']:>10.2f} {r['check_us']:>8.0f} {r['advance_us']:>10.0f} "
              f"{r['wait_us']:>8.0f} {r['mask_share_of_step']:>10.1%}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
