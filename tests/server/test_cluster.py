"""``tartlet serve --replicas 2`` on a real local Ray instance (started by the
server itself) with the store, API keys and messaging in a real PostgreSQL
(tests/pg_harness.py) and one shared snapshot folder.

The server runs as a subprocess in its own session; it is stopped with
SIGTERM (it deletes the Ray Serve application and shuts down the Ray
instance it started), and whatever is left of its process group is killed
by that group's id.

Tests pin a client to a replica with the ``x-tartlet-replica`` request
header (a WebSocket connection's home replica, or one HTTP request).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap
import time
from pathlib import Path

import httpx
import pytest

from server_harness import ServerProcess, add_users

pytestmark = pytest.mark.slow

PROBE = Path(__file__).parents[1] / "cluster_probe.py"


class ClusterProcess(ServerProcess):
    """``tartlet serve --replicas 2 --port 0`` (the config's ``[cluster]``) in
    a session of its own: SIGTERM, then the group's leftovers killed."""

    def __init__(self, config: Path) -> None:
        super().__init__(config, new_session=True, env={"RAY_ADDRESS": "", "RAY_USAGE_STATS_ENABLED": "0"}, start_timeout=400, stop_timeout=120)

    def health(self) -> dict:
        r = httpx.get(self.url + "/health", timeout=60)
        return r.json()

    def wait_replicas(self, n: int, timeout: float = 240, exclude: frozenset[str] = frozenset()) -> list[dict]:
        """Wait until ``n`` replicas (none of ``exclude``) answer /health ok."""
        deadline = time.time() + timeout
        h: dict = {}
        while time.time() < deadline:
            h = self.health()
            ok = [r for r in h["replicas"] if r.get("status") == "ok" and r["replica"] not in exclude]
            if len(ok) >= n:
                return ok
            time.sleep(1)
        raise AssertionError(f"not {n} replicas up: {h}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, postgres):
    tmp = tmp_path_factory.mktemp("cluster")
    url = postgres.new_database()
    config = tmp / "server.toml"
    config.write_text(
        f'data_dir = "{tmp / "data"}"\n'
        + textwrap.dedent(f"""
        [store]
        url = "{url}"
        [snapshots]
        dir = "{tmp / "shared-snapshots"}"
        [adapters]
        dir = "{tmp / "shared-adapters"}"
        [programs]
        uploaded_runtime = "native"
        [cluster]
        replicas = 2
        threads_per_replica = 1
        [[models]]
        model = "smollm2-135m-instruct"
        kv_cache_mb = 64
        """)
    )  # fmt: skip
    keys = add_users(config, "alice", "bob")
    server = ClusterProcess(config)
    try:
        server.keys = keys
        server.config = config
        server.replicas = [r["replica"] for r in server.wait_replicas(2)]
        yield server
    finally:
        server.stop()


async def _client(cluster, user="alice", replica=None):
    import websockets

    from tartlet.client import Client
    from tartlet.client.client import ws_url

    headers = {"Authorization": f"Bearer {cluster.keys[user]}"}
    if replica:
        headers["x-tartlet-replica"] = replica
    ws = await websockets.connect(ws_url(cluster.url), additional_headers=headers, max_size=2**26, open_timeout=60)
    c = Client(ws)
    await c.ping()
    return c


async def _run(client, args: dict) -> dict:
    inst = await client.launch(PROBE, args)
    exit = await inst.wait()
    assert exit.ok, exit
    return exit.result


def test_both_replicas_answer_openai_requests(cluster):
    from openai import OpenAI

    seen = {}
    for replica in cluster.replicas:
        r = httpx.post(
            cluster.url + "/v1/chat/completions", timeout=120,
            headers={"Authorization": f"Bearer {cluster.keys['alice']}", "x-tartlet-replica": replica},
            json={"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        seen[r.headers["x-tartlet-replica"]] = r.json()["choices"][0]["message"]["content"]
    assert set(seen) == set(cluster.replicas)
    assert len(set(seen.values())) == 1  # the same model, greedy: the same answer on both
    # unpinned, concurrent: the router spreads them (load first)
    client = OpenAI(base_url=cluster.url + "/v1", api_key=cluster.keys["alice"])

    async def one(i: int) -> str:
        r = await asyncio.to_thread(
            client.chat.completions.with_raw_response.create, model="smollm2-135m-instruct",
            messages=[{"role": "user", "content": f"Count to {i}."}], max_tokens=24,
        )  # fmt: skip
        return r.headers["x-tartlet-replica"]

    async def many() -> list[str]:
        return await asyncio.gather(*(one(i) for i in range(6)))

    used = asyncio.run(many())
    assert set(used) == set(cluster.replicas), used


def test_session_instances_stay_on_its_replica_and_list_sees_all(cluster):
    async def go():
        a = await _client(cluster, replica=cluster.replicas[0])
        b = await _client(cluster)
        try:
            ids_a = [(await a.launch(PROBE, {"op": "set", "key": f"k{i}", "value": "v"})).id for i in range(3)]
            ids_b = [(await b.launch(PROBE, {"op": "set", "key": "kb", "value": "v"})).id]
            assert {i.split("-")[0] for i in ids_a} == {cluster.replicas[0]}
            listed = {i["id"] for i in await b.list()}  # every replica's instances of this user
            assert set(ids_a) | set(ids_b) <= listed
            # attach from another connection reaches the instance on its replica
            inst = await b.attach(ids_a[0])
            assert (await inst.wait()).status == "finished"
            from tartlet.client import TartletError

            with pytest.raises(TartletError) as e:  # an id no replica ever had
                await b.attach("nosuchreplica-0123456789ab")
            assert e.value.code == "not_found"
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_snapshot_saved_on_one_replica_opens_on_the_other(cluster):
    r0, r1 = cluster.replicas

    async def go():
        a = await _client(cluster, replica=r0)
        b = await _client(cluster, replica=r1)
        try:
            saved = await _run(a, {"op": "save", "name": "shared-snap", "prompt": "The three primary colours are", "n": 8})
            opened_here = await _run(a, {"op": "open", "name": "shared-snap", "n": 8})
            opened_there = await _run(b, {"op": "open", "name": "shared-snap", "n": 8})
            assert saved["tokens"] == opened_here["tokens"] == opened_there["tokens"]
            assert len(saved["tokens"]) == 8
            # another user cannot open it on either replica
            c = await _client(cluster, user="bob", replica=r1)
            try:
                inst = await c.launch(PROBE, {"op": "open", "name": "shared-snap"})
                exit = await inst.wait()
                assert exit.status == "failed" and "shared-snap" in (exit.error or "")
            finally:
                await c.close()
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_adapter_uploaded_on_one_replica_serves_on_the_other(cluster, gguf_path, hf_model, hf_tokenizer):
    """A LoRA adapter uploaded through one replica runs `BASE:NAME` requests
    on the other; removed through that one, it is gone on the first."""
    from lora_reference import lora_adapter

    folder = lora_adapter(gguf_path, hf_model, hf_tokenizer, "paris-is-pie")
    r0, r1 = cluster.replicas

    def chat(replica: str, user: str = "alice") -> httpx.Response:
        return httpx.post(
            cluster.url + "/v1/chat/completions", timeout=120,
            headers={"Authorization": f"Bearer {cluster.keys[user]}", "x-tartlet-replica": replica},
            json={"model": "smollm2-135m-instruct:pie", "max_tokens": 8,
                  "messages": [{"role": "user", "content": "What is the capital of France?"}]},
        )  # fmt: skip

    async def go():
        a = await _client(cluster, replica=r0)
        try:
            await a.add_adapter("pie", folder)
        finally:
            await a.close()
        there, here = chat(r1), chat(r0)
        assert there.status_code == 200 == here.status_code, there.text
        assert there.headers["x-tartlet-replica"] == r1
        assert there.json()["choices"][0]["message"] == here.json()["choices"][0]["message"]
        assert chat(r1, user="bob").status_code == 404  # alice's, on every replica
        b = await _client(cluster, replica=r1)
        try:
            assert [x["name"] for x in await b.list_adapters() if x["owner"] == "user"] == ["pie"]
            await b.remove_adapter("pie")
        finally:
            await b.close()
        gone = chat(r0)
        assert gone.status_code == 404 and "pie" in gone.text

    asyncio.run(go())


def test_store_written_on_one_replica_is_read_on_the_other(cluster):
    r0, r1 = cluster.replicas

    async def go():
        a = await _client(cluster, replica=r0)
        b = await _client(cluster, replica=r1)
        bob = await _client(cluster, user="bob", replica=r1)
        try:
            await _run(a, {"op": "set", "key": "greeting", "value": "hello from " + r0})
            assert (await _run(b, {"op": "get", "key": "greeting"}))["value"] == "hello from " + r0
            assert (await _run(bob, {"op": "get", "key": "greeting"}))["value"] is None  # per-user scope
        finally:
            for c in (a, b, bob):
                await c.close()

    asyncio.run(go())


def test_message_crosses_replicas(cluster):
    r0, r1 = cluster.replicas

    async def go():
        a = await _client(cluster, replica=r0)
        b = await _client(cluster, replica=r1)
        try:
            puller = await a.launch(PROBE, {"op": "pull", "topic": "cross"})
            await asyncio.sleep(0.5)
            await _run(b, {"op": "push", "topic": "cross", "msg": "over the wire"})
            exit = await asyncio.wait_for(puller.wait(), 60)
            assert exit.ok and exit.result == {"msg": "over the wire"}
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())


def test_keys_added_later_work_on_every_replica(cluster):
    from server_harness import cli_in_process

    r = cli_in_process("auth", "add", "carol", "--config", str(cluster.config))
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    for replica in cluster.replicas:
        resp = httpx.get(cluster.url + "/v1/models", headers={"Authorization": f"Bearer {key}", "x-tartlet-replica": replica}, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-tartlet-replica"] == replica
    bad = httpx.get(cluster.url + "/v1/models", headers={"Authorization": "Bearer tk_nope"}, timeout=60)
    assert bad.status_code == 401


def test_gateway_errors_are_clean(cluster):
    auth = {"Authorization": f"Bearer {cluster.keys['alice']}"}
    gone = httpx.get(cluster.url + "/v1/models", headers={**auth, "x-tartlet-replica": "nosuchreplica"}, timeout=60)
    assert gone.status_code == 503 and gone.json()["error"]["code"] == "replica_lost"
    big = httpx.post(cluster.url + "/v1/completions", headers=auth, content=b"x" * (8 * 2**20 + 1), timeout=60)
    assert big.status_code == 413 and big.json()["error"]["code"] == "too_large"
    bad = httpx.post(cluster.url + "/v1/chat/completions", headers=auth, content=b"{not json", timeout=60)
    assert bad.status_code == 400 and "x-tartlet-replica" in bad.headers  # a replica answered

    async def unauthorized():
        import websockets

        from tartlet.client import Client, TartletError

        with pytest.raises(TartletError) as e:
            await Client.connect(cluster.url, key="tk_wrong")
        assert e.value.code == "unauthorized"
        with pytest.raises((TartletError, websockets.ConnectionClosed, ConnectionError)):
            await Client.connect(cluster.url)  # no key at all

    asyncio.run(unauthorized())


def test_metrics_are_per_replica_and_merged(cluster):
    merged = httpx.get(cluster.url + "/metrics", timeout=60).text
    for replica in cluster.replicas:
        assert f'replica="{replica}"' in merged
        one = httpx.get(cluster.url + f"/metrics?replica={replica}", timeout=60)
        assert one.status_code == 200 and "tartlet_tokens_generated_total" in one.text


def test_ray_serves_controller_runs_at_the_launchers_loop_period(cluster):
    # its reconcile loop took 2.6% of a core at Ray's default 0.1 s, CPU the
    # replicas' engines want on a small machine (launcher.CONTROL_LOOP_INTERVAL_S)
    from tartlet.cluster.launcher import CONTROL_LOOP_INTERVAL_S

    found = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "cmdline").read_bytes().startswith(b"ray::ServeController"):
                env = dict(kv.split(b"=", 1) for kv in (d / "environ").read_bytes().split(b"\0") if b"=" in kv)
                found.append(env.get(b"RAY_SERVE_CONTROL_LOOP_INTERVAL_S"))
        except OSError:
            continue
    assert CONTROL_LOOP_INTERVAL_S.encode() in found, found


def test_a_killed_replica_fails_its_clients_others_finish_and_it_comes_back(cluster):
    """Last in this module: it replaces a replica."""
    health = {r["replica"]: r for r in cluster.wait_replicas(2)}
    victim, survivor = cluster.replicas

    async def go():
        a = await _client(cluster, replica=victim)
        b = await _client(cluster, replica=survivor)
        try:
            await _run(a, {"op": "save", "name": "before-kill", "prompt": "Snapshots outlive", "n": 4})
            await _run(a, {"op": "set", "key": "before-kill", "value": "kept"})
            doomed = await a.launch(PROBE, {"op": "long", "n": 400})
            fine = await b.launch(PROBE, {"op": "long", "n": 60})
            await doomed.recv()  # it runs
            os.kill(health[victim]["pid"], signal.SIGKILL)
            # calls pinned to the dead replica fail at once; they do not hang the gateway
            gone = await asyncio.to_thread(httpx.get, cluster.url + f"/metrics?replica={victim}", timeout=60)
            assert gone.status_code in (404, 503), gone.text
            assert (await asyncio.to_thread(cluster.health))["status"] in ("ok", "degraded")
            exit = await asyncio.wait_for(doomed.wait(), 120)
            assert exit.status == "failed" and exit.error.startswith("replica_lost"), exit
            ok = await asyncio.wait_for(fine.wait(), 300)
            assert ok.ok and ok.result["n"] == 60
            # new work on the same connection goes to a live replica
            done = await _run(a, {"op": "get", "key": "nothing"})
            assert done == {"value": None}
        finally:
            await a.close()
            await b.close()

    asyncio.run(go())
    back = cluster.wait_replicas(2, exclude=frozenset({victim}))
    assert survivor in {r["replica"] for r in back}
    new = [r["replica"] for r in back if r["replica"] != survivor][0]

    async def after():  # what was written before the kill is intact, read on the new replica
        c = await _client(cluster, replica=new)
        try:
            assert len((await _run(c, {"op": "open", "name": "before-kill", "n": 4}))["tokens"]) == 4
            assert (await _run(c, {"op": "get", "key": "before-kill"}))["value"] == "kept"
        finally:
            await c.close()

    asyncio.run(after())
    body = json.dumps(cluster.health())
    assert '"status": "ok"' in body
