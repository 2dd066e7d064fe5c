"""Masking and eviction of KV pages on the real model.

``mask_token_range`` hides tokens from every later pass; ``drop_masked_pages``
frees pages whose tokens are all hidden, without changing any output.
Together they give sliding windows with attention sinks in bounded memory.
"""

from __future__ import annotations

from harness import drain, inline_program, run_ok

LONG = (
    "Alice keeps a notebook. On Monday she wrote about rivers, on Tuesday about mountains, "
    "on Wednesday about the sea, on Thursday about forests and on Friday about deserts. "
    "Every entry was long and careful, full of small drawings and notes in the margins. "
)

DROP = f"""
from tartlet import Model
from tartlet.sdk import forward

async def main(args):
    model = Model.load()
    ps = model.page_size
    base = model.new_context()
    base.fill({LONG!r} * 2)
    await base.flush()
    n = base.kv_len
    used0 = model.kv_stats()["used"]
    masked, dropped = base.fork(), base.fork()
    lo, hi = 4, n - 8                         # keep 4 sink tokens and the last 8
    for c in (masked, dropped):
        c.mask_token_range(lo, hi)
    n_dropped = await dropped.drop_masked_pages()
    again = await dropped.drop_masked_pages()  # nothing left to drop
    st_drop, st_mask, st_base = await dropped.stats(), await masked.stats(), await base.stats()
    used1 = model.kv_stats()["used"]
    out = {{}}
    for name, c in (("base", base), ("masked", masked), ("dropped", dropped)):
        c.fill(" The notebook")
        out[name] = await c.generate(max_tokens=16).collect_tokens()
    # showing the masked tokens again restores the unmasked output
    shown = base.fork()
    shown.truncate(n)
    shown.mask_token_range(lo, hi)
    shown.mask_token_range(lo, hi, masked=False)
    shown.fill(" The notebook")
    out["shown"] = await shown.generate(max_tokens=16).collect_tokens()
    return {{"n": n, "ps": ps, "lo": lo, "hi": hi, "n_dropped": n_dropped, "again": again,
             "st_drop": st_drop, "st_mask": st_mask, "st_base": st_base, "used0": used0, "used1": used1, "out": out}}
"""


async def test_drop_masked_pages_frees_pages_and_changes_no_output(runtime, tmp_path):
    r = await run_ok(runtime, inline_program(tmp_path, DROP, "drop"))
    n, ps, lo, hi = r["n"], r["ps"], r["lo"], r["hi"]
    assert n > 3 * ps
    full_inside = [j for j in range(n // ps) if j * ps >= lo and (j + 1) * ps <= hi]
    assert r["n_dropped"] == len(full_inside) >= 2 and r["again"] == 0
    pages = -(-n // ps)
    assert r["st_mask"] == {"tokens": n, "pages": pages, "live_pages": pages, "shared_pages": n // ps}
    assert r["st_drop"]["pages"] == pages and r["st_drop"]["live_pages"] == pages - r["n_dropped"]
    # the fork dropped its references only: the parent still holds every page
    assert r["st_base"]["live_pages"] == pages
    assert r["used1"] == r["used0"] + 2 * (1 if n % ps else 0)  # two tail copies, nothing else
    out = r["out"]
    assert out["dropped"] == out["masked"], "dropping fully masked pages must not change the output"
    assert out["masked"] != out["base"], "hiding most of the context should change the continuation"
    assert out["shown"] == out["base"]


async def test_dropped_pages_are_really_freed(runtime, engine, tmp_path):
    code = f"""
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill({LONG!r} * 2)
        await ctx.flush()
        n = ctx.kv_len
        before = model.kv_stats()
        ctx.mask_token_range(0, n)
        dropped = await ctx.drop_masked_pages()
        after = model.kv_stats()
        st = await ctx.stats()
        # everything hidden: a new token attends only to itself, still works
        ctx.fill(" Hello")
        toks = await ctx.generate(max_tokens=4).collect_tokens()
        return {{"n": n, "dropped": dropped, "before": before, "after": after, "st": st, "toks": toks}}
    """
    r = await run_ok(runtime, inline_program(tmp_path, code, "freed"))
    n = r["n"]
    assert r["dropped"] == n // 16  # every full page; the partly filled tail stays
    assert r["st"]["live_pages"] == (1 if n % 16 else 0)
    # the pages were pure prefill pages, so they stay reusable in the prefix cache (not leaked)
    assert r["after"]["used"] == r["before"]["used"] - r["dropped"]
    assert len(r["toks"]) == 4


async def test_mask_range_out_of_bounds_is_rejected(runtime, tmp_path):
    code = """
    from tartlet import Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill("Short context for masking.")
        await ctx.flush()
        n = ctx.kv_len
        errors = []
        for a, b in ((0, n + 1), (-1, 2), (3, 1), (n + 5, n + 6), (0.5, 2)):
            try:
                ctx.mask_token_range(a, b)
            except ValueError as e:
                errors.append(str(e))
        st = await ctx.stats()
        toks = await ctx.generate(max_tokens=6).collect_tokens()
        ref = model.new_context()
        ref.fill("Short context for masking.")
        return {"errors": errors, "n": n, "st": st, "toks": toks, "ref": await ref.generate(max_tokens=6).collect_tokens()}
    """
    r = await run_ok(runtime, inline_program(tmp_path, code, "maskoob"))
    assert len(r["errors"]) == 5
    assert all(e.startswith("mask range") and "outside the context" in e for e in r["errors"]), r["errors"]
    assert r["st"]["live_pages"] == r["st"]["pages"]
    assert r["toks"] == r["ref"], "rejected mask calls must leave the context unchanged"


async def test_windowed_attention_keeps_live_pages_bounded(runtime, engine):
    window, sink = 16, 4
    res = await run_ok(
        runtime,
        "windowed-attention",
        {"prompt": "Tell me a long story about a dragon.", "window": window, "sink": sink, "max_tokens": 4 * window, "ignore_eos": True},
    )
    assert len(res["tokens"]) == 4 * window
    ps = res["page_size"]
    bound = -(-sink // ps) + -(-window // ps) + 1
    assert res["page_bound"] == bound == 3
    assert res["peak_live_pages"] <= bound
    final = res["final_stats"]
    assert final["tokens"] > 4 * window
    assert final["live_pages"] <= bound < final["pages"]
    assert res["dropped_pages"] == final["pages"] - final["live_pages"] >= 3
    drain(runtime.state)
