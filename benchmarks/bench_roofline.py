"""Batch-1 decode against the weight-bandwidth roofline (issue 11: >= 70%).

One decode step of one sequence reads every weight it multiplies (each
layer's projections and norms, and the output head; of the embedding only
one row, unless the head is tied to it and so reads it all), so its time is
bounded below by

    roofline = weight bytes read per token / the machine's read bandwidth.

Measured in one run, in alternating rounds (these VMs drift): the read
bandwidth (``torch.sum`` over a float32 buffer much larger than the
last-level cache, on the engine's threads), the copy bandwidth (bytes read
plus written by ``Tensor.copy_``), and the batch-1 step of the default model
(or ``--model``: any GGUF file or known name) as the engine runs it, greedy
one-token passes with no inferlet and no server, in two ways:

- chained (the headline): each pass's continuation queues the next on the
  scheduler thread, as ``generate`` runs every standard inferlet's decode
  loop (``bench_wasm.chained_tpot``);
- one submit per token: the benchmark's thread submits each pass and waits
  for its result (``bench_wasm.direct_tpot``), as an inferlet that calls
  ``forward`` token by token does; this adds a thread handoff each step.

Prints both bandwidths, the roofline, both steps and their ratios to it
(the fraction of the roofline reached), then one ``JSON:`` line. Usage::

    .venv/bin/python benchmarks/bench_roofline.py [--quick] [--threads 2] [--rounds 5]
        [--compare-small-pages | --compare-row-layout | --compare-prefetch] [--model FILE.gguf --steps 16]

Two ``--compare`` options load a second engine that differs in one
setting (4 KiB pages under the weights; Q4/Q8 weights in the row layout
rather than interleaved by 16 rows, ``quant_linear.INTERLEAVE``) and time
its chained step in the same rounds, alternating which goes first, with the median
of the per-round ratios; ``--compare-prefetch`` times the same engine with
the interleaved kernel's weight stream prefetched the way this CPU does
not by default (``QuantKernels.set_stream_prefetch``: into L1 on Intel,
non-temporally elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator

from bench_wasm import PROMPT, chained_tpot, direct_tpot
from common import load_engine, report


def read_bytes_per_token(model) -> int:
    """Weight bytes one decode step reads: every weight storage of the model,
    less the embedding's when the output head does not share it (a step reads
    one embedding row then)."""
    from tartlet.engine.loading.quant_formats import QuantWeight
    from tartlet.engine.models.quant_linear import QuantLinear

    total = model.weight_bytes()
    embed, head = model.embed, model.lm_head
    parts = [embed.q, embed.d, embed.m] if isinstance(embed, QuantWeight) else [embed]
    tied = isinstance(head, QuantLinear) and isinstance(embed, QuantWeight) and head.parts[0].q is embed.q
    if not tied and getattr(head, "weight", None) is not embed:
        total -= sum(t.untyped_storage().nbytes() for t in parts if t is not None)
    return total


def read_gbs(buf) -> float:
    """Bytes per second ``buf.sum()`` reads (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * buf.element_size() / best / 1e9


def copy_gbs(dst, src) -> float:
    """Bytes per second ``dst.copy_(src)`` reads plus writes (best of 3)."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small buffer, few steps (checks the script runs)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per round")
    ap.add_argument("--buffer-mb", type=int, default=1024, help="bandwidth buffer (MiB; >> last-level cache)")
    ap.add_argument("--model", default=None, help="a GGUF file or known model name (default: the default model)")
    cmp = ap.add_mutually_exclusive_group()
    cmp.add_argument("--compare-small-pages", action="store_true",
                     help="also load the model with huge_pages=False (4 KiB pages under the weights) and time its "
                          "step in the same rounds, alternating, with the ratio of the two")
    cmp.add_argument("--compare-row-layout", action="store_true",
                     help="also load the model with its Q4/Q8 weights in the row layout (not interleaved by 16 "
                          "rows) and time its step likewise")
    cmp.add_argument("--compare-prefetch", action="store_true",
                     help="time the same engine's step also with the interleaved kernel's weight stream "
                          "prefetched the other way (QuantKernels.set_stream_prefetch: non-temporally or "
                          "into L1, whichever is not this CPU's default), in the same rounds, alternating")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.steps, a.buffer_mb = 1, 8, 64

    import torch

    cfg = {"threads": a.threads} if a.model is None else {"threads": a.threads, "model": a.model}
    engine = load_engine(**cfg)
    small, label, key = None, "", ""
    kernels = None
    if a.compare_prefetch:
        from tartlet.engine.kernels import quant_kernels

        kernels = quant_kernels.load()
        if kernels is None:
            raise SystemExit("--compare-prefetch: the quantized kernels could not be built")
        other = "into L1 (T0)" if kernels.stream_nta else "non-temporally (NTA; Q8I T1)"
        small, label, key = engine, f"weight stream prefetched {other}", "prefetch_other"
    elif a.compare_small_pages:
        small, label, key = load_engine(**cfg, huge_pages=False), "weights on 4 KiB pages", "small_pages"
    elif a.compare_row_layout:
        with row_layout():
            small = load_engine(**cfg)
        label, key = "Q4/Q8 weights in the row layout", "row_layout"
    try:
        model = engine.model
        weight = read_bytes_per_token(model)
        ids = engine.tokenizer.encode(PROMPT)
        n = a.buffer_mb * 2**20 // 4
        buf, dst = torch.ones(n), torch.empty(n)
        reads, copies, steps, direct_steps, small_steps = [], [], [], [], []
        for e in (engine, small):  # measure the weights as they will stay
            if e is not None and e.huge_pages_thread is not None:
                e.huge_pages_thread.join()
        chained_tpot(engine, ids, 4)  # warm-up
        direct_tpot(engine, ids, 4)

        def other_step(e) -> float:  # the compared setting: another engine, or this one with the other hint
            if kernels is None:
                return chained_tpot(e, ids, a.steps)
            default = kernels.set_stream_prefetch(not kernels.stream_nta)
            try:
                return chained_tpot(e, ids, a.steps)
            finally:
                kernels.set_stream_prefetch(default)

        if small is not None:
            chained_tpot(small, ids, 4)
        for r in range(a.rounds):
            reads.append(read_gbs(buf))
            copies.append(copy_gbs(dst, buf))
            if small is not None and r % 2:  # the other engine first every other round
                small_steps.append(other_step(small))
            if r % 2:  # and the two ways of stepping in turn
                direct_steps.append(direct_tpot(engine, ids, a.steps))
            steps.append(chained_tpot(engine, ids, a.steps))
            if not r % 2:
                direct_steps.append(direct_tpot(engine, ids, a.steps))
            if small is not None and not r % 2:
                small_steps.append(other_step(small))
        read, copy, step = statistics.median(reads), statistics.median(copies), statistics.median(steps)
        direct = statistics.median(direct_steps)
        roofline = weight / (read * 1e9)
        rows = [
            ["weight bytes read per token", f"{weight / 2**20:.1f} MiB"],
            ["read bandwidth (sum)", f"{read:.1f} GB/s"],
            ["copy bandwidth (read + write)", f"{copy:.1f} GB/s"],
            ["roofline step (weights / read bandwidth)", f"{roofline * 1e3:.2f} ms"],
            ["batch-1 step, chained (generate's path)", f"{step * 1e3:.2f} ms"],
            ["fraction of the roofline", f"{roofline / step:.0%}"],
            ["batch-1 step, one submit per token", f"{direct * 1e3:.2f} ms"],
            ["fraction of the roofline", f"{roofline / direct:.0%}"],
        ]
        extra = {}
        if small_steps:
            ratio = statistics.median(b / h for h, b in zip(steps, small_steps))
            rows += [[f"batch-1 step, {label}", f"{statistics.median(small_steps) * 1e3:.2f} ms"],
                     ["that step / the default's (median of round ratios)", f"{ratio:.3f}"]]
            extra = {f"{key}_step_ms": [s * 1e3 for s in small_steps], f"{key}_over_default": ratio}
        name = "default model" if a.model is None else a.model.rsplit("/", 1)[-1]
        title = (f"batch-1 decode vs the weight-bandwidth roofline: {name} "
                 f"({model.weight_summary()}), {torch.get_num_threads()} threads, median of {a.rounds} rounds")
        report(title, ["quantity", "value"], rows, {
            "weight_bytes_per_token": weight, "read_gbs": read, "copy_gbs": copy, "roofline_ms": roofline * 1e3,
            "step_ms": step * 1e3, "fraction": roofline / step, "direct_step_ms": direct * 1e3,
            "direct_fraction": roofline / direct, "threads": torch.get_num_threads(), "model": a.model,
            "rounds": {"read_gbs": reads, "copy_gbs": copies, "step_ms": [s * 1e3 for s in steps],
                       "direct_step_ms": [s * 1e3 for s in direct_steps]}, **extra,
        })
    finally:
        engine.close()
        if small is not None and small is not engine:
            small.close()


@contextlib.contextmanager
def row_layout() -> Iterator[None]:
    """Engines loaded inside keep Q4/Q8 weights in the row layout."""
    from tartlet.engine.models import quant_linear

    quant_linear.INTERLEAVE = False
    try:
        yield
    finally:
        quant_linear.INTERLEAVE = True


if __name__ == "__main__":
    main()
