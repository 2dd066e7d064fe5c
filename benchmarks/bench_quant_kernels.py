"""Compute speed of the integer kernels of quantized projections, weights hot in cache.

A batch-1 decode step streams every weight from memory once; whether a
kernel can keep up with the memory depends on how many weight bytes it
multiplies per second when memory is not the limit. This measures that:
each call multiplies a few activation rows (16-bit or 8-bit blocks, as
``QuantLinear`` sends them) by one weight matrix small enough to stay in
the core's L2 cache (~0.5 MiB), on ``--threads`` OpenMP threads (default
1: a per-core figure), through the C entry point ``tq_matmul`` (no Python
between repeats beyond one ctypes call, ~1 us). Shapes are the default
model's projections (hidden 576, FFN 1536): 1536 x 576 (half of gate/up),
576 x 1536 (down), and a long row, 128 x 4096, where per-row overhead
vanishes (``--shapes`` gives others, e.g. ``512x4096``: a 7B model's
input width). The K-quant formats ``q4_k``, ``q5_k`` and ``q6_k`` (random
blocks: gguf-py cannot quantize to them) need K a multiple of 256 and
skip the shapes that are not. Each format runs in both layouts: ``rows`` (a row's
blocks in a row: the row-at-a-time integer kernel; the engine sends calls
of 8+ rows in this layout to the float panel GEMM instead, not timed here)
and ``x16`` (interleaved by 16 rows, as the engine holds them on AVX-512
VNNI: the integer kernel of ``interleaved_avx512.h``, at any row count,
for 16-bit and 8-bit activations). Best of 5 runs of ``--repeats`` calls; GMAC/s = rows x N x K /
time, GB/s = weight bytes / time (compare with the machine's read
bandwidth, ``bench_roofline.py``). Prints a table and one ``JSON:`` line.

``--against DIR`` compares this tree's kernels with another source tree's
(``DIR/tartlet``, e.g. a ``git worktree`` of an older commit; its library
is built as ``quant_kernels.load`` builds it, in a subprocess, and loaded
alongside): each case runs the two libraries' ``tq_matmul`` in pairs,
``--repeats`` pairs, the order flipped from pair to pair, and reports the
median of the per-pair time ratios (this tree / DIR: below 1, this tree is
faster) after checking that both give the same bits. On the 2-vCPU VMs a
core's speed drifts by up to 1.6x within minutes, so best-of-5 figures of
runs made one after the other cannot resolve a change of 10-20%; pairs
made microseconds apart can (repeated runs agree within ~0.03).
Usage::

    .venv/bin/python benchmarks/bench_quant_kernels.py [--threads 1] [--rows 1,4] [--bits 16] [--layouts rows,x16] [--formats q4_k,q6_k --shapes 512x4096]
    git worktree add /tmp/base HEAD~1
    .venv/bin/python benchmarks/bench_quant_kernels.py --bits 8 --layouts x16 --formats q4_k,q6_k --shapes 512x4096 --rows 16,64 --against /tmp/base
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

SHAPES = [(1536, 576), (576, 1536), (128, 4096)]
FORMATS = ["q4_0", "q4_1", "q5_1", "q8_0"]
#: K-quant formats (``--formats q4_k,q6_k``): random blocks, since gguf-py has no K-quant quantizer; their
#: speed does not depend on the values. They need K a multiple of 256 (``--shapes``, e.g. 512x4096).
KQUANTS = {"q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


def random_kquant(type_name: str, n: int, k: int, seed: int = 0):
    """A ``QuantWeight`` of random ``type_name`` blocks (uniform bytes, the
    float16 super-block scales set to 0.01 so no value is inf or NaN).

    Raises:
        ValueError: ``k`` not a multiple of 256 (a K-quant super-block).
    """
    import gguf
    import numpy as np

    from tartlet.engine.loading.quant_formats import from_gguf

    if k % 256:
        raise ValueError(f"{type_name} needs K a multiple of 256, not {k}")
    size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][1]
    b = np.random.default_rng(seed).integers(0, 256, size=(n * k // 256, size), dtype=np.uint8)
    d = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    if type_name == "Q6_K":  # ql, qh, scales, then d
        b[:, size - 2:] = d
    else:  # d, dmin first
        b[:, 0:2] = d
        b[:, 2:4] = d
    return from_gguf(b.reshape(-1), type_name, n, k)


def other_library(src: str, stream_nta: bool) -> ctypes.CDLL:
    """The quantized-kernel library of the source tree ``src`` (``src/tartlet``),
    built (or found in the cache) by that tree's own ``quant_kernels.load``
    in a subprocess, loaded here beside this tree's, its weight-stream
    prefetch set to ``stream_nta`` as this tree's is (where it has the
    setting: a library loaded by hand keeps its C default, not the policy
    its Python would pick).

    Raises:
        SystemExit: the library could not be built there.
    """
    code = (f"import sys; sys.path.insert(0, {src!r}); from tartlet.engine.kernels import quant_kernels as q; "
            "k = q.load(); print(k._lib._name if k else '')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    path = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if out.returncode or not path:
        raise SystemExit(f"--against {src}: its kernels could not be built: {out.stderr.strip()[-500:]}")
    lib = ctypes.CDLL(path)
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.tq_matmul.argtypes = [ctypes.c_int, ctypes.c_int, P, P, P, I, I, P, P, I, P, I, P, P, I]
    if hasattr(lib, "tq_set_stream_prefetch"):
        lib.tq_set_stream_prefetch(int(stream_nta))
    return lib


def paired_ratio(mine: Callable[[], object], theirs: Callable[[], object], repeats: int) -> float:
    """Median over ``repeats`` pairs of ``mine()``'s thread time / ``theirs()``'s,
    the order flipped from pair to pair."""
    ratios = []
    for i in range(repeats):
        ts = {}
        for name, f in ((("m", mine), ("t", theirs)) if i % 2 == 0 else (("t", theirs), ("m", mine))):
            t0 = time.thread_time_ns()
            f()
            ts[name] = time.thread_time_ns() - t0
        ratios.append(ts["m"] / max(ts["t"], 1))
    return statistics.median(ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4", help="activation rows per call, comma-separated")
    ap.add_argument("--bits", type=int, default=16, choices=(8, 16), help="activation precision")
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--layouts", default="rows,x16", help="rows, x16 (interleaved: Q4/Q5/Q6/Q8 kinds)")
    ap.add_argument("--shapes", default=",".join(f"{n}x{k}" for n, k in SHAPES), help="NxK matrices, comma-separated")
    ap.add_argument("--against", metavar="DIR", help="another source tree: paired time ratios against its kernels")
    a = ap.parse_args()
    if a.against and a.threads != 1:
        ap.error("--against times thread CPU time: use --threads 1")
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")]
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # read when the kernel library starts its OpenMP runtime

    import torch

    from common import report
    from tartlet.engine.kernels import quant_kernels
    from tartlet.engine.loading.quant_formats import INTERLEAVED, interleave, quantize

    qk = quant_kernels.load()
    if qk is None:
        raise SystemExit("the quantized kernels could not be built on this machine")
    other = other_library(a.against, qk.stream_nta) if a.against else None
    torch.manual_seed(0)
    rows_out, payload = [], []
    for fmt in a.formats.split(","):
        for (n, k), layout in ((s, lay) for s in shapes for lay in a.layouts.split(",")):
            if fmt in KQUANTS and k % 256:
                continue
            w = random_kquant(KQUANTS[fmt], n, k) if fmt in KQUANTS else quantize(torch.randn(n, k), fmt)
            if layout == "x16":
                if w.kind not in INTERLEAVED:
                    continue
                w = interleave(w)
            wbytes = sum(t.numel() * t.element_size() for t in (w.q, w.d, w.m) if t is not None)
            for m in (int(r) for r in a.rows.split(",")):
                qa, fa = qk.quantize(torch.randn(m, k), a.bits)
                out = torch.empty(m, n)
                args = (w.kind, a.bits, w.q.data_ptr(), w.d.data_ptr(), w.m.data_ptr() if w.m is not None else None,
                        n, k, qa.data_ptr(), fa.data_ptr(), m, out.data_ptr(), n, None, None, 0)
                call = qk._lib.tq_matmul
                for _ in range(20):
                    call(*args)
                best = float("inf")
                for _ in range(5):
                    t0 = time.perf_counter()
                    for _ in range(a.repeats):
                        call(*args)
                    best = min(best, (time.perf_counter() - t0) / a.repeats)
                gmac = m * n * k / best / 1e9
                rows_out.append([fmt, layout, f"{n} x {k}", m, f"{best * 1e6:.1f}", f"{gmac:.1f}",
                                 f"{wbytes / best / 1e9:.1f}"])
                payload.append({"format": fmt, "layout": layout, "n": n, "k": k, "rows": m, "us": best * 1e6,
                                "gmac_s": gmac, "weight_gb_s": wbytes / best / 1e9})
                if other is not None:
                    theirs = torch.empty(m, n)
                    targs = args[:10] + (theirs.data_ptr(),) + args[11:]
                    for _ in range(20):
                        other.tq_matmul(*targs)
                    if not torch.equal(out, theirs):
                        raise SystemExit(f"{fmt} {layout} {n}x{k} {m} rows: the two trees' kernels differ "
                                         f"(max {(out - theirs).abs().max().item():.3g})")
                    r = paired_ratio(lambda: call(*args), lambda: other.tq_matmul(*targs), a.repeats)
                    rows_out[-1].append(f"{r:.3f}")
                    payload[-1]["time_ratio_vs_against"] = r
    head = ["format", "layout", "N x K", "rows", "us / call", "GMAC/s", "weight GB/s"]
    report(f"integer kernels, weights hot in cache: {a.bits}-bit activations, {a.threads} thread(s), "
           f"ISA level {qk.isa}" + (f"; time ratios, median of pairs, against {a.against}" if other else ""),
           head + (["time / against"] if other else []), rows_out,
           {"threads": a.threads, "bits": a.bits, "isa": qk.isa, "against": a.against, "results": payload})


if __name__ == "__main__":
    main()
