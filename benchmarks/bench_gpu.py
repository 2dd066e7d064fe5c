"""The engine on a CUDA GPU against transformers ``generate`` (issue 15).

A random-weight model of Llama-3-8B's shape (bfloat16, created on the GPU:
nothing that large is downloaded) runs in the engine and in transformers
side by side, in alternating rounds:

* decode: ``N`` concurrent sequences (1, 16, 64, 256) each prefill a
  32-token prompt and decode 64 tokens greedily (the engine's steps chained
  on the scheduler thread, as the host ``generate`` call chains them;
  transformers: one ``generate`` call over the batch, ``min_new_tokens`` =
  ``max_new_tokens`` = 64). Throughput counts the 64 x N new tokens over the
  wall time of the whole request, prefill included; TPOT is the engine's
  decode-only time per step.
* prefill: one 2,048-token prompt (tokens per second, time to first token).
* roofline: batch-1 decode against the time to read the weight bytes once
  at the GPU's measured copy bandwidth (a device-to-device copy, bytes read
  plus written over its time).

Also the engine with its CUDA graphs off (every op launched from Python),
to show what the graphs buy, and the engine with graphs run with overlap
scheduling off (``sync``: the next step built only after this one's tokens
reached the host; on by default on CUDA, ``tartlet/engine/core/lookahead.py``),
alternating with it on the same engine. Needs a CUDA GPU and Triton; prints a table
and one JSON line.

``--weights q4|q6|q8`` (default ``bf16``): the engine's projections are
random quantized weights built directly on the GPU in the repacked block
layout (kinds Q4, Q6, Q8 of :mod:`tartlet.engine.loading.quant_formats`, 5, 7
and 8.5 bits per weight) and multiplied by the Triton kernels of
:mod:`tartlet.engine.cuda.quant_matmul`; the embedding and the output head
stay bfloat16, as stored. The roofline then counts the bytes a step reads:
the quantized values, scales and minimums, the head, one embedding row.
Transformers keeps bfloat16 weights. ``--only-decode`` skips the engine
without graphs, the prefill and the tax (a quick device check):

    python benchmarks/bench_gpu.py [--shape llama3-8b|small|tiny] [--rounds 2]
    python benchmarks/bench_gpu.py --weights q4 --concurrency 1,64 --rounds 1 --no-hf --only-decode

``--only-tax`` runs only the native tax, text-completion inferlets against
the direct loop in alternating rounds (``--tax-concurrency``, default 1,64);
on the CPU with ``--shape micro`` it shows the host's share per token:

    python benchmarks/bench_gpu.py --device cpu --shape micro --only-tax --rounds 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch

from common import report, run_inferlets

SHAPES = {  # Llama-3-8B (config.json of meta-llama/Meta-Llama-3-8B) and a small one for a quick check
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                      max_position_embeddings=8192),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, max_position_embeddings=4096),
    # --device cpu: a model so small that the host's work per token (scheduler, token streams, inferlets) shows
    "micro": dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, max_position_embeddings=4096),
    "small": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                  num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096),
}  # fmt: skip
PROMPT, NEW, LONG = 32, 64, 2048
DEVICE = "cuda"  # --device cpu: a dry run of this script's logic (no Triton kernel, no graphs)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


#: ``--weights`` choices: the kind of the projections (None: bfloat16 tensors)
WEIGHT_KINDS = {"bf16": None, "q4": 1, "q6": 3, "q8": 0}  # quant_formats.Q4, Q6, Q8


def random_weights(c: Any, dtype: torch.dtype, kind: int | None = None) -> dict[str, Any]:
    """Hugging Face-named random weights of a Llama of config ``c``, on the
    GPU; with ``kind``, the projections are random quantized weights of that
    kind (:func:`tartlet.engine.cuda.quant_matmul.random_weight`), the
    embedding, head and norms stay ``dtype``."""
    from tartlet.engine.cuda.quant_matmul import random_weight

    def dense(*shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=DEVICE).normal_(0, 0.02)

    def w(*shape: int) -> Any:
        return dense(*shape) if kind is None or len(shape) == 1 else random_weight(kind, shape[0], shape[1], DEVICE)

    H, I, hd = c.hidden_size, c.intermediate_size, c.head_dim
    out = {"model.embed_tokens.weight": dense(c.vocab_size, H), "model.norm.weight": 1 + w(H), "lm_head.weight": dense(c.vocab_size, H)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": 1 + w(H), p + "post_attention_layernorm.weight": 1 + w(H),
                p + "self_attn.q_proj.weight": w(c.num_attention_heads * hd, H),
                p + "self_attn.k_proj.weight": w(c.num_key_value_heads * hd, H),
                p + "self_attn.v_proj.weight": w(c.num_key_value_heads * hd, H),
                p + "self_attn.o_proj.weight": w(H, c.num_attention_heads * hd),
                p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H), p + "mlp.down_proj.weight": w(H, I)}  # fmt: skip
    return out


def word_tokenizer(vocab: int) -> Any:
    """A word-level tokenizer of ``vocab`` tokens (the engine wants one; nothing here decodes text)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models, pre_tokenizers

    from tartlet.engine.text.tokenizer import Tokenizer

    d = Path(tempfile.mkdtemp())
    tok = HFTokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return Tokenizer.from_hf_folder(d)


def make_engine(shape: dict[str, Any], graphs: bool, kv_cache_mb: int, kind: int | None = None) -> Any:
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.engine.models.config import ModelConfig

    c = ModelConfig(architecture="llama", name="random", eos_token_ids=(), **shape)
    # quantized weights on the CPU (--device cpu, a dry run): the quantized CPU kernels, in float32
    dtype = "float32" if kind is not None and DEVICE == "cpu" else "bfloat16"
    cfg = EngineConfig(model="random", device=DEVICE, dtype=dtype, kv_cache_mb=kv_cache_mb,
                       max_batch_tokens=LONG + 64, cuda_graphs=graphs)  # fmt: skip
    return Engine(cfg, c, random_weights(c, cfg.torch_dtype(), kind), word_tokenizer(c.vocab_size))


def engine_generate(eng: Any, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """Greedy ``new`` tokens for every prompt at once, each sequence one
    request whose continuation feeds the sampled token back (as the host
    ``generate`` call runs); returns (wall seconds, seconds per decode step
    after the first token)."""
    from tartlet.engine.core.requests import ForwardRequest
    from tartlet.engine.core.sampler import OutputSlot, SamplerSpec

    sch = eng.scheduler
    slot = [OutputSlot(0, SamplerSpec(temperature=0.0))]
    seqs = [eng.new_sequence() for _ in prompts]
    first: list[float] = []

    def continuation() -> Any:
        left = [new]

        def then(results: list[object]) -> tuple[list[int], list[OutputSlot]] | None:  # on the scheduler thread
            if left[0] == new:
                first.append(time.perf_counter())
            left[0] -= 1
            return ([int(cast(int, results[0]))], slot) if left[0] else None

        return then

    t0 = time.perf_counter()
    futs = [sch.submit(ForwardRequest(s, p, outputs=[OutputSlot(len(p) - 1, slot[0].spec)], then=continuation(),
                                      feed_back=slot[0]))  # each next pass feeds the token back: overlap applies
            for s, p in zip(seqs, prompts)]  # fmt: skip
    for f in futs:
        f.result(600)
    t1 = time.perf_counter()
    for s in seqs:
        sch.command(s.free, s).result(60)
    return t1 - t0, (t1 - max(first)) / max(1, new - 1)


def hf_generate(model: Any, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts, device=DEVICE)
    sync()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                   pad_token_id=0)  # fmt: skip
    sync()
    return time.perf_counter() - t0


def set_overlap(eng: Any, on: bool) -> None:
    """Turn the engine's overlap scheduling on or off (between runs, while
    it is idle: the scheduler reads the flag each round)."""
    eng.scheduler.overlap = on


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy (read + written), best of 5."""
    n = 2**32 if DEVICE == "cuda" else 2**28
    a = torch.empty(n // 2, dtype=torch.int16, device=DEVICE)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(6):
        sync()
        t = time.perf_counter()
        b.copy_(a)
        sync()
        best = min(best, time.perf_counter() - t)
    del a, b
    return 2 * n / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=list(SHAPES), default="llama3-8b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--device", default="cuda", help="cuda; cpu only checks this script (tiny shapes)")
    ap.add_argument("--weights", choices=list(WEIGHT_KINDS), default="bf16",
                    help="projection weights: bfloat16, or random quantized ones in the GPU kernels' layout")
    ap.add_argument("--no-eager", action="store_true", help="skip the engine without CUDA graphs")
    ap.add_argument("--only-decode", action="store_true",
                    help="decode with graphs only: no engine without graphs, no prefill, no tax (a quick check)")  # fmt: skip
    ap.add_argument("--only-tax", action="store_true",
                    help="only the native tax (text-completion inferlets against the direct loop, alternating rounds)")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave the collector as it is (tartlet serve and run call host.state.gc_for_serving once loaded)")
    ap.add_argument("--switch-interval", type=float, default=None,
                    help="ms: sys.setswitchinterval (default 5): how long a thread holding the GIL keeps it from "
                         "one that waits (the scheduler thread back from the GPU, behind the inferlets' loop)")
    ap.add_argument("--tax-concurrency", default="1,64", help="concurrencies of the tax section")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's top kernels of a 2,048-token prefill and of batch-1 decode steps")  # fmt: skip
    args = ap.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval / 1e3)
    global DEVICE
    DEVICE = args.device
    shape = SHAPES[args.shape]
    conc = [int(x) for x in args.concurrency.split(",")]
    tax_conc = [int(x) for x in args.tax_concurrency.split(",")]
    if args.only_tax:
        conc = tax_conc
    g = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int = PROMPT) -> list[list[int]]:
        return torch.randint(3, shape["vocab_size"], (n, length), generator=g).tolist()

    bw = copy_bandwidth()
    kv_mb = max(4096, (max(conc) * (PROMPT + NEW + 16) + LONG) * 2 * 2 * shape["num_hidden_layers"]
                * shape["num_key_value_heads"] * shape["head_dim"] // 2**20 + 256)  # fmt: skip
    kind = WEIGHT_KINDS[args.weights]
    engines = {"graphs": make_engine(shape, True, kv_mb, kind)}
    if not (args.only_decode or args.no_eager or args.only_tax):
        engines["eager"] = make_engine(shape, False, kv_mb, kind)
    # the engine with graphs, run with overlap scheduling (its default on CUDA) and without ("sync")
    variants = {"graphs": (engines["graphs"], True), "sync": (engines["graphs"], False)}
    if "eager" in engines:
        variants["eager"] = (engines["eager"], True)
    m = engines["graphs"].model
    dg = engines["graphs"].runner.graphs
    # bytes a decode step reads: every weight but the embedding table (one row of it)
    weight_bytes = m.weight_bytes() - m.embed.numel() * m.embed.element_size()
    hf = None
    if not (args.no_hf or args.only_tax):
        import transformers

        try:
            cfg = transformers.LlamaConfig(**shape, tie_word_embeddings=False)
            with torch.device(DEVICE):
                hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        except Exception as e:  # report the engine's figures even so
            print(f"transformers baseline unavailable: {e!r}")
    if not args.no_freeze:  # as tartlet serve does once its models are loaded
        from tartlet.host.state import gc_for_serving

        gc_for_serving()
    # warm-up: Triton compiles, graphs captured for every bucket used, cuBLAS chosen
    for n in conc:
        for eng, ov in variants.values():
            set_overlap(eng, ov)
            engine_generate(eng, prompts(n), 4)
        if hf is not None:
            hf_generate(hf, prompts(n), 4)
    rows, results = [], {}
    for n in () if args.only_tax else conc:
        runs: dict[str, list[float]] = {"graphs": [], "sync": [], "eager": [], "hf": []}
        tpot: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(args.rounds):  # alternating: engine, without overlap, without graphs, transformers
            for name, (eng, ov) in variants.items():
                set_overlap(eng, ov)
                wall, step = engine_generate(eng, prompts(n), NEW)
                runs[name].append(wall)
                tpot[name].append(step)
            if hf is not None:
                runs["hf"].append(hf_generate(hf, prompts(n), NEW))
        med = {k: statistics.median(v) for k, v in runs.items() if v}
        tok_s = {k: n * NEW / v for k, v in med.items()}
        step = {k: statistics.median(v) for k, v in tpot.items() if v}
        results[n] = {"tok_s": tok_s, "tpot_ms": {k: v * 1e3 for k, v in step.items()}}
        nan = float("nan")
        rows.append([n, tok_s["graphs"], step["graphs"] * 1e3, step["sync"] * 1e3, tok_s["graphs"] / tok_s["sync"],
                     tok_s.get("eager", nan), step.get("eager", nan) * 1e3,
                     tok_s.get("hf", float("nan")), tok_s["graphs"] / tok_s["hf"] if "hf" in tok_s else float("nan")])  # fmt: skip
    set_overlap(engines["graphs"], True)
    # prefill of one long prompt (a first, untimed round picks the kernels for its shapes)
    pre: dict[str, list[float]] = {"engine": [], "hf": []}
    if not (args.only_decode or args.only_tax):
        engine_generate(engines["graphs"], prompts(1, LONG), 1)
        if hf is not None:
            hf_generate(hf, prompts(1, LONG), 1)
    for _ in range(0 if args.only_decode or args.only_tax else args.rounds):
        pre["engine"].append(engine_generate(engines["graphs"], prompts(1, LONG), 1)[0])
        if hf is not None:
            pre["hf"].append(hf_generate(hf, prompts(1, LONG), 1))
    pre_s = {k: statistics.median(v) for k, v in pre.items() if v}
    # programmability tax: the text-completion inferlet (native runtime: tokenizing, streaming
    # text, host-side generate in chunks) against the same decode driven on the engine directly
    tax = {}
    for n in () if args.only_decode else tax_conc:
        pairs, walls = [], [0.0, 0.0]
        for _ in range(args.rounds + 1):
            ps = prompts(n)
            direct = engine_generate(engines["graphs"], ps, NEW)[0]
            t_args = [{"prompt": " ".join(f"t{t}" for t in p), "raw": True, "max_tokens": NEW, "ignore_eos": True} for p in ps]
            served = run_inferlets(engines["graphs"], "text-completion", t_args)[1]
            pairs.append(served / direct)
            walls[0], walls[1] = walls[0] + direct, walls[1] + served
        tax[n] = statistics.median(pairs) - 1
        if args.only_tax:  # the whole run's ratio too: a stall (a full collection, say) in either side skews a round
            r = args.rounds + 1
            print(f"native tax x{n}: {tax[n]:+.1%}, whole run {walls[1] / walls[0] - 1:+.1%}, mean direct "
                  f"{walls[0] / r * 1e3:.1f} ms, text-completion {walls[1] / r * 1e3:.1f} ms (rounds: "
                  f"{', '.join(f'{r - 1:+.1%}' for r in pairs)})", flush=True)
    if args.only_tax:
        print(json.dumps({"device": DEVICE, "shape": args.shape, "native_tax": tax}))
        for eng in engines.values():
            eng.close()
        return
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    roof_s = weight_bytes / bw
    b1 = results[conc[0]]["tpot_ms"]["graphs"] / 1e3 if conc[0] == 1 else float("nan")
    b1_sync = results[conc[0]]["tpot_ms"]["sync"] / 1e3 if conc[0] == 1 else float("nan")
    payload = {
        "device": name, "shape": args.shape, "weights": args.weights, "weight_bytes": weight_bytes, "copy_bw_GBps": bw / 1e9,
        "roofline_ms": roof_s * 1e3, "batch1_tpot_ms": b1 * 1e3, "batch1_roofline_fraction": roof_s / b1,
        "batch1_roofline_fraction_without_overlap": roof_s / b1_sync,
        "decode": results, "prefill_2048_s": pre_s, "native_tax": tax,
        "graphs": None if dg is None else {"captures": dg.captures, "replays": dg.replays},
    }  # fmt: skip
    wname = "bfloat16" if kind is None else f"{args.weights} projections (bfloat16 embedding and head)"
    report(f"Decode, {args.shape} random weights, {wname}, {name} ({PROMPT}-token prompts, {NEW} new tokens)",
           ["concurrent", "engine tok/s", "TPOT ms", "no overlap TPOT ms", "overlap gain", "no graphs tok/s", "no graphs TPOT ms",
            "transformers tok/s", "ratio"], rows, None)  # fmt: skip
    report("Prefill of one 2,048-token prompt, and the batch-1 roofline",
           ["what", "value"],
           [["engine prefill tok/s", LONG / pre_s["engine"] if "engine" in pre_s else float("nan")], ["transformers prefill tok/s", LONG / pre_s["hf"] if "hf" in pre_s else float("nan")],
            ["weight GB", weight_bytes / 1e9], ["copy bandwidth GB/s", bw / 1e9], ["roofline ms/token", roof_s * 1e3],
            ["batch-1 TPOT ms", b1 * 1e3], ["fraction of roofline", roof_s / b1],
            ["fraction of roofline without overlap", roof_s / b1_sync],
            *[[f"native tax, text-completion x{n}", f"{t:+.1%}"] for n, t in tax.items()]], payload)  # fmt: skip
    if args.profile:
        sdpa_gqa_check(shape)
        profile(engines, prompts)
    for eng in engines.values():
        eng.close()
    print(json.dumps({"ok": True}))


def sdpa_gqa_check(shape: dict[str, Any]) -> None:
    """Causal prefill attention through SDPA with ``enable_gqa`` (what the
    engine calls) against the KV heads repeated first, for one long prompt
    and for 64 short ones (ms, median of 20): on an H200 ``enable_gqa`` was
    the faster in all three."""
    import torch.nn.functional as F

    nh, nkv, hd = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
    rows = []
    for B, L in ((1, 2048), (1, 256), (64, 32)):
        q = torch.randn(B, nh, L, hd, device=DEVICE, dtype=torch.bfloat16)
        k, v = (torch.randn(B, nkv, L, hd, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
        ways = {"enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                "repeated": lambda: F.scaled_dot_product_attention(q, k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1),
                                                                   is_causal=True)}  # fmt: skip
        ms = {}
        for name, fn in ways.items():
            fn()
            times = []
            for _ in range(20):
                sync()
                t = time.perf_counter()
                fn()
                sync()
                times.append(time.perf_counter() - t)
            ms[name] = statistics.median(times) * 1e3
        rows.append([f"{B} x {L}", ms["enable_gqa"], ms["repeated"]])
    report("Prefill attention of one layer, SDPA (ms)", ["prompts x tokens", "enable_gqa", "KV heads repeated"], rows, None)


def profile(engines: dict[str, Any], prompts: Any) -> None:
    """torch.profiler's kernel table of one 2,048-token prefill, of 8
    batch-1 decode steps op by op and of 8 replayed from the graphs, and
    of 8 steps of 64 and of 256 sequences (their prompts' prefill included)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEVICE == "cuda" else [])
    sort = "cuda_time_total" if DEVICE == "cuda" else "cpu_time_total"
    for what, eng, ps, new in (("prefill of 2,048 tokens", engines["graphs"], prompts(1, LONG), 1),
                               ("8 batch-1 decode steps, op by op", engines.get("eager"), prompts(1), 9),
                               ("8 batch-1 decode steps, CUDA graphs", engines["graphs"], prompts(1), 9),
                               ("8 decode steps of 64 sequences, CUDA graphs", engines["graphs"], prompts(64), 9),
                               ("8 decode steps of 256 sequences, CUDA graphs", engines["graphs"], prompts(256), 9)):  # fmt: skip
        if eng is None:  # --only-decode: no engine without graphs
            continue
        with torch_profile(activities=acts) as prof:
            engine_generate(eng, ps, new)
        print(f"\nprofile: {what}")
        print(prof.key_averages().table(sort_by=sort, row_limit=14, max_name_column_width=60))


if __name__ == "__main__":
    main()
