"""Named snapshots shared by replicas through one folder.

Two host states, each with its own engine of the default model (as two
``tartlet serve`` replicas would have), persist snapshots to the same folder
with ``configure_kv(..., shared=True)``: what one replica saves, saves again,
takes or deletes is what the other one sees; a save returns only once its
file is on disk; user namespaces hold across replicas.
"""

from __future__ import annotations

import logging
import threading
import uuid
from pathlib import Path

import pytest

from harness import assert_no_leaks, drain, inline_program, run_ok

pytestmark = pytest.mark.slow

SAVE = """
import os
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.user(args["prompt"])
    ctx.begin_assistant()
    await ctx.flush()
    ctx.save(args["name"])
    on_disk = os.path.exists(args["check"]) if args.get("check") else None  # right after save returned
    saved = ctx.tokens
    gen = await ctx.generate(max_tokens=12).collect_tokens()
    return {"tokens": saved, "gen": gen, "on_disk": on_disk}
"""

OPEN = """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    ctx = (Context.take if args.get("take") else Context.open)(model, args["name"])
    tokens = ctx.tokens
    gen = await ctx.generate(max_tokens=12).collect_tokens()
    ctx.close()
    return {"tokens": tokens, "gen": gen}
"""

TRY = """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    out = {"names": model.snapshot_names()}
    for op in args.get("ops", []):
        try:
            if op == "delete":
                Context.delete(model, args["name"])
            else:
                getattr(Context, op)(model, args["name"]).close()
            out[op] = "ok"
        except ValueError as e:
            out[op] = f"{type(e).__name__}: {e}"
    return out
"""

SAVE_ONCE = """
from tartlet import Model

async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill("Shared snapshot folder.")
    await ctx.flush()
    try:
        ctx.save(args["name"])
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None
"""

PROMPT = "Answer in one short sentence. Question: what colour is the sky on a clear day?"
OTHER = "Answer in one short sentence. Question: what is the capital city of France, and why?"


class Replica:
    """One replica: a host state with its own engine, and a native runtime on it."""

    def __init__(self, state, tmp: Path, label: str) -> None:
        from tartlet.runtime.native import NativeRuntime

        self.state = state
        self.runtime = NativeRuntime(state)
        self.tmp = tmp
        self.label = label
        self.n = 0

    @property
    def snapshots(self):
        return self.state.model(None).snapshots

    async def run(self, code: str, args: dict, owner: str = "") -> dict:
        self.n += 1
        return await run_ok(self.runtime, inline_program(self.tmp, code, f"{self.label}{self.n}"), args, owner=owner)

    async def save(self, name: str, prompt: str = PROMPT, owner: str = "", check: Path | None = None) -> dict:
        return await self.run(SAVE, {"name": name, "prompt": prompt, "check": str(check) if check else None}, owner)

    async def open(self, name: str, owner: str = "", take: bool = False) -> dict:
        return await self.run(OPEN, {"name": name, "take": take}, owner)

    async def attempt(self, name: str, *ops: str, owner: str = "") -> dict:
        return await self.run(TRY, {"name": name, "ops": list(ops)}, owner)

    def clean(self) -> None:
        """Delete this replica's copies (not the files) and check no page leaked."""
        mgr = self.snapshots
        for snap in mgr.registry.all():
            mgr.registry.discard(snap)
            mgr._free(snap)
        assert_no_leaks(self.state)
        assert self.state.model(None).engine.pool.stats().used == 0


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shared-snapshots")


@pytest.fixture(scope="module")
def states(loaded_model, folder):
    """Two replicas' host states: their own engines, one snapshot folder."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.host.kv_quotas import KvLimits
    from tartlet.host.state import HostState

    lm = loaded_model
    out = []
    for _ in range(2):
        state = HostState()
        state.add_engine(Engine(EngineConfig(kv_cache_mb=32), lm.config, dict(lm.weights), lm.tokenizer))
        state.configure_kv(KvLimits(), folder, shared=True)
        out.append(state)
    yield out
    for state in out:
        state.close()


@pytest.fixture
def replicas(states, tmp_path):
    a, b = Replica(states[0], tmp_path, "a"), Replica(states[1], tmp_path, "b")
    yield a, b
    for r in (a, b):
        r.clean()
    for f in Path(a.snapshots.store.dir).glob("*/*.safetensors"):
        f.unlink()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_a_snapshot_saved_on_one_replica_opens_on_the_other(replicas):
    a, b = replicas
    name = _name("shared")
    assert name not in b.snapshots.names("")
    saved = await a.save(name)
    # B never saw the save: the name comes from the folder, its pages from the file
    assert name in (await b.attempt(name))["names"]
    assert b.snapshots.registry.get("", name).seq is None
    opened = await b.open(name)
    assert opened["tokens"] == saved["tokens"]
    assert opened["gen"] == saved["gen"] and len(opened["gen"]) == 12  # the same greedy continuation
    again = await a.open(name)
    assert again["gen"] == saved["gen"]
    # taken through B: gone on A too, its in-memory copy dropped
    taken = await b.open(name, take=True)
    assert taken["tokens"] == saved["tokens"] and taken["gen"] == saved["gen"]
    drain(b.state)
    res = await a.attempt(name, "open")
    assert res["open"] == f"SnapshotError: no snapshot named {name!r}" and name not in res["names"]
    drain(a.state)
    assert a.snapshots.registry.all() == []
    assert a.state.model(None).engine.pool.stats().used == 0  # A's copy's pages were freed


async def test_a_snapshot_deleted_on_one_replica_cannot_be_opened_on_the_other(replicas):
    a, b = replicas
    name = _name("gone")
    await a.save(name)
    await b.open(name)  # B now holds it in memory
    assert b.snapshots.registry.get("", name).seq is not None
    assert (await a.attempt(name, "delete"))["delete"] == "ok"
    res = await b.attempt(name, "open", "take", "delete")
    for op in ("open", "take", "delete"):
        assert res[op] == f"SnapshotError: no snapshot named {name!r}"
    drain(b.state)
    assert b.state.model(None).engine.pool.stats().used == 0  # B dropped its copy
    # deleted on A while B only listed it: B's listing forgets it
    name2 = _name("gone")
    await a.save(name2)
    assert name2 in b.snapshots.names("")
    a.snapshots.delete("", name2)
    assert name2 not in b.snapshots.names("")


async def test_a_name_saved_again_on_one_replica_opens_its_new_content_on_the_other(replicas, caplog):
    caplog.set_level(logging.INFO, logger="tartlet.host.snapshot_manager")
    a, b = replicas
    name = _name("again")
    first = await a.save(name)
    opened = await b.open(name)
    assert opened["gen"] == first["gen"]
    a.snapshots.delete("", name)
    second = await a.save(name, OTHER)
    assert second["tokens"] != first["tokens"]
    reopened = await b.open(name)  # B's copy is older than the file: dropped, the file loaded
    assert reopened["tokens"] == second["tokens"] and reopened["gen"] == second["gen"]
    assert reopened["gen"] != first["gen"]
    assert f"snapshot {name!r} of user '' dropped from this replica: its file was saved again" in caplog.text
    # saving a name that exists (saved through another replica) fails as on one server
    mgr = b.snapshots
    known = mgr.registry.get("", name)
    mgr.registry.discard(known)  # as if B had never seen it
    mgr._free(known)
    res = await b.run(SAVE_ONCE, {"name": name})
    assert res == f"SnapshotError: a snapshot named {name!r} already exists"


async def test_users_keep_their_namespaces_across_replicas(replicas):
    a, b = replicas
    secret, public = _name("secret"), _name("public/shared")
    saved = await a.save(secret, owner="alice")
    await a.save(public, owner="alice")
    snoop = await b.attempt(secret, "open", "take", "delete", owner="bob")
    for op in ("open", "take", "delete"):
        assert snoop[op] == f"SnapshotError: no snapshot named {secret!r}"
    assert secret not in snoop["names"] and public in snoop["names"]
    assert (await b.open(secret, owner="alice"))["gen"] == saved["gen"]
    # a public name: every user opens it, only its creator deletes it
    res = await b.attempt(public, "open", "delete", owner="bob")
    assert res["open"] == "ok"
    assert res["delete"].startswith("SnapshotError: ") and "belongs to another user" in res["delete"]
    assert (await b.attempt(public, "delete", owner="alice"))["delete"] == "ok"
    assert (await a.attempt(public, "open", owner="bob"))["open"] == f"SnapshotError: no snapshot named {public!r}"


async def test_a_shared_save_returns_once_its_file_is_on_disk(replicas):
    """The writer thread is held for a while: an asynchronous save would
    return before its file exists; a shared one waits for it."""
    a, b = replicas
    mgr = a.snapshots
    assert mgr.shared
    name = _name("durable")
    path = mgr.store.path_for("", name)
    release = threading.Event()
    mgr._writer.submit(release.wait, 30)
    timer = threading.Timer(0.5, release.set)
    timer.start()
    saved = await a.save(name, check=path)
    timer.join()
    assert saved["on_disk"] is True
    assert (await b.open(name))["gen"] == saved["gen"]

    # the same with the single-server default: the save returns first
    name2 = _name("async")
    path2 = mgr.store.path_for("", name2)
    release.clear()
    mgr.shared = False
    try:
        mgr._writer.submit(release.wait, 30)
        saved2 = await a.save(name2, check=path2)
        assert saved2["on_disk"] is False
        release.set()
        mgr.flush()
        assert path2.exists()
    finally:
        release.set()
        mgr.shared = True


REOPEN_SAVE = """
from tartlet import Context, Model

async def main(args):
    model = Model.load()
    ctx = Context.open(model, args["name"])
    ctx.save(args["new"])
    ctx.close()
"""


async def test_replicas_share_page_files_and_a_sweep_spares_young_ones(replicas):
    """Page files (``tartlet-kv-snapshot/2``) are shared through the folder:
    B opens A's snapshot (loading its page files) and saves it again under a
    new name, writing no page file and touching those it names; deleting
    A's name keeps them, and a deleted snapshot's page files stay while they
    are younger than the grace period (another replica may be about to name
    them), then a sweep removes them."""
    import os
    import time

    a, b = replicas
    x, y = _name("pagesx"), _name("pagesy")
    saved = await a.save(x)
    folder = a.snapshots.store.path_for("", x).parent
    pages = folder / "pages"
    xs = set(a.snapshots.registry.get("", x).blobs)
    assert xs and {p.stem for p in pages.glob("*.kv")} >= xs
    old = time.time() - 7200
    for blob in xs:
        os.utime(pages / f"{blob}.kv", (old, old))
    engine = b.state.model(None).engine
    engine.scheduler.command(engine.pool.evict_all_cached).result(timeout=60)  # B's pages come from the files
    written = b.snapshots.store.pages.stats.pages_written
    await b.run(REOPEN_SAVE, {"name": x, "new": y})
    assert set(b.snapshots.registry.get("", y).blobs) == xs  # the same bytes: the same page files
    assert b.snapshots.store.pages.stats.pages_written == written
    assert all(time.time() - (pages / f"{blob}.kv").stat().st_mtime < 600 for blob in xs)  # touched by the save
    assert (await a.attempt(x, "delete"))["delete"] == "ok"
    a.snapshots.flush()
    assert {p.stem for p in pages.glob("*.kv")} >= xs
    assert (await a.open(y))["gen"] == saved["gen"]
    assert (await a.attempt(y, "delete"))["delete"] == "ok"
    a.snapshots.flush()
    assert {p.stem for p in pages.glob("*.kv")} >= xs  # named by no file, but young: kept
    a.snapshots.store.sweep(folder, 0.0)
    assert not {p.stem for p in pages.glob("*.kv")} & xs


async def test_close_writes_every_queued_save(loaded_model, tmp_path):
    """A normal shutdown writes what was queued (single-server mode)."""
    from tartlet.engine.core.engine import Engine, EngineConfig
    from tartlet.host.kv_quotas import KvLimits
    from tartlet.host.state import HostState

    lm = loaded_model
    state = HostState()
    state.add_engine(Engine(EngineConfig(kv_cache_mb=16), lm.config, dict(lm.weights), lm.tokenizer))
    state.configure_kv(KvLimits(), tmp_path / "snaps")
    r = Replica(state, tmp_path, "c")
    mgr = r.snapshots
    release = threading.Event()
    mgr._writer.submit(release.wait, 30)
    names = [_name("queued") for _ in range(3)]
    for n in names:
        await r.save(n)
    assert not any(mgr.store.path_for("", n).exists() for n in names)
    threading.Timer(0.3, release.set).start()
    mgr.close()
    assert all(mgr.store.path_for("", n).exists() for n in names)
    state.close()
