"""`tartlet serve` as a real process on loopback, driven by the client
library and the CLI: launch, stream, session I/O, abort, list, messaging,
child inferlets, HTTP from inferlets, auth, limits, disconnects, bad input.

One server (auth on, two users, small limits) is shared by the module.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import threading

import pytest
import websockets

from server_harness import ServerProcess, add_users, cli, cli_in_process, write_config, write_inferlet
from tartlet.client import Client, TartletError

pytestmark = pytest.mark.slow  # the module's tests share a `tartlet serve` subprocess

MAX_PAGES = 24  # 16-token pages: 384 tokens per instance
MAX_INSTANCES = 3

ECHO = """
from tartlet.sdk import session
async def main(args):
    n = 0
    while True:
        try:
            msg = await session.receive()
        except EOFError:
            return {"count": n}
        n += 1
        session.send(msg.upper())
"""
WAITER = """
from tartlet.sdk import session
async def main(args):
    session.send("waiting")
    return await session.receive()
"""
#: Sends its first part at once and the rest when a client says "go": what
#: a later connection gets does not depend on when the server notices the
#: first one went away (a message sent to a connection in that window is
#: lost with it: output is kept only while no client is attached).
PARTS = """
from tartlet.sdk import session
async def main(args):
    parts = [f"part {i}; " for i in range(1, 6)]
    session.send(parts[0])
    await session.receive()
    for p in parts[1:]:
        session.send(p)
    return {"text": "".join(parts)}
"""
CONSUMER = """
from tartlet.sdk import messaging
async def main(args):
    return [await messaging.pull(args["topic"]) for _ in range(args["n"])]
"""
PRODUCER = """
from tartlet.sdk import messaging
async def main(args):
    for m in args["msgs"]:
        messaging.push(args["topic"], m)
"""
SUBSCRIBER = """
from tartlet.sdk import messaging
async def main(args):
    with messaging.subscribe(args["topic"]) as sub:
        messaging.push(args["ready"], "ok")
        return [await sub.next() for _ in range(args["n"])]
"""
BROADCASTER = """
from tartlet.sdk import messaging
async def main(args):
    for _ in range(args["subscribers"]):
        await messaging.pull(args["ready"])
    return [messaging.broadcast(args["topic"], m) for m in args["msgs"]]
"""
PARENT = """
from tartlet.sdk import children
async def main(args):
    child = children.launch("text-completion", {"prompt": args["prompt"], "max_tokens": args["max_tokens"]})
    result = await child.wait()
    stuck = children.launch("waiter", {})
    stuck.cancel()
    ended = await stuck.join()
    return {"text": result["text"], "child_id": child.id, "cancelled": ended.status}
"""
FETCHER = """
from tartlet.sdk import http
async def main(args):
    r = await http.fetch(args["url"], method="POST", headers={"x-test": "yes"}, body="ping")
    try:
        await http.fetch("http://example.invalid/")
        refused = None
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    return {"status": r.status, "body": r.text(), "refused": refused}
"""
HOG = """
from tartlet import Model
async def main(args):
    model = Model.load()
    with model.new_context() as ctx:
        ctx.fill("one two three four five six seven eight " * 80)
        await ctx.flush()
        return "not reached"
"""


class _Tools(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["content-length"]))
        reply = json.dumps({"got": body.decode(), "header": self.headers.get("x-test")}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture(scope="module")
def tools_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Tools)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("server")
    cfg = write_config(
        d / "config.toml", d / "data",
        f"""
        [limits]
        max_pages_per_instance = {MAX_PAGES}
        max_instances_per_user = {MAX_INSTANCES}
        max_wall_time_s = 120
        [http]
        allow_hosts = ["127.0.0.1:*"]
        [programs]
        uploaded_runtime = "native"  # uploads sandboxed by default: tests/server/test_server_sandbox.py
        """,
    )
    keys = add_users(cfg, "alice", "bob")
    progs = d / "progs"
    for name, code in [("echo", ECHO), ("waiter", WAITER), ("parts", PARTS), ("consumer", CONSUMER), ("producer", PRODUCER),
                       ("subscriber", SUBSCRIBER), ("broadcaster", BROADCASTER), ("parent", PARENT),
                       ("fetcher", FETCHER), ("hog", HOG)]:
        write_inferlet(progs, name, code)
    r = cli_in_process("install", str(progs / "waiter.py"), "--config", str(cfg))  # launchable by name
    assert r.returncode == 0, r.stderr
    server = ServerProcess(cfg)
    yield {"server": server, "keys": keys, "progs": progs, "config": cfg}
    server.stop()


@pytest.fixture
def server(setup):
    yield setup["server"]
    setup["server"].wait_pages_free()


async def connect(setup, user: str = "alice") -> Client:
    return await Client.connect(setup["server"].url, setup["keys"][user])


async def test_auth_keys_are_listed_and_invalid_keys_refused(setup, server):
    r = cli("auth", "list", "--config", str(setup["config"]))
    assert "alice" in r.stdout and "bob" in r.stdout and setup["keys"]["alice"] not in r.stdout
    for key in (None, "tk_not_a_key"):
        with pytest.raises(TartletError) as e:
            await Client.connect(server.url, key)
        assert e.value.code == "unauthorized"
    ws = await websockets.connect(server.url.replace("http", "ws") + "/ws")  # raw: an error, then close 4401
    assert json.loads(await ws.recv())["code"] == "unauthorized"
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await ws.recv()
    assert closed.value.rcvd.code == 4401
    assert server.get("/v1/models").status_code == 401


async def test_launch_streams_output_and_result(setup, server):
    async with await connect(setup) as c:
        inst = await c.launch("text-completion", {"prompt": "What is the capital of France?", "max_tokens": 16})
        chunks = [m async for m in inst.output()]
        assert inst.exit.ok, inst.exit
        assert len(chunks) >= 2 and "".join(chunks) == inst.exit.result["text"]
        assert "Paris" in inst.exit.result["text"]
        listed = {i["id"]: i for i in await c.list()}
        assert listed[inst.id]["status"] == "finished" and listed[inst.id]["program"] == "text-completion"


async def test_session_send_and_receive(setup, server):
    async with await connect(setup) as c:
        inst = await c.launch(setup["progs"] / "echo.py")  # uploaded, content-hashed
        await inst.send("hello")
        assert await inst.recv() == "HELLO"
        await inst.send("again")
        assert await inst.recv() == "AGAIN"
        await inst.close_input()
        ex = await inst.wait()
        assert ex.ok and ex.result == {"count": 2}
        h1 = await c.upload(setup["progs"] / "echo.py")
        assert h1 == await c.upload(setup["progs"] / "echo.py") and h1.startswith("sha256:")


async def test_abort_and_list(setup, server):
    async with await connect(setup) as c:
        inst = await c.launch("waiter")
        assert await inst.recv() == "waiting"
        assert any(i["id"] == inst.id and i["status"] == "running" for i in await c.list())
        await c.abort(inst.id)
        ex = await inst.wait()
        assert ex.status == "aborted" and "alice" in ex.error


async def test_messaging_queue_and_broadcast(setup, server):
    p = setup["progs"]
    async with await connect(setup) as c:
        # queue: two consumers, two messages, each message to exactly one
        cons = [await c.launch(p / "consumer.py", {"topic": "jobs", "n": 1}) for _ in range(2)]
        prod = await c.launch(p / "producer.py", {"topic": "jobs", "msgs": ["a", "b"]})
        assert (await prod.wait()).ok
        got = [(await x.wait()).result for x in cons]
        assert sorted(m for r in got for m in r) == ["a", "b"]
        # broadcast: every subscriber gets every message
        subs = [await c.launch(p / "subscriber.py", {"topic": "news", "ready": "ready", "n": 2}) for _ in range(2)]
        b = await c.launch(p / "broadcaster.py", {"topic": "news", "ready": "ready", "subscribers": 2, "msgs": ["x", "y"]})
        bx = await b.wait()
        assert bx.ok and bx.result == [2, 2]
        for s in subs:
            ex = await s.wait()
            assert ex.ok and ex.result == ["x", "y"]


async def test_child_inferlet_launched_awaited_and_cancelled(setup, server):
    args = {"prompt": "Name a colour.", "max_tokens": 12}
    async with await connect(setup) as c:
        direct = await (await c.launch("text-completion", args)).wait()
        ex = await (await c.launch(setup["progs"] / "parent.py", args)).wait()
        assert ex.ok, ex.error
        assert ex.result["text"] == direct.result["text"]
        assert ex.result["cancelled"] == "aborted"
        child = {i["id"]: i for i in await c.list()}[ex.result["child_id"]]
        assert child["status"] == "finished" and child["program"] == "text-completion"


async def test_http_fetch_from_inferlet(setup, server, tools_server):
    async with await connect(setup) as c:
        ex = await (await c.launch(setup["progs"] / "fetcher.py", {"url": tools_server + "/tool"})).wait()
        assert ex.ok, ex.error
        assert ex.result["status"] == 200
        assert json.loads(ex.result["body"]) == {"got": "ping", "header": "yes"}
        assert "HttpError" in ex.result["refused"] and "allowlist" in ex.result["refused"]


async def test_users_see_and_control_only_their_instances(setup, server):
    async with await connect(setup, "alice") as a, await connect(setup, "bob") as b:
        inst = await a.launch("waiter")
        assert await inst.recv() == "waiting"
        assert inst.id not in {i["id"] for i in await b.list()}
        for op in (b.abort(inst.id), b.attach(inst.id)):
            with pytest.raises(TartletError) as e:
                await op
            assert e.value.code == "not_found"
        await inst.send("bye")
        assert (await inst.wait()).result == "bye"


async def test_limits_end_only_the_offender(setup, server):
    async with await connect(setup, "alice") as a, await connect(setup, "bob") as b:
        # per-user concurrent instances
        waiters = [await a.launch("waiter") for _ in range(MAX_INSTANCES)]
        with pytest.raises(TartletError) as e:
            await a.launch("waiter")
        assert e.value.code == "limit" and "max_instances_per_user" in e.value.message
        other = await b.launch("waiter")  # bob is not affected
        # max pages: the hog fails with a clear error, its pages are freed
        hog = await b.launch(setup["progs"] / "hog.py")
        ex = await hog.wait()
        assert ex.status == "failed" and "page limit" in ex.error and str(MAX_PAGES) in ex.error
        # wall time
        slow = await b.launch("waiter", time_limit_s=0.5)
        ex = await slow.wait()
        assert ex.status == "failed" and "time limit" in ex.error
        # everyone else kept running
        for w in waiters + [other]:
            assert await w.recv() == "waiting"
            await w.send("done")
            assert (await w.wait()).result == "done"


async def test_disconnect_policy(setup, server):
    # default: the instance keeps running; a new connection attaches and gets the rest
    c1 = await connect(setup)
    inst = await c1.launch(setup["progs"] / "parts.py")
    first = await inst.recv()
    await c1.close()
    async with await connect(setup) as c2:
        again = await c2.attach(inst.id)
        await again.send("go")
        rest = [m async for m in again.output()]
        assert again.exit.ok
        assert first == "part 1; " and first + "".join(rest) == again.exit.result["text"]
    # abort_on_disconnect: the instance dies with its connection
    c3 = await connect(setup)
    w = await c3.launch("waiter", abort_on_disconnect=True)
    assert await w.recv() == "waiting"
    await c3.close()
    async with await connect(setup) as c4:
        for _ in range(100):
            st = {i["id"]: i for i in await c4.list()}[w.id]
            if st["status"] != "running":
                break
            await asyncio.sleep(0.05)
        assert st["status"] == "aborted" and "disconnected" in st["error"]


async def test_bad_input_gets_clear_errors(setup, server):
    async with await connect(setup) as c:
        with pytest.raises(TartletError) as e:
            await c.launch("no-such-inferlet")
        assert e.value.code == "not_found" and "text-completion" in e.value.message
        with pytest.raises(TartletError) as e:
            await c.launch("../etc/passwd")
        assert e.value.code == "not_found"
        with pytest.raises(TartletError) as e:
            await c._request({"type": "launch", "inferlet": "text-completion", "args": [1, 2]})
        assert e.value.code == "bad_request" and "JSON object" in e.value.message
        with pytest.raises(TartletError) as e:
            await c._request({"type": "frobnicate"})
        assert e.value.code == "bad_request"
        await c.ws.send("{not json")
        await c.ws.send(json.dumps({"type": "upload", "files": {"../x.py": "pass", "main.py": "pass"}}))
        with pytest.raises(TartletError) as e:
            await c._request({"type": "upload", "files": {"/abs.py": "x"}})
        assert "unsafe path" in e.value.message
        assert (await c.ping())["user"] == "alice"  # the connection survived
        assert any("malformed JSON" in str(err) for err in c.errors)
        # a failing inferlet reports its error, the server keeps serving
        inst = await c.launch("text-completion", {"prompt": ""})
        ex = await inst.wait()
        assert ex.status == "failed" and "prompt" in ex.error


async def test_cli_submit_ping_list_abort(setup, server):
    env = {"TARTLET_SERVER": server.url, "TARTLET_API_KEY": setup["keys"]["alice"]}
    r = cli("ping", env=env)
    assert r.returncode == 0 and "alice" in r.stdout
    r = cli("submit", "text-completion", "--json", "--", "--prompt", "What is the capital of France?", "--max-tokens", "8", env=env)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["text"] and result["text"] in r.stdout
    r = cli("submit", "text-completion", "--", "--prompt", "", env=env)
    assert r.returncode == 1 and "failed" in r.stderr
    r = cli("submit", "waiter", "--detach", env=env)
    iid = r.stdout.strip()
    r = cli("list", "--json", env=env)
    assert any(i["id"] == iid and i["status"] == "running" for i in json.loads(r.stdout))
    assert cli("abort", iid, env=env).returncode == 0
    r = cli("attach", iid, env=env)
    assert r.returncode == 1 and "aborted" in r.stderr
    r = cli("ping", env={**env, "TARTLET_API_KEY": "tk_wrong"})
    assert r.returncode == 2 and "invalid API key" in r.stderr


async def test_health_and_metrics(setup, server):
    async with await connect(setup) as c:
        assert (await (await c.launch("text-completion", {"prompt": "Hi", "max_tokens": 4})).wait()).ok
    h = server.get("/health").json()
    assert h["status"] == "ok" and h["models"] == ["smollm2-135m-instruct"] and h["auth"] is True
    text = server.get("/metrics").text
    for name in ("tartlet_tokens_generated_total", "tartlet_batch_size_bucket", "tartlet_kv_pages",
                 "tartlet_running_instances", "tartlet_queue_wait_seconds_total"):
        assert name in text
    generated = float(next(ln for ln in text.splitlines() if ln.startswith("tartlet_tokens_generated_total")).split()[-1])
    assert generated > 0


async def test_chat_inferlet_multi_turn_over_the_session(setup, server):
    async with await connect(setup) as c:
        inst = await c.launch("chat", {"interactive": True, "max_tokens": 12})
        await inst.send("My name is Ada.")
        await inst.send("What is my name?")
        await inst.close_input()
        out = "".join([m async for m in inst.output()])
        assert inst.exit.ok, inst.exit.error
        replies = inst.exit.result["replies"]
        assert len(replies) == 2 and out == "".join(r + "\n" for r in replies)
