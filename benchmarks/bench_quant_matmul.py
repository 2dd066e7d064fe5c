"""The quantized GPU kernels alone (issue 39): each candidate block-size set
of :mod:`tartlet.engine.cuda.quant_matmul` (``CONFIGS``) on Llama-3-8B's
projection shapes, against bfloat16 ``F.linear`` (cuBLAS) of the same shape.

For each kind, row count and config: the time of one layer's four
projections (QKV 6144 x 4096, O 4096 x 4096, gate/up 28672 x 4096, down
4096 x 14336), best of ``--iters`` CUDA-event-timed repetitions of the
layer replayed from a CUDA graph (so launch costs are what a decode step
pays), the bandwidth reached over the quantized bytes read (values, scales,
minimums) and its fraction of the measured copy bandwidth. Configs and the
bfloat16 baseline alternate within each round. Needs a CUDA GPU and Triton.

    python benchmarks/bench_quant_matmul.py [--kinds q4,q6] [--rows 1,16,64] [--configs a,b,c]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable

import torch

from common import report

LAYER = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # (out, in) of Llama-3-8B's fused projections
TINY = [(96, 64), (64, 64), (256, 64), (64, 128)]  # --device cpu: a dry run of the script (TRITON_INTERPRET=1)
DEVICE = "cuda"
KINDS = {"q4": 1, "q5": 2, "q6": 3, "q8": 0}  # quant_formats.Q4, Q5, Q6, Q8


def graph_time(fn: Callable[[], Any], iters: int) -> float:
    """Best seconds of one call of ``fn`` replayed from a CUDA graph of 10 calls."""
    if DEVICE == "cpu":  # the dry run: wall time of plain calls
        fn()
        best = float("inf")
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    best = float("inf")
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3 / 10)
    return best


def copy_bandwidth() -> float:
    a = torch.empty(2**30 if DEVICE == "cuda" else 2**24, dtype=torch.int16, device=DEVICE)
    b = torch.empty_like(a)
    t = graph_time(lambda: b.copy_(a), 5)
    return 2 * a.numel() * 2 / t


def main() -> None:
    from tartlet.engine.cuda import quant_matmul as qm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="q4,q6")
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--configs", default=",".join(qm.CONFIGS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cuda", help="cuda; cpu (with TRITON_INTERPRET=1) only checks this script, tiny shapes")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    layer = LAYER if DEVICE == "cuda" else TINY
    kinds, rows = args.kinds.split(","), [int(r) for r in args.rows.split(",")]
    configs = args.configs.split(",")
    bw = copy_bandwidth()
    dense = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02 for n, k in layer]
    dense_bytes = sum(w.numel() * 2 for w in dense)
    table, out = [], {}
    for kind in kinds:
        weights = [qm.random_weight(KINDS[kind], n, k, DEVICE) for n, k in layer]
        qbytes = sum(w.nbytes for w in weights)
        for m in rows:
            xs = [torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16) for _, k in layer]
            best: dict[str, float] = {}
            for _ in range(args.rounds):
                for cfg in configs + ["bf16"]:
                    if cfg == "bf16":
                        t = graph_time(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, dense)], args.iters)
                    else:
                        qm.CONFIG = cfg
                        t = graph_time(lambda: [qm.quant_matmul(x, w) for x, w in zip(xs, weights)], args.iters)
                    best[cfg] = min(best.get(cfg, float("inf")), t)
            for cfg, t in best.items():
                nbytes = dense_bytes if cfg == "bf16" else qbytes
                table.append([kind, m, cfg, t * 1e6, nbytes / t / 1e9, nbytes / t / bw])
            out[f"{kind}/{m}"] = {cfg: t * 1e6 for cfg, t in best.items()}
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report(f"One Llama-3-8B layer's projections, {name} (copy bandwidth {bw / 1e9:.0f} GB/s)",
           ["kind", "rows", "config", "us", "GB/s", "of copy bw"], table,
           {"device": name, "copy_bw_GBps": bw / 1e9, "us": out})  # fmt: skip
    print(json.dumps({"ok": True}))


if __name__ == "__main__":
    main()
