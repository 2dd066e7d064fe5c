"""Oracle: would per-layer or per-(layer, KV head) token selection meet
issue 36's KV eviction target (50% budget, NLL within 5% of the full
cache) on the default model? Plain torch, float32, CPU; not the engine.

Tartlet's engine keeps one token mask per context, shared by every layer
and KV head; H2O and SnapKV select per (layer, head) in their papers. This
script runs the reference model (transformers' Llama dequantized from the
default GGUF, :mod:`hf_reference`, its modules driven by a forward pass
written here) on the samples of ``bench_kv_eviction.py`` (same workloads,
seeds, budgets and scoring) with a key mask per (layer, KV head, position)
and selects the kept tokens at four granularities:

- ``all``: one token set for every layer and head, the (layer, KV head)
  scores summed: what Tartlet does (``heads="sum"``);
- ``layer``: one set per layer, its KV heads' scores summed;
- ``head``: one set per (layer, KV head) (the papers'), each of the
  budget's size;
- ``flat``: per layer, the (KV head, position) pairs of all its heads
  ranked together and the top ``heads x budget`` kept, so the heads of a
  layer share its budget unevenly (Ada-KV's adaptive allocation, Feng et
  al., 2024).

Every layer holds the same number of tokens (the budget per KV head; no
per-layer allocation as in PyramidKV). The policies follow
``tartlet/sdk/kv_eviction.py``'s defaults and ``bench_kv_eviction.py``'s
loop exactly: the prompt is prefilled with full attention (its last
position gives the first continuation token's log-probability), evictions
follow; then one decode pass per continuation token, teacher-forced,
attending only the kept keys of each (layer, KV head) (its own key always
visible), each followed by an eviction down to the budget.

- ``snapkv``: the last 32 prompt queries vote (their attention summed per
  KV head over its 3 query heads), each row's votes max-pooled (kernel 7,
  stride 1, padding 3), rows combined by the granularity; keep the window
  and the top ``budget - 32`` earlier positions; each decode step over
  budget evicts the lowest-voted remaining prompt token (ties: the earlier
  one), then the oldest.
- ``h2o``: cumulative attention (the prompt's column sums, then each decode
  query's attention added, per row; step by step, as the SDK does), recent
  window ``budget // 2``; each step evicts the lowest non-recent token.
- ``tova`` (optional, ``--methods``): the current query's attention, the
  prompt's last query at prefill; TOVA's paper selects per layer.
- ``future`` (optional): an oracle no policy can be, what selection by
  attention could reach if the scores knew the continuation: prompt
  positions ranked by the attention the continuation's own queries give
  them with the full cache (summed over its tokens), evicted lowest first
  as SnapKV's (no window, no pooling).

Prints one table (method x granularity x budget: NLL, ratio to the full
cache; ``prose-q``: the mean fraction of the answer's source sentence kept
after the prefill over samples and (layer, head) rows, and the fraction of
(sample, row) pairs that kept it whole) and a ``JSON:`` line. The first
sample's full-cache log-probabilities are checked against transformers' own
forward pass (``check`` in the JSON: the largest difference, nats).
Granularity ``all`` reproduces ``bench_kv_eviction.py`` on the engine
(Q4_1 weights, float32 KV) to ~1e-3 nats per sample, with the same kept
tokens. A sample's configurations run as one batch, in lockstep; torch
uses ``--threads`` (default 1: on a machine shared with other jobs, more
threads than free cores made the decode passes ~10x slower).

    .venv/bin/python benchmarks/oracle_kv_heads.py --workload prose-q --seed 7
    .venv/bin/python benchmarks/oracle_kv_heads.py --workload prose --seed 7
    .venv/bin/python benchmarks/oracle_kv_heads.py --workload prose-q --seed 7 --methods future,tova
    .venv/bin/python benchmarks/oracle_kv_heads.py --quick      # prose-q, 256-token prompt, 2 samples, 50%
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bench_kv_eviction import WORKLOADS, Sample, build_samples
from common import ROOT, report

GRANULARITIES = ("all", "layer", "head", "flat")
METHODS = ("snapkv", "h2o", "tova", "future")
WINDOW, KERNEL = 32, 7  # SnapKV's defaults in tartlet/sdk/kv_eviction.py
INF = float("inf")
Config = tuple[str, str, float]  # method, granularity, budget fraction
Attn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def load() -> tuple[Any, Any]:
    """The reference model (float32, eval) and Tartlet's tokenizer of the default GGUF."""
    sys.path.insert(0, str(ROOT / "tests"))
    from hf_reference import hf_model
    from tartlet.engine.loading.gguf_loader import open_gguf
    from tartlet.engine.loading.model_store import DEFAULT_MODEL, resolve
    from tartlet.engine.text.tokenizer import Tokenizer

    path = resolve(DEFAULT_MODEL)
    return hf_model(path), Tokenizer.from_gguf(open_gguf(path))


def layers(model: Any, ids: torch.Tensor, pos0: int, attn: Attn, at: int = -1) -> torch.Tensor:
    """The Llama forward pass of ``ids`` [B, nq] (int64) at positions
    ``pos0...`` through the reference model's modules, attention done by
    ``attn(layer, q [B, Hq, nq, d], k, v [B, Hkv, nq, d] (RoPE applied),
    scale)`` returning [B, nq, Hq * d]. Returns the logits [B, vocab]
    (float32) of the ``at``-th of the ``nq`` positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    m, (B, nq) = model.model, ids.shape
    x = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(x, torch.arange(pos0, pos0 + nq)[None])
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        y = layer.input_layernorm(x)
        q, k, v = (p(y).view(B, nq, -1, a.head_dim).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        x = x + a.o_proj(attn(i, q, k, v, a.scaling))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits: torch.Tensor = model.lm_head(m.norm(x[:, at]))
    return logits


@dataclass
class Prefill:
    """A sample's prompt pass: its keys and values ``kv`` [2, L, Hkv, P, d],
    the first continuation token's log-probability and, per (layer, KV
    head) [L, Hkv, P] (float64), the attention each prompt position received
    from all prompt queries (``cols``), from the last ``WINDOW``
    (``window``), from the last one (``last``) and, with the full cache,
    from the continuation's queries (``future``: what the ``future`` oracle
    ranks by); a KV head's attention is the sum of its query heads'."""

    kv: torch.Tensor
    lp0: float
    cols: torch.Tensor
    window: torch.Tensor
    last: torch.Tensor
    future: torch.Tensor


def prefill(model: Any, s: Sample) -> Prefill:
    """The prompt and continuation of ``s`` in one pass, full causal
    attention (the continuation's keys are not kept: the decode passes
    compute them under each policy)."""
    cfg, P, T = model.config, len(s.prompt), len(s.prompt) + len(s.cont)
    L, H = cfg.num_hidden_layers, cfg.num_key_value_heads
    kv = torch.zeros(2, L, H, P, cfg.hidden_size // cfg.num_attention_heads)
    cols, window, last, future = (torch.zeros(L, H, P, dtype=torch.float64) for _ in range(4))
    causal = torch.ones(T, T, dtype=torch.bool).tril()

    def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        kv[0, i], kv[1, i] = k[0, :, :P], v[0, :, :P]
        hq, d = q.shape[1], q.shape[-1]
        w = (q[0].reshape(H, hq // H, T, d) @ k[0].transpose(1, 2)[:, None]) * scale  # [Hkv, g, T, T]
        p = torch.softmax(w.masked_fill(~causal, -INF), dim=-1)
        g = p.sum(1)[..., :P]
        cols[i], window[i], last[i], future[i] = g[:, :P].sum(1), g[:, P - WINDOW : P].sum(1), g[:, P - 1], g[:, P:].sum(1)
        return (p @ v[0][:, None]).reshape(hq, T, d).transpose(0, 1).reshape(1, T, hq * d)

    logits = layers(model, torch.tensor([s.prompt + s.cont]), 0, attn, at=P - 1)
    return Prefill(kv, float(F.log_softmax(logits[0], -1)[s.cont[0]]), cols, window, last, future)


def decode(model: Any, pre: Prefill, kvc: torch.Tensor, ids: list[int], t: int, keep: torch.Tensor,
           probs: torch.Tensor) -> torch.Tensor:
    """One decode pass of ``B`` runs in lockstep: token ``ids[b]`` of run
    ``b`` at continuation index ``t``, its key and value written to ``kvc``
    [2, L, B, Hkv, C, d], attending the prompt (``pre.kv``) and its run's
    continuation up to ``t`` where ``keep`` [B, L, Hkv, P + t + 1] (bool)
    is True. Fills ``probs`` [B, L, Hkv, P + t + 1] with the attention of
    each KV head (query heads summed); returns the logits [B, vocab]."""
    P = pre.kv.shape[3]

    def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        B, hq, _, d = q.shape
        H = k.shape[1]
        kvc[0, i, :, :, t], kvc[1, i, :, :, t] = k[:, :, 0], v[:, :, 0]
        kc, vc = kvc[0, i, :, :, : t + 1], kvc[1, i, :, :, : t + 1]
        qg = q.reshape(B, H, hq // H, d)
        w = torch.cat([torch.einsum("bhgd,hpd->bhgp", qg, pre.kv[0, i]), qg @ kc.transpose(2, 3)], -1) * scale
        p = torch.softmax(w.masked_fill(~keep[:, i, :, None, :], -INF), dim=-1)  # [B, Hkv, g, P + t + 1]
        probs[:, i] = p.sum(2)
        out = torch.einsum("bhgp,hpd->bhgd", p[..., :P], pre.kv[1, i]) + p[..., P:] @ vc
        return out.reshape(B, 1, hq * d)

    return layers(model, torch.tensor(ids)[:, None], P + t, attn)


def evict(keep: torch.Tensor, score: torch.Tensor, n: int, gran: str) -> None:
    """Hide in ``keep`` [L, H, N] the ``n`` lowest-``score`` [L, H, N]
    positions (ties: the earlier) of each selection unit (``gran``): the
    sum of the rows of all layers and heads (``all``), of each layer's
    heads (``layer``), each row (``head``); ``flat``: ``n * H`` (head,
    position) pairs of each layer, ranked together (Ada-KV's flattened
    top-k: the layer's heads share its budget unevenly). ``score`` is
    ``inf`` where a position may not be evicted."""
    if n <= 0:
        return
    L, H, N = keep.shape
    s = {"all": lambda: score.sum((0, 1), keepdim=True), "layer": lambda: score.sum(1, keepdim=True),
         "head": lambda: score, "flat": lambda: score.reshape(L, 1, H * N)}[gran]()
    n = n * H if gran == "flat" else n
    idx = torch.sort(s, dim=-1, stable=True).indices[..., :n]
    if not torch.isfinite(torch.gather(s, -1, idx)).all():
        raise RuntimeError("fewer evictable positions than the tokens to evict")
    keep &= ~torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx, True).reshape(s.shape[0], -1, N).expand_as(keep)


class Policy:
    """A method's scores and evictions on one sample: ``budget`` tokens kept
    per selection unit after the prefill and after every decode step."""

    def __init__(self, method: str, gran: str, pre: Prefill, n_all: int, budget: int) -> None:
        self.method, self.gran, self.budget = method, gran, budget
        L, H, P = pre.cols.shape
        self.acc = torch.zeros(L, H, n_all, dtype=torch.float64)
        if method == "h2o":
            self.acc[..., :P] = pre.cols
        elif method == "snapkv":  # votes of the positions before the window; later ones: oldest first
            prefix = P - WINDOW
            votes = F.max_pool1d(pre.window[..., :prefix].reshape(L * H, 1, prefix), KERNEL, 1, KERNEL // 2)
            self.acc[..., :prefix] = votes.view(L, H, prefix)
            self.acc[..., prefix:] = 1e9 + torch.arange(prefix, n_all, dtype=torch.float64)
        elif method == "tova":
            self.acc[..., :P] = pre.last
        elif method == "future":  # prompt positions by the continuation's attention, then the oldest
            self.acc[..., :P] = pre.future
            self.acc[..., P:] = 1e9 + torch.arange(P, n_all, dtype=torch.float64)

    def step(self, keep: torch.Tensor, n: int, probs: torch.Tensor | None) -> None:
        """After a pass that left ``n`` positions: add ``probs`` [L, H, n]
        (H2O; TOVA ranks by them) and evict down to the budget."""
        if self.method == "full":
            return
        over = int(keep[0, :, :n].sum()) // keep.shape[1] - self.budget  # per row; flat: per row on average
        if probs is not None and self.method == "h2o":
            self.acc[..., :n] += probs
        elif probs is not None and self.method == "tova":
            self.acc[..., :n] = probs
        cand = keep.clone()
        if self.method == "h2o":
            cand[..., max(0, n - self.budget // 2):] = False  # the recent window
        evict(keep, torch.where(cand, self.acc, INF), over, self.gran)


def run(model: Any, s: Sample, pre: Prefill, configs: list[Config]) -> list[dict[str, Any]]:
    """Sample ``s`` under every ``(method, granularity, fraction)`` of
    ``configs`` (one batch, in lockstep): per config its budget (tokens),
    the scored log-probabilities' sum, all log-probabilities and, when ``s``
    has a ``source`` span, the mean fraction of it kept after the prefill
    over the (layer, KV head) rows and the fraction of rows keeping it whole."""
    P, C = len(s.prompt), len(s.cont)
    L, H, _ = pre.cols.shape
    B = len(configs)
    keep = torch.zeros(B, L, H, P + C, dtype=torch.bool)
    keep[..., :P] = True
    pols = [Policy(m, g, pre, P + C, int(f * (P + C))) for m, g, f in configs]
    outs: list[dict[str, Any]] = []
    for b, pol in enumerate(pols):
        pol.step(keep[b], P, None)
        outs.append({"budget": pol.budget, "lps": [pre.lp0]})
        if "source" in s.spans:
            src = keep[b, ..., slice(*s.spans["source"])].float().mean(-1)
            outs[-1] |= {"src_kept": float(src.mean()), "src_whole": float((src == 1).float().mean())}
    kvc = torch.zeros(2, L, B, H, C, pre.kv.shape[-1])
    probs = torch.zeros(B, L, H, P + C)
    for t in range(C - 1):
        n = P + t + 1
        keep[..., n - 1] = True
        logp = F.log_softmax(decode(model, pre, kvc, [s.cont[t]] * B, t, keep[..., :n], probs[..., :n]), -1)
        for b, pol in enumerate(pols):
            outs[b]["lps"].append(float(logp[b, s.cont[t + 1]]))
            pol.step(keep[b], n, probs[b, ..., :n].double())
    if not (keep.sum((2, 3)) == H * torch.tensor([min(p.budget, P + C - 1) for p in pols])[:, None]).all():
        raise RuntimeError("a layer does not hold its budget")  # an eviction bug
    for o in outs:
        o["lp_sum"] = sum(o["lps"][i] for i in s.scored)
    return outs


def check(model: Any, s: Sample, full_lps: list[float]) -> float:
    """The largest difference (nats) between ``full_lps`` and transformers'
    own forward pass over the prompt + continuation (all log-probabilities
    of the continuation)."""
    ids = s.prompt + s.cont
    logp = F.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    ref = [float(logp[len(s.prompt) - 1 + t, tok]) for t, tok in enumerate(s.cont)]
    return max(abs(x - y) for x, y in zip(ref, full_lps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=WORKLOADS, default="prose-q")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=256, help="log, prose: continuation tokens")
    ap.add_argument("--samples", type=int, default=0, help="prose-q: questions (0: every complete section)")
    ap.add_argument("--budgets", default="0.25,0.5,0.75")
    ap.add_argument("--methods", default="snapkv,h2o", help=f"of {', '.join(METHODS)}")
    ap.add_argument("--granularities", default=",".join(GRANULARITIES))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a shared machine's other jobs make more threads much slower)")
    ap.add_argument("--quick", action="store_true", help="256-token prompt, 32 continuation, 2 samples, 50%% only")
    a = ap.parse_args()
    if a.quick:
        a.prefix, a.continuation, a.budgets, a.samples = 256, 32, "0.5", a.samples or 2
    methods, grans = a.methods.split(","), a.granularities.split(",")
    if not set(methods) <= set(METHODS) or not set(grans) <= set(GRANULARITIES):
        raise SystemExit(f"methods: {METHODS}; granularities: {GRANULARITIES}")
    torch.set_num_threads(a.threads)
    model, tok = load()
    samples = build_samples(a.workload, tok.encode, a.seed, a.prefix, a.continuation, a.samples)
    configs = [("full", "all", 1.0)] + [(m, g, float(f)) for f in a.budgets.split(",") for m in methods for g in grans]
    per: dict[Config, list[dict[str, Any]]] = {c: [] for c in configs}
    t0, diff = time.perf_counter(), 0.0
    with torch.inference_mode():
        for i, s in enumerate(samples):
            pre = prefill(model, s)
            for c, r in zip(configs, run(model, s, pre, configs)):
                per[c].append(r)
            if i == 0:
                diff = check(model, s, per[configs[0]][0]["lps"])
            print(f"sample {i + 1}/{len(samples)} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    scored = sum(len(s.scored) for s in samples)

    def agg(rs: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"budget": statistics.mean(r["budget"] for r in rs), "nll": -sum(r["lp_sum"] for r in rs) / scored,
               "sample_nll": [-r["lp_sum"] / len(s.scored) for r, s in zip(rs, samples)]}
        for k in ("src_kept", "src_whole"):
            if k in rs[0]:
                out[k] = statistics.mean(r[k] for r in rs)
        return out

    full = agg(per[configs[0]])
    runs, rows = [], []
    for (m, g, f), rs in per.items():
        r = agg(rs) | {"method": m, "granularity": g, "fraction": f}
        r["ratio"] = r["nll"] / full["nll"]
        runs.append(r)
        rows.append([m, g if m != "full" else "-", f"{f:.0%}", round(r["budget"]), r["nll"], r["ratio"]]
                    + ([r["src_kept"], r["src_whole"]] if "src_kept" in r else []))
    diag = "src_kept" in runs[0]
    report(f"Oracle KV selection by granularity, workload {a.workload} seed {a.seed}: teacher-forced NLL of "
           f"{scored} scored tokens over {len(samples)} sample(s), float32 reference model "
           f"(check against transformers: {diff:.1e} nats)",
           ["method", "granularity", "budget", "tokens", "NLL", "vs full"] + (["src kept", "src whole"] if diag else []),
           rows, {"workload": a.workload, "seed": a.seed, "samples": len(samples), "scored": scored,
                  "prefix": a.prefix, "check": diff, "seconds": time.perf_counter() - t0, "runs": runs})


if __name__ == "__main__":
    main()
