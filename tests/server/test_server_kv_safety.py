"""Multi-tenant KV safety on a real `tartlet serve` (auth on, two users):
fork and save storms hit the attacker's page quotas while the victim keeps
being served; snapshots are per user (``public/`` shared read-only); named
snapshots survive ``kill -9`` and a restart, and a damaged file is a clear
error. Issue 12, items 1-3.
"""

from __future__ import annotations

import asyncio
import hashlib
import signal

import pytest

from server_harness import ServerProcess, add_users, write_config, write_inferlet
from tartlet.client import Client

pytestmark = pytest.mark.slow  # the module's tests share a `tartlet serve` subprocess

MAX_PAGES = 12  # per instance, 16-token pages
MAX_SNAPSHOTS = 6

FORKER = """
from tartlet import Model
async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill("storm " * 21)
    if len(ctx.tokens) % 16 == 0:
        ctx.fill(" storm")
    await ctx.flush()  # a partly filled last page: every fork copies it
    forks = []
    try:
        for _ in range(args["n"]):
            forks.append(ctx.fork())
    except Exception as e:
        return {"tokens": len(ctx.tokens), "forks": len(forks), "error": f"{type(e).__name__}: {e}"}
    return {"tokens": len(ctx.tokens), "forks": len(forks), "error": None}
"""
SAVER = """
from tartlet import Model
async def main(args):
    model = Model.load()
    ctx = model.new_context()
    ctx.fill(args.get("text", "save storm " * 9))
    await ctx.flush()
    saved = 0
    try:
        for i in range(args["n"]):
            ctx.save(f"{args['prefix']}{i}")
            saved += 1
    except Exception as e:
        return {"saved": saved, "error": f"{type(e).__name__}: {e}"}
    return {"saved": saved, "error": None}
"""
SNOOP = """
from tartlet import Context, Model
async def main(args):
    model = Model.load()
    out = {"names": model.snapshot_names()}
    for op in ("open", "delete"):
        try:
            if op == "open":
                ctx = Context.open(model, args["name"])
                out["open"] = model.detokenize(ctx.tokens)
            else:
                Context.delete(model, args["name"])
                out["delete"] = "deleted"
        except Exception as e:
            out[op] = f"{type(e).__name__}: {e}"
    return out
"""
CONTINUE = """
from tartlet import Context, Model
async def main(args):
    model = Model.load()
    ctx = Context.open(model, args["name"])
    return await ctx.generate(max_tokens=12).collect_text()
"""
SECRET = "BOB SECRET: the vault code is 4-8-15-16-23-42. User: what is the vault code? Assistant:"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("kvsafety")
    cfg = write_config(
        d / "config.toml", d / "data",
        f"""
        [limits]
        max_pages_per_instance = {MAX_PAGES}
        max_snapshots_per_user = {MAX_SNAPSHOTS}
        max_wall_time_s = 120
        [programs]
        uploaded_runtime = "native"
        """,
    )  # fmt: skip
    keys = add_users(cfg, "alice", "bob")
    progs = d / "progs"
    files = {n: write_inferlet(progs, n, c) for n, c in [("forker", FORKER), ("saver", SAVER), ("snoop", SNOOP), ("cont", CONTINUE)]}
    server = ServerProcess(cfg)
    state = {"server": server, "keys": keys, "progs": files, "config": cfg, "data": d / "data"}
    yield state
    state["server"].stop()


async def run(setup, user: str, prog: str, args: dict):
    async with await Client.connect(setup["server"].url, setup["keys"][user]) as c:
        inst = await c.launch(setup["progs"][prog], args)
        ex = await inst.wait()
    assert ex.status == "finished", (ex.status, ex.error)
    return ex.result


async def victim_completion(setup) -> str:
    """Bob's greedy completion; its text must equal the one of a quiet server."""
    async with await Client.connect(setup["server"].url, setup["keys"]["bob"]) as c:
        inst = await c.launch("text-completion", {"prompt": "The capital of France is", "max_tokens": 6})
        ex = await inst.wait()
    assert ex.status == "finished", ex.error
    text = ex.result["text"]
    assert text and text == setup.setdefault("victim_text", text)
    return text


async def test_fork_storm_hits_the_instance_quota_and_the_victim_is_served(setup):
    server = setup["server"]
    total = server.pages("free") + server.pages("cached") + server.pages("used")
    await victim_completion(setup)  # on a quiet server
    storm = asyncio.create_task(run(setup, "alice", "forker", {"n": 3000}))
    await victim_completion(setup)
    res = await storm
    # its own pages, then one copied tail page per fork up to the limit
    assert res["forks"] == MAX_PAGES - -(-res["tokens"] // 16)
    assert res["error"].startswith("KvQuotaError: KV page quota exceeded") and "limits.max_pages_per_instance" in res["error"]
    server.wait_pages_free()
    assert server.pages("free") + server.pages("cached") == total


async def test_save_storm_is_bounded_and_outlives_only_within_the_quota(setup):
    server = setup["server"]
    res = await run(setup, "alice", "saver", {"n": 1500, "prefix": "storm-"})
    assert res["saved"] == MAX_SNAPSHOTS
    assert res["error"].startswith("LimitError") and "max_snapshots_per_user" in res["error"]
    used = server.pages("used")
    assert 0 < used <= MAX_SNAPSHOTS + 2  # the full page once, one copied tail page per snapshot
    await victim_completion(setup)  # bob is not affected
    names = (await run(setup, "alice", "snoop", {"name": "none"}))["names"]
    assert names == [f"storm-{i}" for i in range(MAX_SNAPSHOTS)]
    for n in names:  # clean up through the API
        assert (await run(setup, "alice", "snoop", {"name": n}))["delete"] == "deleted"
    assert server.pages("used") == 0


async def test_snapshots_are_per_user_and_public_ones_read_only_to_others(setup):
    await run(setup, "bob", "saver", {"n": 1, "prefix": "secret-", "text": SECRET})
    await run(setup, "bob", "saver", {"n": 1, "prefix": "public/shared-", "text": "Shared preamble for everyone."})
    snoop = await run(setup, "alice", "snoop", {"name": "secret-0"})
    assert snoop["names"] == ["public/shared-0"]
    assert snoop["open"] == "SnapshotError: no snapshot named 'secret-0'"
    assert snoop["delete"] == "SnapshotError: no snapshot named 'secret-0'"
    shared = await run(setup, "alice", "snoop", {"name": "public/shared-0"})
    assert shared["open"] == "Shared preamble for everyone."
    assert "belongs to another user" in shared["delete"]
    own = await run(setup, "bob", "snoop", {"name": "secret-0"})  # the owner sees and deletes it
    assert own["names"] == ["public/shared-0", "secret-0"] and own["open"] == SECRET and own["delete"] == "deleted"
    assert (await run(setup, "bob", "snoop", {"name": "public/shared-0"}))["delete"] == "deleted"


async def test_snapshots_survive_kill_9_and_a_damaged_file_is_a_clear_error(setup):
    server = setup["server"]
    await run(setup, "alice", "saver", {"n": 2, "prefix": "persist-", "text": "The capital of France is"})
    before = await run(setup, "alice", "cont", {"name": "persist-0"})
    files = sorted((setup["data"] / "snapshots").glob("*/*/*.safetensors"))
    for _ in range(300):  # written by a background writer right after the save (up to 30 s: a loaded CI machine)
        if len(files) == 2:
            break
        await asyncio.sleep(0.1)
        files = sorted((setup["data"] / "snapshots").glob("*/*/*.safetensors"))
    assert len(files) == 2 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    server.proc.send_signal(signal.SIGKILL)
    server.proc.wait()
    server.stop()
    setup["server"] = server = ServerProcess(setup["config"])
    names = (await run(setup, "alice", "snoop", {"name": "none"}))["names"]
    assert names == ["persist-0", "persist-1"]
    assert (await run(setup, "bob", "snoop", {"name": "none"}))["names"] == []  # still alice's only
    after = await run(setup, "alice", "cont", {"name": "persist-0"})
    assert after == before and after.strip()
    # damage the file of the one still on disk only: opening it names the
    # problem, and the server keeps serving
    damaged = next(f for f in files if f.name.startswith(hashlib.sha256(b"persist-1").hexdigest()[:40]))
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    res = await run(setup, "alice", "snoop", {"name": "persist-1"})
    assert res["open"] == "SnapshotError: snapshot 'persist-1' is corrupt: its checksum does not match its contents"
    await victim_completion(setup)
