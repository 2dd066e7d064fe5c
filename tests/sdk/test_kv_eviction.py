"""KV eviction policies (``tartlet.kv_eviction``) on the real model: each
method keeps at most its budget of tokens visible, frees exactly the pages
it says it frees (context and pool page counts), generates the full-cache
greedy tokens when the budget holds everything, and still generates under a
tight budget, with the refinements too (sinks kept, heads combined by max,
H2O's mean score); H2O evicts its lowest-ranked token; SnapKV's pooling
equals torch's; bad arguments raise errors naming them. Chunk-level
selection (``chunk``, ChunkKV): ``chunk=1`` is the token-level policy
unchanged, and with chunk = page size the kept positions form whole chunks
(at most one partial) outside sinks and windows, and each chunk evicted
whole frees its page.
"""

from __future__ import annotations

import pytest

from harness import inline_program, run, run_ok
from tartlet.runtime.instance import Status
from tartlet.sdk import kv_eviction
from tartlet.sdk.kv_chunks import lowest_chunks
from tartlet.sdk.kv_eviction import pool1d

PROMPT = "Write a short story about a lighthouse keeper named Ada who counts ships every night."
N_NEW, BUDGET, STEPS = 24, 40, 40
PAGE = 16  # the test engine's page size: chunk = PAGE aligns chunks to pages
# a prompt long enough for the prefill to evict several pages under LONG_BUDGET, for the chunked policies
LONG_PROMPT = ("Read the keeper's notes, then continue them. " + " ".join(
    f"On night {i} Ada counted {7 * i + 3} ships, saw the {name} pass the reef at {i % 12 + 1} o'clock, "
    f"and wrote that the wind came from the {wind}." for i, (name, wind) in enumerate(
        [("Vesper", "north"), ("Marigold", "east"), ("Halcyon", "south"), ("Tern", "west"), ("Osprey", "north"),
         ("Kestrel", "south-west"), ("Juniper", "east"), ("Saffron", "north-east")], start=1)))
LONG_BUDGET, LONG_STEPS = 96, 24
CHUNKED = {"h2o": ("h2o", {"recent": 32}), "h2o chunk": ("h2o", {"recent": 32, "chunk": PAGE}),
           "snapkv": ("snapkv", {"window": 16, "kernel_size": 5}),
           "snapkv chunk": ("snapkv", {"window": 16, "kernel_size": 5, "chunk": PAGE}),
           "tova": ("tova", {}), "tova chunk": ("tova", {"chunk": PAGE}),
           "tova+": ("tova", {"sink": 4, "heads": "max"}), "tova+ chunk": ("tova", {"sink": 4, "heads": "max",
                                                                                   "chunk": PAGE})}
TIGHT = {"window": ("window", {"sink": 4}), "h2o": ("h2o", {"recent": 16}),
         "snapkv": ("snapkv", {"window": 8, "kernel_size": 5}), "tova": ("tova", {}),
         # the refinements: sinks kept, heads combined by max, H2O's score normalised by the queries that saw a token
         "h2o+": ("h2o", {"recent": 16, "sink": 4, "score": "mean", "heads": "max"}),
         "snapkv+": ("snapkv", {"window": 8, "kernel_size": 5, "sink": 4, "heads": "max"}),
         "tova+": ("tova", {"sink": 4, "heads": "max"}),
         # chunk-level selection (ChunkKV): chunk 1 is the token-level policy; chunk = page size
         "h2o chunk 1": ("h2o", {"recent": 16, "chunk": 1}),
         "h2o chunk": ("h2o", {"recent": 16, "chunk": PAGE}),
         "snapkv chunk": ("snapkv", {"window": 8, "kernel_size": 5, "chunk": PAGE}),
         "tova chunk": ("tova", {"chunk": PAGE}),
         "tova+ chunk": ("tova", {"sink": 4, "heads": "max", "chunk": PAGE})}

PROGRAM = """
from tartlet import Model, Sampler, forward, kv_eviction

async def main(args):
    model = Model.load()
    out = {"generous": {}, "tight": {}}
    with model.new_context() as ref:
        ref.user(args["prompt"])
        out["ref"] = await ref.generate(max_tokens=args["n_new"], eos=False).collect_tokens()
    for label, (method, opts) in args["tight"].items():
        policy = kv_eviction.make_policy(method, 4096, **{k: v for k, v in opts.items()
                                                          if k in ("heads", "score", "chunk")})
        with model.new_context() as c:
            c.user(args["prompt"])
            c.begin_assistant()
            out["generous"][label] = [t async for t in policy.generate(c, max_tokens=args["n_new"], eos=False)]
            out["prompt_len"] = c.kv_len - args["n_new"] + 1
        policy = kv_eviction.make_policy(method, args["budget"], **opts)
        with model.new_context() as c:
            await c.stats()  # after the closed contexts' pages went back (commands run in order)
            used0 = model.kv_stats()["used"]
            c.user(args["prompt"])
            c.begin_assistant()
            (tok,) = await policy.prefill(c, [forward.sample(0, Sampler.greedy())])
            rows, toks, before = [], [tok], []
            for i in range(args["steps"] + 1):
                st = await c.stats()
                rows.append({"kept": policy.kept_tokens, "held": policy.pages_held(), "dropped": policy.dropped_pages,
                             "evicted": policy.evicted, "kv_len": c.kv_len, "pos": policy.kept_positions(), **st})
                if i < args["steps"]:
                    before = policy.kept_positions()
                    (tok,) = await policy.step(c, tok, [forward.sample(0, Sampler.greedy())])
                    toks.append(tok)
            used1 = model.kv_stats()["used"]
            out["tight"][label] = {"rows": rows, "toks": toks, "kept": policy.kept_positions(), "before": before,
                                   "pool_pages": used1 - used0, "peak": policy.peak_pages}
            if method == "h2o":
                out["tight"][label].update(ranking=policy.ranking(), cumulative=policy.cumulative,
                                           seen=[policy.seen(j) for j in range(c.kv_len)])
    return out
"""


@pytest.fixture(scope="module")
async def result(host_state, tmp_path_factory):
    from harness import assert_no_leaks
    from tartlet.runtime.native import NativeRuntime

    runtime = NativeRuntime(host_state)
    prog = inline_program(tmp_path_factory.mktemp("kv-eviction"), PROGRAM, "kv_eviction_probe")
    out = await run_ok(runtime, prog, {"prompt": PROMPT, "n_new": N_NEW, "budget": BUDGET, "steps": STEPS,
                                       "tight": TIGHT})
    assert_no_leaks(host_state)
    return out


@pytest.fixture(scope="module")
async def long_result(host_state, tmp_path_factory):
    from harness import assert_no_leaks
    from tartlet.runtime.native import NativeRuntime

    runtime = NativeRuntime(host_state)
    prog = inline_program(tmp_path_factory.mktemp("kv-eviction-long"), PROGRAM, "kv_eviction_chunks")
    out = await run_ok(runtime, prog, {"prompt": LONG_PROMPT, "n_new": 2, "budget": LONG_BUDGET,
                                       "steps": LONG_STEPS, "tight": CHUNKED})
    assert_no_leaks(host_state)
    return out


def test_generous_budget_gives_the_full_cache_greedy_tokens(result):
    for label in TIGHT:
        assert result["generous"][label] == result["ref"], label


@pytest.mark.parametrize("label", list(TIGHT))
def test_tight_budget_holds_and_frees_the_pages_it_says(result, engine, label):
    ps = engine.pool.page_size
    method, opts = TIGHT[label]
    r = result["tight"][label]
    assert result["prompt_len"] > BUDGET  # the prompt alone is over budget: the prefill evicts
    for row in r["rows"]:
        assert row["kept"] == BUDGET  # between passes, exactly the budget is visible
        assert row["evicted"] == row["kv_len"] - BUDGET
        assert row["pages"] == -(-row["kv_len"] // ps)
        assert row["live_pages"] == row["held"] == row["pages"] - row["dropped"]  # the pages it says it freed are gone
    last = r["rows"][-1]
    assert r["pool_pages"] == last["live_pages"]  # and the pool's used pages agree
    assert r["peak"] == max(row["held"] for row in r["rows"]) and last["live_pages"] >= -(-BUDGET // ps)
    assert len(r["toks"]) == STEPS + 1 and all(0 <= t < engine.config.vocab_size for t in r["toks"])
    kept, n = r["kept"], last["kv_len"]
    assert len(kept) == BUDGET
    if method == "window":  # StreamingLLM: the sinks and the latest tokens, nothing else
        assert kept == list(range(4)) + list(range(n - BUDGET + 4, n))
        assert last["dropped"] == (n - BUDGET + 4) // ps - 1 >= 2  # full pages inside [sink, n - budget + sink)
        assert last["live_pages"] <= 1 + -(-(BUDGET - 4) // ps) + 1
    if method == "h2o":  # the recent window is kept; the last step evicted the lowest cumulative score outside it
        assert kept[-16:] == list(range(n - 16, n))
    if opts.get("sink"):  # the attention sinks are never evicted
        assert kept[:4] == [0, 1, 2, 3]


@pytest.mark.parametrize("label", ["h2o", "h2o+"])
def test_h2o_evicts_the_lowest_ranked(result, label):
    r = result["tight"][label]
    sink, recent = TIGHT[label][1].get("sink", 0), 16
    n = len(r["seen"])
    # every query so far saw the positions before it: the prompt's in the prefill, then one per step
    assert r["seen"] == [n - j for j in range(n)]
    rank, cum = r["ranking"], r["cumulative"]
    if TIGHT[label][1].get("score") == "mean":
        assert rank == pytest.approx([c / (n - j) for j, c in enumerate(cum)])
    else:
        assert rank == cum
    (gone,) = sorted(set(r["before"]) - set(r["kept"]))  # the last step evicted one token, outside sinks and recent
    assert sink <= gone < n - recent
    rivals = [j for j in r["kept"] if sink <= j < n - recent]
    assert rivals and all((rank[gone], gone) < (rank[j], j) for j in rivals)


def test_pool1d_equals_torch():
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.rand(37, generator=g, dtype=torch.float64)
    for k in (1, 3, 5, 7):
        mx = F.max_pool1d(x[None, None], kernel_size=k, padding=k // 2, stride=1)[0, 0]
        av = F.avg_pool1d(x[None, None], kernel_size=k, padding=k // 2, stride=1)[0, 0]
        assert pool1d(x.tolist(), k, "max") == pytest.approx(mx.tolist(), abs=1e-15)
        assert pool1d(x.tolist(), k, "avg") == pytest.approx(av.tolist(), abs=1e-15)


@pytest.mark.parametrize("method, budget, opts, msg", [
    ("lru", 8, {}, "method must be one of window, h2o, snapkv, tova, got 'lru'"),
    ("h2o", 0, {}, "budget must be an int >= 1, got 0"),
    ("h2o", 8.5, {}, "budget must be an int >= 1, got 8.5"),
    ("h2o", 8, {"recent": 9}, "recent must be at most budget (8), got 9"),
    ("h2o", 8, {"layers": []}, "layers must be a non-empty list of ints"),
    ("window", 8, {"sink": 8}, "sink must be less than budget (8), got 8"),
    ("window", 8, {"sink": -1}, "sink must be an int >= 0, got -1"),
    ("snapkv", 8, {"window": 9}, "window must be at most budget (8), got 9"),
    ("snapkv", 8, {"kernel_size": 4}, "kernel_size must be odd"),
    ("snapkv", 8, {"pooling": "mean"}, "pooling must be one of max, avg, got 'mean'"),
    ("snapkv", 8, {"sink": 4, "window": 5}, "sink + window must be at most budget (8), got 4 + 5"),
    ("h2o", 8, {"sink": 4, "recent": 5}, "sink + recent must be at most budget (8), got 4 + 5"),
    ("h2o", 8, {"score": "max"}, "score must be one of sum, mean, got 'max'"),
    ("tova", 8, {"heads": "mean"}, "heads must be one of sum, max, got 'mean'"),
    ("tova", 8, {"sink": 8}, "sink must be less than budget (8), got 8"),
    ("tova", 8, {"recent": 2}, "method 'tova' takes no option among ['recent']"),
    ("h2o", 8, {"chunk": 0}, "chunk must be an int >= 1, got 0"),
    ("snapkv", 8, {"chunk": 2.0}, "chunk must be an int >= 1, got 2.0"),
    ("window", 8, {"chunk": 16}, "method 'window' takes no option among ['chunk']"),
])
def test_bad_arguments_are_named(method, budget, opts, msg):
    with pytest.raises(ValueError) as e:
        kv_eviction.make_policy(method, budget, **opts)
    assert msg in str(e.value)


async def test_inferlet_generates_under_budget(runtime, engine):
    res = await run_ok(runtime, "kv-eviction", {"prompt": PROMPT, "method": "snapkv", "budget": 32, "window": 8,
                                                "max_tokens": 32, "ignore_eos": True})
    assert len(res["tokens"]) == 32 and res["kept_tokens"] == 32 and res["method"] == "snapkv"
    final = res["final_stats"]
    assert final["pages"] - final["live_pages"] == res["dropped_pages"] >= 1
    chunked = await run_ok(runtime, "kv-eviction", {"prompt": PROMPT, "method": "tova", "budget": 32, "chunk": PAGE,
                                                    "max_tokens": 32, "ignore_eos": True})
    final = chunked["final_stats"]
    assert chunked["kept_tokens"] == 32 and final["pages"] - final["live_pages"] == chunked["dropped_pages"] >= 2
    inst = await run(runtime, "kv-eviction", {"prompt": "x", "method": "h2o", "budget": 4, "recent": 5})
    assert inst.status is Status.FAILED and "recent must be at most budget (4), got 5" in inst.error


def test_decode_probes():
    """What each policy's decode passes carry: SnapKV and the window none
    (SnapKV votes once, over the prompt's observation window), H2O and TOVA
    the all-layer ``sum`` probe, per KV head when ``heads="max"``."""
    assert kv_eviction.make_policy("window", 8).probe() is None
    assert kv_eviction.make_policy("snapkv", 8, heads="max").probe() is None
    for method in ("h2o", "tova"):
        plain, per_head = kv_eviction.make_policy(method, 8).probe(), kv_eviction.make_policy(method, 8, heads="max").probe()
        assert plain is not None and per_head is not None
        assert (plain.layers, plain.reduce, plain.per, plain.per_kv_head) == (None, "sum", "token", False)
        assert (per_head.layers, per_head.reduce, per_head.per, per_head.per_kv_head) == (None, "sum", "token", True)


def test_chunk_1_is_the_token_level_policy(result):
    assert result["tight"]["h2o chunk 1"] == result["tight"]["h2o"]  # kept positions, tokens, page counts


def _protected(label, row, prompt_len):
    """Positions a policy keeps token by token at ``row``: sinks, H2O's recent window, SnapKV's observation window."""
    opts, n = CHUNKED[label][1], row["kv_len"]
    keep = set(range(opts.get("sink", 0)))
    if CHUNKED[label][0] == "h2o":
        keep |= set(range(n - opts["recent"], n))
    if CHUNKED[label][0] == "snapkv":
        keep |= set(range(prompt_len - opts["window"], n))  # the window, then the generated tokens (oldest first)
    return keep


def _partial_chunks(row, protected):
    """Chunks of PAGE positions (up to kv_len) of which some unprotected positions are kept and some not."""
    kept, n = set(row["pos"]), row["kv_len"]
    out = []
    for lo in range(0, n, PAGE):
        span = [j for j in range(lo, min(n, lo + PAGE)) if j not in protected]
        if 0 < sum(j in kept for j in span) < len(span):
            out.append(lo // PAGE)
    return out


@pytest.mark.parametrize("label", ["h2o chunk", "snapkv chunk", "tova chunk", "tova+ chunk"])
def test_chunked_policy_keeps_whole_chunks_and_frees_their_pages(long_result, engine, label):
    assert engine.pool.page_size == PAGE
    rows = long_result["tight"][label]["rows"]
    plain = long_result["tight"][label.replace(" chunk", "")]["rows"]
    prompt_len = rows[0]["kv_len"]
    assert prompt_len >= LONG_BUDGET + 4 * PAGE  # the prefill evicts at least 4 pages' worth
    for i, row in enumerate(rows):
        assert len(row["pos"]) == row["kept"] == LONG_BUDGET  # the budget holds exactly, in tokens
        full = row["kv_len"] // PAGE
        gone = [p for p in range(full) if not any(p * PAGE <= j < (p + 1) * PAGE for j in row["pos"])]
        assert row["dropped"] == len(gone)  # the pages freed are exactly the full pages evicted whole
        assert row["live_pages"] == row["held"] == row["pages"] - len(gone)
        # after the prefill (every policy) and, for SnapKV, all along (its votes are fixed, so the chunk it
        # started stays the lowest): outside sinks and windows each chunk is kept or evicted whole, but one
        if i == 0 or label == "snapkv chunk":
            assert len(_partial_chunks(row, _protected(label, row, prompt_len))) <= 1, i
    # token-level selection scatters the prefill's evictions: chunks free (nearly) a page per 16 tokens evicted
    first = rows[0]
    assert first["dropped"] >= first["evicted"] // PAGE - 1 and first["dropped"] > plain[0]["dropped"]
    assert sum(r["held"] for r in rows) < sum(r["held"] for r in plain)


def test_lowest_chunks_rule():
    """Chunks ranked by the sum of their kept positions' scores (protected ones included), taken whole while
    they fit, the next one partly (its lowest tokens); chunk 1 is the token-level order."""
    import random

    rng = random.Random(3)
    score = [rng.random() for _ in range(50)]
    kept = [1] * 50
    cands = list(range(2, 45))
    for n in (0, 1, 7, 43, 60):
        assert lowest_chunks(score, kept, cands, n, 1) == sorted(sorted(cands, key=lambda j: (score[j], j))[:n])
    score = [5.0] * 4 + [1.0] * 4 + [0.5, 3.0, 0.1, 0.1] + [2.0] * 4
    kept = [1] * 16
    kept[9] = 0  # chunk 2 holds 0.5 + 0.1 + 0.1 = 0.7, the lowest; chunk 1: 4.0; chunk 0: 20 (protected 0, 1 count)
    cands = [2, 3, 4, 5, 6, 7, 8, 10, 11]
    assert lowest_chunks(score, kept, cands, 3, 4) == [8, 10, 11]
    assert lowest_chunks(score, kept, cands, 5, 4) == [4, 5, 8, 10, 11]  # chunk 1 partly: its first two (ties)
    assert lowest_chunks(score, kept, cands, 9, 4) == [2, 3, 4, 5, 6, 7, 8, 10, 11]
    assert lowest_chunks(score[:12], kept, cands + [12, 13], 1, 4)[0] == 12  # chunk 3 has no scores: it sums 0
