"""Named KV snapshots on the real model: save, open, take, delete, snapshot().

A snapshot is an immutable, engine-wide copy-on-write reference to a
context's pages. It outlives the inferlet that saved it; ``open`` forks it,
``take`` hands its pages over and removes the name.
"""

from __future__ import annotations

import uuid

import pytest

from harness import drain, inline_program, run_ok

PROMPT = (
    "You are a careful assistant. Answer in one short sentence, and never use more words than needed. "
    "Question: what colour is the sky on a clear day?"
)

SAVE = f"""
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.user({PROMPT!r})
    ctx.begin_assistant()
    await ctx.flush()
    ctx.save(args["name"])
    saved = ctx.tokens
    # generating on the saver's context must not touch the snapshot
    text = await ctx.generate(max_tokens=16).collect_text()
    return {{"tokens": saved, "text": text, "used": model.kv_stats()["used"]}}
"""

OPEN = """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    ctx = (Context.take if args.get("take") else Context.open)(model, args["name"])
    tokens = ctx.tokens
    stats = await ctx.stats()
    used = model.kv_stats()["used"]
    gen = ctx.generate(max_tokens=16)
    text = await gen.collect_text()
    return {"tokens": tokens, "stats": stats, "used": used, "text": text}
"""


async def test_snapshot_outlives_its_inferlet_and_opens_as_a_fork(runtime, engine, tmp_path):
    name = f"test-snap-{uuid.uuid4().hex[:8]}"
    saved = await run_ok(runtime, inline_program(tmp_path, SAVE, "save"), {"name": name})
    n = len(saved["tokens"])
    pages = -(-n // 16)
    drain(runtime.state)
    # the saver ended: its context is gone, the snapshot's pages are not
    assert engine.pool.stats().used == pages
    assert runtime.state.model(None).snapshots.names() == [name]

    opened = await run_ok(runtime, inline_program(tmp_path, OPEN, "open"), {"name": name})
    assert opened["tokens"] == saved["tokens"]
    assert opened["stats"] == {"tokens": n, "pages": pages, "live_pages": pages, "shared_pages": n // 16}
    # the fork shares the snapshot's full pages: only the partly filled tail was copied
    assert opened["used"] == pages + (1 if n % 16 else 0)
    ref = await run_ok(runtime, "text-completion", {"prompt": PROMPT, "max_tokens": 16})
    assert opened["text"] == saved["text"] == ref["text"] and ref["text"].startswith("The sky")

    again = await run_ok(runtime, inline_program(tmp_path, OPEN, "open2"), {"name": name})
    assert again["tokens"] == saved["tokens"] and again["text"] == saved["text"]  # immutable

    taken = await run_ok(runtime, inline_program(tmp_path, OPEN, "take"), {"name": name, "take": True})
    assert taken["tokens"] == saved["tokens"] and taken["text"] == saved["text"]
    assert taken["used"] == pages  # take hands the pages over: nothing copied
    drain(runtime.state)
    assert runtime.state.model(None).snapshots.names() == []
    assert engine.pool.stats().used == 0


async def test_snapshot_errors_are_clear_and_change_nothing(runtime, engine, tmp_path):
    code = """
    from tartlet import Context, Model

    async def main(args):
        model = Model.load()
        errors = {}
        def expect(key, fn):
            try:
                fn()
            except ValueError as e:
                errors[key] = f"{type(e).__name__}: {e}"
        ctx = model.new_context()
        ctx.fill("Snapshot error cases.")
        expect("pending", lambda: ctx.save("x"))
        await ctx.flush()
        auto = ctx.snapshot()
        expect("exists", lambda: ctx.save(auto))
        expect("empty name", lambda: ctx.save(""))
        for verb in ("open", "take", "delete"):
            expect(verb, lambda: getattr(Context, verb)(model, "no-such-snapshot"))
        used = model.kv_stats()["used"]
        reopened = Context.open(model, auto)
        toks = reopened.tokens == ctx.tokens
        reopened.close()
        Context.delete(model, auto)
        expect("deleted", lambda: Context.open(model, auto))
        ctx.close()
        expect("closed", lambda: ctx.save("late"))
        return {"errors": errors, "auto": auto, "toks": toks}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "snaperr"))
    e = out["errors"]
    assert out["auto"].startswith("snapshot-") and out["toks"]
    assert "pending tokens" in e["pending"] and "flush" in e["pending"]
    assert e["exists"] == f"SnapshotError: a snapshot named {out['auto']!r} already exists"
    assert e["empty name"].startswith("SnapshotError: snapshot name must be a non-empty string")
    for verb in ("open", "take", "delete"):
        assert e[verb] == "SnapshotError: no snapshot named 'no-such-snapshot'"
    assert e["deleted"] == f"SnapshotError: no snapshot named {out['auto']!r}"
    assert e["closed"].startswith("ContextClosedError: save on a closed context")
    drain(runtime.state)
    assert runtime.state.model(None).snapshots.names() == []
    assert engine.pool.stats().used == 0


async def test_snapshot_of_a_forked_generation_resumes_exactly(runtime, tmp_path):
    """Save mid-generation, reopen, continue: the continuation equals the
    uninterrupted greedy generation."""
    code = """
    from tartlet import Context, Model

    async def main(args):
        model = Model.load()
        full = model.new_context()
        full.user("List the planets of the solar system.")
        whole = await full.generate(max_tokens=24).collect_tokens()
        ctx = model.new_context()
        ctx.user("List the planets of the solar system.")
        first = await ctx.generate(max_tokens=10).collect_tokens()
        await ctx.flush()  # the last sampled token is pending until flushed
        name = ctx.snapshot()
        ctx.close()
        with Context.open(model, name) as resumed:
            rest = await resumed.generate(max_tokens=14).collect_tokens()
        Context.delete(model, name)
        return {"whole": whole, "parts": first + rest}
    """
    out = await run_ok(runtime, inline_program(tmp_path, code, "resume"))
    assert out["parts"] == out["whole"]


async def test_a_snapshot_saved_with_pending_tokens_runs_no_pass_and_resumes_exactly(runtime, engine, tmp_path):
    """``save(name, pending=True)`` saves the KV cache as it is, the pending
    tokens (here the last sampled one) left out and returned, with no model
    call; opened with those filled, the continuation equals the
    uninterrupted greedy generation."""
    code = """
    from tartlet import Context, Model

    async def main(args):
        model = Model.load()
        full = model.new_context()
        full.user("List the planets of the solar system.")
        whole = await full.generate(max_tokens=24).collect_tokens()
        ctx = model.new_context()
        ctx.user("List the planets of the solar system.")
        first = await ctx.generate(max_tokens=10).collect_tokens()
        held = ctx.tokens
        name = "pending-" + args["tag"]
        pending = ctx.save(name, pending=True)
        kept = ctx.pending  # the saver keeps its pending tokens
        ctx.close()
        with Context.open(model, name) as resumed:
            opened = resumed.tokens
            resumed.fill_tokens(pending)
            rest = await resumed.generate(max_tokens=14).collect_tokens()
        Context.delete(model, name)
        return {"whole": whole, "parts": first + rest, "held": held, "opened": opened, "pending": pending, "kept": kept,
                "last": first[-1]}
    """
    prog = inline_program(tmp_path, code, "pendsave")
    out = await run_ok(runtime, prog, {"tag": uuid.uuid4().hex[:8]})
    assert out["pending"] == out["kept"] == [out["last"]]
    assert out["opened"] + out["pending"] == out["held"]
    assert out["parts"] == out["whole"]
    # the save itself runs no pass: the same program without generating around it computes nothing
    code = """
    from tartlet import Context, Model

    async def main(args):
        model = Model.load()
        ctx = model.new_context()
        ctx.fill("Saved without a pass.")
        pending = ctx.save("nopass-" + args["tag"], pending=True)
        Context.delete(model, "nopass-" + args["tag"])
        return pending
    """
    calls = engine.scheduler.stats.model_calls
    assert await run_ok(runtime, inline_program(tmp_path, code, "nopass"), {"tag": uuid.uuid4().hex[:8]})
    assert engine.scheduler.stats.model_calls == calls


async def test_persisted_snapshots_restore_and_refuse_another_model(runtime, engine, tmp_path):
    """With a data dir, a saved snapshot is written to a safetensors file;
    a fresh manager on the same dir (a restart) lists it, loads its pages on
    open and continues exactly as before. A file stamped with another
    model's identity is a clear error, and nothing leaks."""
    from tartlet.host.snapshot_manager import SnapshotManager
    from tartlet.sdk.errors import SnapshotError

    slot = runtime.state.model(None)
    live = slot.snapshots
    live.enable_persistence(tmp_path / "snaps")
    name = f"persist-{uuid.uuid4().hex[:8]}"
    try:
        saved = await run_ok(runtime, inline_program(tmp_path, SAVE, "save"), {"name": name})
        live.flush()
        (f,) = (tmp_path / "snaps").glob("*/*/*.safetensors")
        assert f.stat().st_mode & 0o777 == 0o600
        # a restart: a new manager over the same folder; the old one's pages go
        restarted = SnapshotManager(engine, slot.accounts)
        assert restarted.enable_persistence(tmp_path / "snaps") == 1
        assert restarted.names("") == [name] and restarted.registry.get("", name).seq is None
        slot.snapshots = restarted
        gone = live.registry.pop("", name)  # the old process's pages: freed as by a real restart
        engine.scheduler.command(gone.seq.free, gone.seq).result(timeout=60)
        assert engine.pool.stats().used == 0
        opened = await run_ok(runtime, inline_program(tmp_path, OPEN, "open"), {"name": name})
        assert opened["tokens"] == saved["tokens"] and opened["text"] == saved["text"]

        other = SnapshotManager(engine, slot.accounts)
        other.enable_persistence(tmp_path / "snaps")
        other.store.identity = other.store.identity.replace('"page_size": 16', '"page_size": 32')
        with pytest.raises(SnapshotError, match=r"saved with another model or settings \(page_size: saved 16, here 32\)"):
            other.fork_source("", name)
        with pytest.raises(SnapshotError, match="no snapshot named"):
            other.fork_source("someone-else", name)  # per-user namespaces
    finally:
        slot.snapshots = live
        for mgr in (live, locals().get("restarted")):
            if mgr is not None:
                for snap in mgr.registry.all():
                    mgr.delete(snap.owner, snap.name)
                mgr.close()
        live.store, live._writer = None, None
    drain(runtime.state)
    assert engine.pool.stats().used == 0


async def test_chat_on_an_opened_snapshot_needs_adopt_chat_and_then_renders_as_a_fresh_chat(runtime, tmp_path):
    """A snapshot holds tokens, not messages: ``user()`` on an opened chat
    snapshot without ``adopt_chat`` raises ChatNotAdoptedError (it used to
    render the template's default system prompt mid-context). After
    ``end_turn`` + save, ``adopt_chat`` of the same messages continues the
    chat with exactly the text a fresh chat of those messages renders, and
    fills only the new turn."""
    code = """
    from tartlet import ChatNotAdoptedError, Context, Model

    async def main(args):
        model = Model.load()
        msgs = [{"role": "user", "content": "Name a colour."}]
        with model.new_context() as ctx:
            ctx.user(msgs[0]["content"])
            reply = await ctx.generate(max_tokens=8).collect_text()
            ctx.end_turn()  # the closing markup now, so the snapshot is the rendering of the messages
            await ctx.flush()
            name = ctx.snapshot()
        msgs.append({"role": "assistant", "content": reply})
        opened = Context.open(model, name)
        try:
            opened.user("And another one?")
            raised = None
        except ChatNotAdoptedError as e:
            raised = str(e)
        held = opened.seq_len
        opened.adopt_chat(msgs)
        opened.user("And another one?")
        new = opened.seq_len - held
        with model.new_context() as fresh:
            for m in msgs + [{"role": "user", "content": "And another one?"}]:
                fresh.add_message(m)
            fresh_text, fresh_tokens = fresh.text, fresh.seq_len
        text = opened.text
        opened.close()
        Context.delete(model, name)
        return {"raised": raised, "text": text, "fresh": fresh_text, "new": new, "fresh_tokens": fresh_tokens, "held": held}
    """
    import textwrap

    out = await run_ok(runtime, inline_program(tmp_path, textwrap.dedent(code), "adopt"))
    assert out["raised"] and "adopt_chat" in out["raised"]
    assert out["text"] == out["fresh"]
    assert "You are a helpful" not in out["text"].split("Name a colour.")[1]  # no system prompt mid-context
    assert 0 < out["new"] < 20 and out["held"] + out["new"] <= out["fresh_tokens"] + 2
