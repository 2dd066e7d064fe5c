"""The programmability tax: time per output token (TPOT) of greedy
text-completion as

  (a) a loop over the engine's scheduler, each pass's continuation queueing
      the next on the scheduler thread as ``generate`` does (no inferlet,
      no host API; :func:`chained_tpot`),
  (b) a native inferlet (host API + SDK, asyncio),
  (c) a WASM inferlet (the same source built into a component),

with the per-token overhead of (b) and (c) over (a) in µs and as a fraction
of (a)'s TPOT (the three alternate, order reversed every other repeat; TPOT
is the median over repeats, each overhead the median of its per-repeat
differences); also, for reference, the loop where the caller's thread
submits each pass and waits for it (:func:`direct_tpot`: a thread handoff a
token, which (a) to (c) do not pay; the baseline before 2026-11-27); plus
cold launch (first build, first compile, in a fresh cache
folder), loading the cached compiled component in a new engine, and warm
launch (``launch()``, i.e. store + instantiate, and launch to the result of a
1-token generation, model time included).

Run: ``python benchmarks/bench_wasm.py`` (``--quick`` for a short smoke run).
Timings on a shared 2-core VM are noisy; compare within one run only.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from common import load_engine, report

PROMPT = "Write a short story about a lighthouse keeper."


def direct_tpot(engine, prompt_ids: list[int], n: int) -> float:
    """(a): prefill, then ``n`` greedy decode steps submitted straight to the
    scheduler; seconds per decode step."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    seq = engine.new_sequence()
    try:
        greedy = lambda i: [OutputSlot(i, SamplerSpec(temperature=0.0))]  # noqa: E731
        tok = engine.scheduler.submit(ForwardRequest(seq, list(prompt_ids), None, None, greedy(len(prompt_ids) - 1))).result()[0]
        t0 = time.perf_counter()
        for _ in range(n):
            tok = engine.scheduler.submit(ForwardRequest(seq, [tok], None, None, greedy(0))).result()[0]
        return (time.perf_counter() - t0) / n
    finally:
        engine.scheduler.command(seq.free, seq).result()


def chained_tpot(engine, prompt_ids: list[int], n: int) -> float:
    """Prefill, then ``n`` greedy decode steps chained on the scheduler
    thread: each pass's continuation (``ForwardRequest.then``) queues the
    next one, as ``generate`` does for an inferlet (no thread handoff
    between steps); seconds per decode step."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    slot = [OutputSlot(0, SamplerSpec(temperature=0.0))]
    done, start = [0], [0.0]

    def then(results: list[object]) -> tuple[list[int], list[OutputSlot]] | None:
        done[0] += 1
        if done[0] == 1:  # the prompt's pass is done: the clock starts at the first decode step
            start[0] = time.perf_counter()
        tok = results[0]  # a greedy slot's token id
        assert isinstance(tok, int), tok
        return None if done[0] > n else ([tok], slot)

    seq = engine.new_sequence()
    try:
        first = [OutputSlot(len(prompt_ids) - 1, SamplerSpec(temperature=0.0))]
        engine.scheduler.submit(ForwardRequest(seq, list(prompt_ids), None, None, first, then=then)).result()
        return (time.perf_counter() - start[0]) / n
    finally:
        engine.scheduler.command(seq.free, seq).result()


async def inferlet_tpot(runtime, program, n: int) -> float:
    """(b)/(c): seconds per token of one instance generating ``n`` tokens,
    minus the same instance generating 1 token (cancels prefill and launch)."""
    from tartlet.host.session import Session

    async def once(k: int) -> float:
        t0 = time.perf_counter()
        inst = runtime.launch(program, {"prompt": PROMPT, "max_tokens": k, "ignore_eos": True}, Session())
        await inst.wait()
        assert inst.status.value == "finished", inst.error
        assert len(inst.result["tokens"]) == k, "generation stopped early: use a prompt that runs longer"
        return time.perf_counter() - t0

    return (await once(n + 1) - await once(1)) / n


async def main_async(opts) -> dict:
    from tartlet.host.state import HostState
    from tartlet.runtime.builder import build
    from tartlet.runtime.native import NativeRuntime
    from tartlet.runtime.program import find_program
    from tartlet.runtime.wasm import WasmRuntime
    from tartlet.runtime.wasm_engine import WasmEngine

    engine = load_engine(threads=opts.threads)
    state = HostState()
    state.add_engine(engine)
    n, reps = (8, 1) if opts.quick else (opts.tokens, opts.repeats)
    program = find_program("text-completion")
    try:
        # cold launch: a fresh cache dir, so the build and the compile both happen
        import os

        cold_dir = Path(tempfile.mkdtemp(prefix="tartlet-bench-cache-"))
        old = os.environ.get("TARTLET_CACHE_DIR")
        os.environ["TARTLET_CACHE_DIR"] = str(cold_dir)
        try:
            t0 = time.perf_counter()
            wasm_path = build(program)
            t_build = time.perf_counter() - t0
            fresh = WasmEngine()
            t0 = time.perf_counter()
            fresh.load(wasm_path)
            t_compile = time.perf_counter() - t0
            fresh2 = WasmEngine()  # a new process would find the .cwasm on disk
            t0 = time.perf_counter()
            fresh2.load(wasm_path)
            t_deserialize = time.perf_counter() - t0
            wasm_rt = WasmRuntime(state, engine=fresh2)
            # warm launch: cached component, launch to first result (1 token)
            from tartlet.host.session import Session

            warm = []
            for _ in range(3 if opts.quick else 10):
                t0 = time.perf_counter()
                inst = wasm_rt.launch(wasm_path, {"prompt": "Hi", "max_tokens": 1}, Session())
                t_launch = time.perf_counter() - t0
                await inst.wait()
                warm.append((t_launch, time.perf_counter() - t0))
            native_rt = NativeRuntime(state)
            # The three paths alternate (order reversed every other repeat), so
            # a drift in machine speed hits all of them; the overheads are the
            # medians of each repeat's paired differences, which drift (25% on
            # these VMs) disturbs far less than a difference of minima.
            ta, tb, tc, td = [], [], [], []
            for r in range(reps):
                for path in ("abcd" if r % 2 == 0 else "dcba"):
                    if path == "a":
                        ta.append(chained_tpot(engine, engine.tokenizer.encode(PROMPT), n))
                    elif path == "d":
                        td.append(direct_tpot(engine, engine.tokenizer.encode(PROMPT), n))
                    elif path == "b":
                        tb.append(await inferlet_tpot(native_rt, program, n))
                    else:
                        tc.append(await inferlet_tpot(wasm_rt, wasm_path, n))
            tpot_a, tpot_b, tpot_c = statistics.median(ta), statistics.median(tb), statistics.median(tc)
            over_b = statistics.median(b - a for a, b in zip(ta, tb))
            over_c = statistics.median(c - a for a, c in zip(ta, tc))
            frac_b = statistics.median((b - a) / a for a, b in zip(ta, tb))
            frac_c = statistics.median((c - a) / a for a, c in zip(ta, tc))
        finally:
            if old is None:
                os.environ.pop("TARTLET_CACHE_DIR", None)
            else:
                os.environ["TARTLET_CACHE_DIR"] = old
            shutil.rmtree(cold_dir, ignore_errors=True)
    finally:
        engine.close()
    rows = [
        ["(a) engine loop, chained (generate's path)", tpot_a * 1e3, 0.0, 0.0],
        ["(b) native inferlet", tpot_b * 1e3, over_b * 1e6, frac_b],
        ["(c) WASM inferlet", tpot_c * 1e3, over_c * 1e6, frac_c],
        ["(reference) engine loop, one submit per token", statistics.median(td) * 1e3,
         statistics.median(d - a for a, d in zip(ta, td)) * 1e6, statistics.median((d - a) / a for a, d in zip(ta, td))],
    ]
    report(
        f"programmability tax, text-completion, {n} tokens (medians of {reps} alternating repeats; overheads paired per repeat)",
        ["path", "TPOT ms", "overhead µs/token", "overhead / TPOT"],
        rows,
        None,
    )
    launch_rows = [
        ["cold: build (componentize-py)", t_build * 1e3],
        ["cold: compile (Cranelift) + cache", t_compile * 1e3],
        ["new process: load cached .cwasm", t_deserialize * 1e3],
        ["warm: launch() (instantiate)", statistics.median(w[0] for w in warm) * 1e3],
        ["warm: launch to result (1 token)", statistics.median(w[1] for w in warm) * 1e3],
    ]
    payload = {
        "tokens": n, "tpot_chained_ms": tpot_a * 1e3, "tpot_native_ms": tpot_b * 1e3, "tpot_wasm_ms": tpot_c * 1e3,
        "tpot_direct_ms": statistics.median(td) * 1e3,
        "wasm_overhead_us": over_c * 1e6, "native_overhead_us": over_b * 1e6,
        "wasm_overhead_frac": frac_c, "native_overhead_frac": frac_b,
        "rounds_ms": {"chained": [t * 1e3 for t in ta], "native": [t * 1e3 for t in tb], "wasm": [t * 1e3 for t in tc],
                      "direct": [t * 1e3 for t in td]},
        "build_s": t_build, "compile_s": t_compile, "load_cached_ms": t_deserialize * 1e3,
        "warm_launch_ms": statistics.median(w[0] for w in warm) * 1e3,
        "warm_launch_to_result_ms": statistics.median(w[1] for w in warm) * 1e3,
    }  # fmt: skip
    report("WASM launch", ["phase", "ms"], launch_rows, payload)
    return payload


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 tokens, 1 repeat (smoke run)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
