"""Decode throughput and TTFT: Tartlet vs transformers, same run.

Measures, on the default model with float32 weights and the same torch thread
count for both systems:

* aggregate decode tokens/s with 1, 4 and 16 concurrent ``text-completion``
  inferlets (greedy, ``ignore_eos``, fixed token count), against
  transformers ``generate`` on a left-padded batch of the same prompts;
* time to first token for a 512-token prompt (prefill + one sampled token).

Each measurement is the median of ``--repeats`` runs; Tartlet and
transformers alternate run by run so drifts in machine speed hit both, and
the ratio is the median of the per-pair ratios. Prints a table
and one ``JSON:`` line. Usage::

    .venv/bin/python benchmarks/bench_decode.py [--quick] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

from common import load_engine, load_hf_reference, paired, report, run_inferlets

PROMPTS = [
    "Explain how a refrigerator works.",
    "Write a poem about the sea.",
    "What is the capital of France?",
    "List three uses of copper.",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What is machine learning?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, to check the script runs")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both systems")
    ap.add_argument("--tokens", type=int, default=64, help="generated tokens per request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--prompt-len", type=int, default=512, help="prompt tokens for the TTFT measurement")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.repeats, a.batches, a.prompt_len = 4, 1, "1,2", 32

    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    threads = torch.get_num_threads()
    engine = load_engine(kv_cache_mb=512, threads=a.threads, dtype="float32")  # transformers' weights and dtype
    hf, tok = load_hf_reference()
    hf.generation_config.pad_token_id = tok.pad_token_id or 2

    rows, payload = [], {"threads": threads, "tokens": a.tokens, "results": []}
    for n in [int(x) for x in a.batches.split(",")]:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(n)]
        args = [{"prompt": p, "max_tokens": a.tokens, "ignore_eos": True} for p in prompts]

        def ours() -> float:
            res, dt = run_inferlets(engine, "text-completion", args)
            assert all(len(r["tokens"]) == a.tokens for r in res)
            return dt

        chats = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False) for p in prompts]
        tok.padding_side = "left"
        enc = tok(chats, return_tensors="pt", padding=True, add_special_tokens=False)

        def theirs() -> float:
            t0 = time.perf_counter()
            with torch.no_grad():
                out = hf.generate(**enc, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
            assert out.shape[1] - enc["input_ids"].shape[1] == a.tokens
            return time.perf_counter() - t0

        ours(), theirs()  # warm-up
        t_ours, t_hf, ratio = paired(ours, theirs, a.repeats)
        tps_ours, tps_hf = n * a.tokens / t_ours, n * a.tokens / t_hf
        rows.append([f"decode, {n} concurrent", tps_ours, tps_hf, ratio, "tokens/s (aggregate)"])
        payload["results"].append({"case": f"decode_{n}", "tartlet_tps": tps_ours, "transformers_tps": tps_hf, "ratio": ratio})

    # TTFT: a prompt of exactly prompt_len tokens, one generated token.
    ids = (tok("The quick brown fox jumps over the lazy dog. " * 200, add_special_tokens=False)["input_ids"])[: a.prompt_len]
    text = tok.decode(ids)

    def ttft_ours() -> float:
        # queued behind the last run's frees: no prefix reuse between repeats
        engine.scheduler.command(engine.pool.evict_all_cached).result()
        _, dt = run_inferlets(engine, "text-completion", [{"prompt": text, "raw": True, "max_tokens": 1}])
        return dt

    def ttft_hf() -> float:
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(torch.tensor([ids]), max_new_tokens=1, do_sample=False)
        return time.perf_counter() - t0

    ttft_ours(), ttft_hf()
    t1, t2, ratio = paired(ttft_ours, ttft_hf, a.repeats)
    rows.append([f"TTFT, {a.prompt_len}-token prompt", t1 * 1000, t2 * 1000, ratio, "ms (lower is better; ratio = speedup)"])
    payload["results"].append({"case": f"ttft_{a.prompt_len}", "tartlet_ms": t1 * 1000, "transformers_ms": t2 * 1000, "ratio": ratio})

    report(
        f"Tartlet vs transformers, float32, {threads} threads, {a.tokens} tokens per request",
        ["case", "tartlet", "transformers", "ratio", "unit"],
        rows,
        payload,
    )
    engine.close()


if __name__ == "__main__":
    main()
