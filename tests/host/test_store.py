"""The key-value store: SQLite semantics, per-user scoping, and values
surviving a restart of the server (run in-process: the store file is closed
and opened again as `tartlet serve` does; test_server_kv_safety.py restarts
a real process after kill -9)."""

from __future__ import annotations

import pytest

from server_harness import InProcessServer, cli_in_process, write_config, write_inferlet
from tartlet.client import Client
from tartlet.host.store import Store, StoreError

STORE = """
from tartlet.sdk import store
async def main(args):
    if args.get("set"):
        for k, v in args["set"].items():
            store.set(k, v)
    if args.get("delete"):
        store.delete(args["delete"])
    return {"keys": store.keys(args.get("prefix", "")), "value": store.get(args.get("get", "none"), "missing")}
"""


def test_store_semantics(tmp_path):
    s = Store(tmp_path / "kv.sqlite")
    s.set("alice", "a/1", "x")
    s.set("alice", "a/2", "y")
    s.set("alice", "b", "z")
    s.set("bob", "a/1", "bob's")
    assert s.get("alice", "a/1") == "x" and s.get("bob", "a/1") == "bob's" and s.get("carol", "a/1") is None
    assert s.keys("alice", "a/") == ["a/1", "a/2"] and s.keys("bob") == ["a/1"]
    s.set("alice", "a/1", "x2")
    assert s.get("alice", "a/1") == "x2"
    assert s.delete("alice", "a/1") and not s.delete("alice", "a/1")
    for bad in [("", "v"), ("k" * 2000, "v"), ("k", 3), ("k", "v" * (2**20 + 1))]:
        with pytest.raises(StoreError):
            s.set("alice", *bad)
    s.close()
    s2 = Store(tmp_path / "kv.sqlite")
    assert s2.keys("alice") == ["a/2", "b"]
    s2.close()


@pytest.mark.slow  # two server starts, each loading the model
async def test_store_survives_server_restart_and_is_per_user(tmp_path):
    cfg = write_config(tmp_path / "config.toml", tmp_path / "data")
    keys = {u: cli_in_process("auth", "add", u, "--config", str(cfg)).stdout.strip() for u in ("alice", "bob")}
    prog = write_inferlet(tmp_path / "progs", "kv", STORE)

    async def run(server, user, args):
        async with await Client.connect(server.url, keys[user]) as c:
            ex = await (await c.launch(prog, args)).wait()
        assert ex.ok, ex.error
        return ex.result

    server = InProcessServer(cfg)
    try:
        r = await run(server, "alice", {"set": {"notes/1": "first", "notes/2": "second", "tmp": "x"}, "get": "notes/1"})
        assert r == {"keys": ["notes/1", "notes/2", "tmp"], "value": "first"}
        await run(server, "alice", {"delete": "tmp"})
        assert (await run(server, "bob", {"get": "notes/1"})) == {"keys": [], "value": "missing"}
    finally:
        server.stop()
    server = InProcessServer(cfg)
    try:
        r = await run(server, "alice", {"prefix": "notes/", "get": "notes/2"})
        assert r == {"keys": ["notes/1", "notes/2"], "value": "second"}
        assert (await run(server, "bob", {})) == {"keys": [], "value": "missing"}
    finally:
        server.stop()
