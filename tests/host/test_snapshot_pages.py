"""Snapshot files that share page files (``tartlet-kv-snapshot/2``, issue 35).

A snapshot file names one page file per live page; page files live once per
user folder, so a save of a context that extends a saved one writes only its
new pages, and (full pages being immutable while held) names the shared ones
without reading them again. Checked on the real model: exact page counts
written, identical greedy continuations after a restart, deleting keeps what
another snapshot names and removes the rest, a damaged page file is a clear
error, a stray one is swept, and ``/1`` files (KV inside) still load.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from harness import drain, inline_program, run_ok

PS = 16
FIRST = (
    "You are a careful assistant. Answer in one short sentence, and never use more words than needed. "
    "Question: what colour is the sky on a clear day, at noon?"
)
SECOND = " And what colour is the grass in spring, after a week of warm rain and a few sunny afternoons?"

SAVE_TWO = """
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill(args["first"])
    await ctx.flush()
    ctx.save(args["a"])
    a = ctx.tokens
    if args.get("b"):
        ctx.fill(args["second"])
        await ctx.flush()
        ctx.save(args["b"])
    return {"a": a, "b": ctx.tokens}
"""

CONT = """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    if args.get("name"):
        try:
            ctx = Context.open(model, args["name"])
        except ValueError as e:
            return {"error": f"{type(e).__name__}: {e}"}
    else:
        ctx = model.new_context()
        ctx.fill_tokens(args["tokens"])
    tokens = ctx.tokens
    gen = await ctx.generate(max_tokens=10).collect_tokens()
    ctx.close()
    return {"tokens": tokens, "gen": gen}
"""


class Harness:
    """The model slot's snapshot manager persisting to ``folder``; restarts
    swap in a new manager on the same folder (the old one's pages freed and
    the prefix cache emptied, so opens load the KV from disk)."""

    def __init__(self, runtime, engine, tmp_path: Path) -> None:
        self.runtime, self.engine, self.tmp = runtime, engine, tmp_path
        self.slot = runtime.state.model(None)
        self.original = self.slot.snapshots
        self.folder = tmp_path / "snaps"
        self.managers = [self.original]
        self.original.enable_persistence(self.folder)
        self.n = 0

    @property
    def mgr(self):
        return self.slot.snapshots

    @property
    def stats(self):
        return self.mgr.store.pages.stats

    def pages_dir(self) -> Path:
        (d,) = self.mgr.store.user_dirs()
        return d / "pages"

    def blobs(self) -> set[str]:
        d = self.mgr.store.user_dirs()
        return {p.stem for p in (d[0] / "pages").glob("*.kv")} if d else set()

    async def run(self, code: str, args: dict) -> dict:
        self.n += 1
        return await run_ok(self.runtime, inline_program(self.tmp, code, f"pages{self.n}"), args)

    def evict(self) -> None:
        drain(self.runtime.state)
        self.engine.scheduler.command(self.engine.pool.evict_all_cached).result(timeout=60)

    def restart(self, **kw):
        from tartlet.host.snapshot_manager import SnapshotManager

        old = self.mgr
        old.flush()
        new = SnapshotManager(self.engine, self.slot.accounts)
        restored = new.enable_persistence(self.folder, **kw)
        for snap in old.registry.all():  # as a real restart: the pages go, the files stay
            old.registry.discard(snap)
            old._free(snap)
        self.slot.snapshots = new
        self.managers.append(new)
        self.evict()
        assert self.engine.pool.stats().used == 0
        return restored

    def close(self) -> None:
        for mgr in self.managers:
            mgr.flush()
            for snap in mgr.registry.all():
                mgr.registry.discard(snap)
                mgr._free(snap)
            mgr.close()
        self.slot.snapshots = self.original
        self.original.store, self.original._writer = None, None
        drain(self.runtime.state)


@pytest.fixture
def h(runtime, engine, tmp_path):
    h = Harness(runtime, engine, tmp_path)
    yield h
    h.close()
    assert engine.pool.stats().used == 0


def _names() -> tuple[str, str]:
    tag = uuid.uuid4().hex[:8]
    return f"pages-a-{tag}", f"pages-b-{tag}"


async def test_an_extended_save_writes_only_its_new_pages_and_both_load_back_exactly(h):
    a, b = _names()
    h.evict()
    saved = await h.run(SAVE_TWO, {"first": FIRST, "second": SECOND, "a": a, "b": b})
    h.mgr.flush()
    na, nb = len(saved["a"]), len(saved["b"])
    assert na % PS and nb > na + PS  # a's last page partly filled; b adds pages
    live_a, live_b, full_a = -(-na // PS), -(-nb // PS), na // PS
    st = h.stats
    # a: every page read and written; b: a's full pages named without reading, the rest (from a's old tail on) new
    assert st.pages_reused == full_a
    assert st.pages_hashed == live_a + (live_b - full_a)
    assert st.pages_written == st.pages_hashed and len(h.blobs()) == live_a + live_b - full_a
    files = {s.name: s.path for s in h.mgr.registry.all()}
    assert st.bytes_written == st.pages_written * h.mgr.store.pages.page_bytes + sum(f.stat().st_size for f in files.values())
    assert all(f.stat().st_size < 4096 for f in files.values())  # the KV is in the page files
    assert {p.stat().st_mode & 0o777 for p in h.pages_dir().iterdir()} == {0o600}

    assert h.restart() == 2
    opened = {n: await h.run(CONT, {"name": n}) for n in (a, b)}
    assert opened[a]["tokens"] == saved["a"] and opened[b]["tokens"] == saved["b"]
    # a restart remembers the pages it loaded: saving b again under a new name reads only its partly filled last page
    c = b + "-again"
    before = (h.stats.pages_hashed, h.stats.pages_written)
    await h.run(
        """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    ctx = Context.open(model, args["b"])
    ctx.save(args["c"])
    ctx.close()
""",
        {"b": b, "c": c},
    )
    h.mgr.flush()
    assert h.stats.pages_hashed - before[0] == 1 and h.stats.pages_written == before[1]  # same bytes: no new file
    h.mgr.delete("", c)

    # delete a: b still loads from disk; only the page files a alone named went
    h.mgr.delete("", a)
    h.mgr.flush()
    assert len(h.blobs()) == live_b
    assert h.restart() == 1
    again = await h.run(CONT, {"name": b})
    assert again == opened[b]
    h.mgr.delete("", b)
    h.mgr.flush()
    assert h.blobs() == set()

    # a context that was never saved continues exactly as the loaded snapshots did
    h.evict()
    for n, toks in ((a, saved["a"]), (b, saved["b"])):
        ref = await h.run(CONT, {"tokens": toks})
        assert ref["gen"] == opened[n]["gen"], n


async def test_a_damaged_page_file_is_a_clear_error_and_a_stray_one_is_swept(h):
    a, b = _names()
    await h.run(SAVE_TWO, {"first": FIRST, "second": SECOND, "a": a, "b": b})
    h.mgr.flush()
    files_a = set(h.mgr.registry.get("", a).blobs)
    only_b = sorted(set(h.mgr.registry.get("", b).blobs) - files_a)
    victim = h.pages_dir() / f"{only_b[-1]}.kv"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    # a crash between a page file and its snapshot file: an unnamed page file (and a temporary one)
    stray = h.pages_dir() / f"{'0' * 64}.kv"
    stray.write_bytes(b"x" * 10)
    (h.pages_dir() / f"{'1' * 64}.abc.tmp").write_bytes(b"y")
    h.restart()
    assert not stray.exists() and not list(h.pages_dir().glob("*.tmp")) and victim.exists()
    bad = await h.run(CONT, {"name": b})
    assert bad["error"].startswith(f"SnapshotError: snapshot {b!r} is corrupt: its page file {only_b[-1][:16]}")
    assert h.engine.pool.stats().used == 0  # nothing half-loaded stays
    good = await h.run(CONT, {"name": a})  # a shares none of the damaged page: it loads
    assert "error" not in good and good["gen"]
    victim.unlink()
    h.restart()
    gone = await h.run(CONT, {"name": b})
    assert gone["error"].startswith(f"SnapshotError: snapshot {b!r} is corrupt: its page file {only_b[-1][:16]}") and "missing" in gone["error"]
    for n in (a, b):
        h.mgr.delete("", n)


async def test_format_1_files_still_load(h):
    from safetensors import safe_open

    a, _ = _names()
    h.mgr.store.version = 1  # the format before page files
    saved = await h.run(SAVE_TWO, {"first": FIRST, "a": a})
    h.mgr.flush()
    path = h.mgr.registry.get("", a).path
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["format"] == "tartlet-kv-snapshot/1" and set(f.keys()) == {"k", "v"}
    assert h.blobs() == set()
    assert h.restart() == 1
    assert h.mgr.store.version == 2
    opened = await h.run(CONT, {"name": a})
    assert opened["tokens"] == saved["a"]
    h.mgr.delete("", a)
    h.evict()
    ref = await h.run(CONT, {"tokens": saved["a"]})
    assert ref["gen"] == opened["gen"]


async def test_the_disk_budget_counts_a_shared_page_file_once(h):
    a, b = _names()
    await h.run(SAVE_TWO, {"first": FIRST, "second": SECOND, "a": a, "b": b})
    h.mgr.flush()
    snaps = {s.name: s for s in h.mgr.registry.all()}
    files = sum(s.path.stat().st_size for s in snaps.values())
    unique = len(h.blobs()) * h.mgr.store.pages.page_bytes
    per_snapshot = sum(len(s.blobs) for s in snaps.values()) * h.mgr.store.pages.page_bytes
    assert per_snapshot > unique
    # within the budget when shared pages count once: all stay after a restart with that budget and another save
    leeway = (len(snaps[a].blobs) + 1) * h.mgr.store.pages.page_bytes + 2048  # c: a's tokens again, at most all new pages
    h.restart(budget_bytes=files + unique + leeway)
    c = a + "-c"
    await h.run(SAVE_TWO, {"first": FIRST, "a": c})
    h.mgr.flush()
    assert sorted(s.name for s in h.mgr.registry.all() if s.path is not None) == sorted([a, b, c])
    # past the budget the least recently used go, and the page files only they named
    h.mgr.store.budget_bytes = 1
    h.mgr._enforce_budget("", keep=h.mgr.registry.get("", c))
    assert [s.name for s in h.mgr.registry.all() if s.path is not None] == [c]
    assert h.blobs() == set(h.mgr.registry.get("", c).blobs)
    for n in [s.name for s in h.mgr.registry.all()]:
        h.mgr.delete("", n)


def test_over_budget_counts_shared_pages_once():
    from tartlet.host.snapshot_pages import over_budget

    files = [("old", 100, ("x", "y")), ("mid", 100, ("x", "y", "z")), ("new", 100, ("x", "y", "z", "w"))]
    # 300 bytes of files + 4 unique pages of 1000 = 4300
    assert over_budget(files, 1000, 4300, keep="new") == []
    assert over_budget(files, 1000, 4299, keep="new") == ["old"]  # frees its file only: its pages are shared
    assert over_budget(files, 1000, 4199, keep="new") == ["old", "mid"]
    assert over_budget(files, 1000, 0, keep="new") == ["old", "mid"]
