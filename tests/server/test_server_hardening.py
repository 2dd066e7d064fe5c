"""A hostile user against a real `tartlet serve` (auth on, two users): every
attack gets a clear error naming the limit or the field, the server keeps
its memory bounded, and the other user's requests still succeed.

Attacks: huge and endless session sends (attached, detached, client to
inferlet), a messaging flood (bytes and topics), manifest dependencies that
would import modules in the server, deeply nested JSON (WebSocket and
HTTP), oversized bodies, unsafe upload paths, wrong-typed request fields;
and the data dir's files are private to the server's user.
"""

from __future__ import annotations

import asyncio
import json
import stat
from pathlib import Path

import httpx
import pytest
import websockets

from server_harness import ServerProcess, add_users, cli_in_process, write_config, write_inferlet
from tartlet.client import Client, TartletError

MIB = 2**20
SESSION_MSG = 1 * MIB
BACKLOG = 4 * MIB
MESSAGING = 2 * MIB
TOPICS = 16
FRAME = 2 * MIB

SENDER = """
from tartlet.sdk import session
async def main(args):
    sent, error = 0, None
    try:
        for _ in range(args["times"]):
            session.send("x" * args["size"])
            sent += 1
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    if args.get("wait"):
        await session.receive()
    return {"sent": sent, "error": error}
"""
SILENT = """
from tartlet.sdk import session
async def main(args):
    session.send("ready")
    import asyncio
    await asyncio.sleep(3600)
"""
FLOODER = """
from tartlet.sdk import messaging
async def main(args):
    pushed, error = 0, None
    try:
        for i in range(args["times"]):
            messaging.push(f"flood{i % 10}", "m" * args["size"])
            pushed += 1
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    subs, topic_error = [], None
    try:
        for i in range(args["topics"]):
            subs.append(messaging.subscribe(f"many{i}"))
    except Exception as e:
        topic_error = f"{type(e).__name__}: {e}"
    return {"pushed": pushed, "error": error, "subscribed": len(subs), "topic_error": topic_error}
"""
DRAINER = """
from tartlet.sdk import messaging
async def main(args):
    n = 0
    for i in range(10):
        for _ in range(args["per_topic"][i]):
            await messaging.pull(f"flood{i}")
            n += 1
    return n
"""
PRODUCER = """
from tartlet.sdk import messaging
async def main(args):
    messaging.push(args["topic"], args["msg"])
    return await messaging.pull(args["reply"])
"""
CONSUMER = """
from tartlet.sdk import messaging
async def main(args):
    msg = await messaging.pull(args["topic"])
    messaging.push(args["reply"], msg.upper())
    return msg
"""
ECHO = """
from tartlet.sdk import session
async def main(args):
    return (await session.receive()).upper()
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening")
    data = d / "data"
    cfg = write_config(
        d / "config.toml", data,
        f"""
        [limits]
        max_instances_per_user = 8
        max_wall_time_s = 300
        max_message_bytes = {FRAME}
        max_session_message_bytes = {SESSION_MSG}
        max_backlog_bytes = {BACKLOG}
        max_messaging_bytes_per_user = {MESSAGING}
        max_topics_per_user = {TOPICS}
        """,
    )  # fmt: skip
    keys = add_users(cfg, "alice", "bob")
    progs = d / "progs"
    for name, code in [("sender", SENDER), ("silent", SILENT), ("flooder", FLOODER), ("drainer", DRAINER),
                       ("producer", PRODUCER), ("consumer", CONSUMER), ("echo", ECHO)]:
        r = cli_in_process("install", str(write_inferlet(progs, name, code)), "--config", str(cfg))  # native, by name
        assert r.returncode == 0, r.stderr
    server = ServerProcess(cfg)
    yield {"server": server, "keys": keys, "data": data, "log": cfg.with_suffix(".stderr")}
    server.stop()


async def connect(setup, user: str) -> Client:
    return await Client.connect(setup["server"].url, setup["keys"][user])


async def victim_is_served(setup) -> None:
    """Bob's session round trip, messaging and a short generation all work."""
    async with await connect(setup, "bob") as b:
        echo = await b.launch("echo")
        await echo.send("still here")
        assert (await echo.wait()).result == "STILL HERE"
        cons = await b.launch("consumer", {"topic": "jobs", "reply": "done"})
        prod = await b.launch("producer", {"topic": "jobs", "msg": "job", "reply": "done"})
        assert (await prod.wait()).result == "JOB" and (await cons.wait()).result == "job"
        gen = await (await b.launch("text-completion", {"prompt": "Hi", "max_tokens": 3})).wait()
        assert gen.ok, gen.error


def no_server_path(setup, message: str) -> None:
    for path in (str(setup["data"]), "/tmp", str(Path(__file__).resolve().parents[2])):
        assert path not in message, message


@pytest.mark.slow
async def test_huge_session_sends_are_refused_to_the_sender(setup):
    async with await connect(setup, "alice") as a:
        # ten 100 MB sends: each refused at once, the inferlet sees LimitError naming the key
        ex = await (await a.launch("sender", {"size": 100_000_000, "times": 10})).wait()
        assert ex.ok and ex.result["sent"] == 0
        err = ex.result["error"]
        assert err.startswith("LimitError") and "max_session_message_bytes" in err and str(SESSION_MSG) in err
        # detached: output is kept up to the user's backlog budget, then the sender gets LimitError
        flood = await a.launch("sender", {"size": SESSION_MSG // 2, "times": 1000}, attach=False)
        ex = (await a.attach(flood.id))
        info = await ex.wait()
        assert info.ok and "max_backlog_bytes" in info.result["error"], info.result
        assert info.result["sent"] * SESSION_MSG // 2 <= BACKLOG
        # an ended instance's kept output is reclaimed for a running one
        first = await a.launch("sender", {"size": SESSION_MSG // 2, "times": 4}, attach=False)
        while {i["id"]: i for i in await a.list()}[first.id]["status"] == "running":
            await asyncio.sleep(0.05)
        second = await a.launch("sender", {"size": SESSION_MSG // 2, "times": 7}, attach=False)
        again = await a.attach(second.id)
        got = await again.wait()
        assert got.ok and got.result == {"sent": 7, "error": None}, got.result
        dropped = await a._request({"type": "attach", "instance": first.id})
        assert dropped["dropped"] == 4  # its output was given up for the running instance
    await victim_is_served(setup)


@pytest.mark.slow
async def test_client_sends_are_bounded(setup):
    url = setup["server"].url.replace("http", "ws") + "/ws"
    async with await connect(setup, "alice") as a:
        silent = await a.launch("silent", time_limit_s=120)
        assert await silent.recv() == "ready"
        # one message over max_session_message_bytes: too_large, the connection stays
        await a._send({"type": "send", "instance": silent.id, "data": "y" * (SESSION_MSG + 1), "id": "big"})
        await a.ping()  # a send has no reply: its error comes before the pong
        assert [(e.code, "max_session_message_bytes" in e.message) for e in a.errors] == [("too_large", True)]
        # messages the inferlet never receives: charged to alice until max_backlog_bytes
        sent = 0
        for _ in range(BACKLOG // (SESSION_MSG // 2) + 2):
            await a._send({"type": "send", "instance": silent.id, "data": "z" * (SESSION_MSG // 2), "id": "s"})
            await a.ping()
            if len(a.errors) > 1:
                break
            sent += 1
        refused = a.errors[-1]
        assert refused.code == "limit" and "max_backlog_bytes" in refused.message, refused
        assert sent == BACKLOG // (SESSION_MSG // 2)
        await a.abort(silent.id)
        await silent.wait()
        # the aborted instance's inbox is released: a new one takes messages again
        echo = await a.launch("echo")
        await echo.send("z" * (SESSION_MSG // 2))
        assert (await echo.wait()).ok
        assert (await a.ping())["user"] == "alice"
    # a frame over max_message_bytes closes only that connection (1009)
    ws = await websockets.connect(url, additional_headers={"Authorization": f"Bearer {setup['keys']['alice']}"}, max_size=None)
    await ws.send(json.dumps({"type": "ping", "pad": "p" * (FRAME + 10)}))
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await ws.recv()
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009
    await victim_is_served(setup)


@pytest.mark.slow
async def test_messaging_flood_is_bounded_per_user(setup):
    size = 256 * 1024
    async with await connect(setup, "alice") as a:
        ex = await (await a.launch("flooder", {"size": size, "times": 1000, "topics": 100})).wait()
        assert ex.ok, ex.error
        r = ex.result
        assert r["error"].startswith("LimitError") and "max_messaging_bytes_per_user" in r["error"]
        assert r["pushed"] == MESSAGING // size  # exactly what fits
        assert r["topic_error"].startswith("LimitError") and "max_topics_per_user" in r["topic_error"]
        assert r["subscribed"] == TOPICS - r["pushed"]  # each queue topic holding messages counts
        # bob's messaging is unaffected (his own budget), see victim_is_served
        await victim_is_served(setup)
        # queued messages outlive their sender (by design) until pulled; pulling frees the budget
        per_topic = [len(range(i, r["pushed"], 10)) for i in range(10)]
        drained = await (await a.launch("drainer", {"per_topic": per_topic})).wait()
        assert drained.ok and drained.result == r["pushed"]
        again = await (await a.launch("flooder", {"size": size, "times": 4, "topics": 0})).wait()
        assert again.ok and again.result["pushed"] == 4 and again.result["error"] is None
        drained = await (await a.launch("drainer", {"per_topic": [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]})).wait()
        assert drained.ok


@pytest.mark.slow
async def test_manifest_dependencies_never_import_in_the_server(setup, tmp_path):
    main = "async def main(args):\n    return 1\n"
    async with await connect(setup, "alice") as a:
        for deps, words in [
            (["this.x"], "not a top-level module name"),
            (["unittest.__main__.x"], "not a top-level module name"),
            (["../evil"], "not a top-level module name"),
            (["no_such_module_tartlet"], "not installed"),
            ("this", "list of at most"),
        ]:
            manifest = f'name = "deps"\nentry = "main.py"\ndependencies = {json.dumps(deps)}\n'
            h = (await a._request({"type": "upload", "files": {"main.py": main, "inferlet.toml": manifest}}))["program"]
            with pytest.raises(TartletError) as e:
                await a._request({"type": "launch", "program": h})
            assert e.value.code == "bad_request" and words in e.value.message, e.value.message
            no_server_path(setup, e.value.message)
        # an entry outside the upload is refused before anything is written
        with pytest.raises(TartletError) as e:
            await a._request({"type": "upload", "files": {"main.py": main, "inferlet.toml": 'entry = "../../x.py"'}})
        assert e.value.code == "bad_request" and "entry" in e.value.message
    log = setup["log"].read_text()
    assert "Beautiful is better than ugly" not in log and "unittest" not in log
    await victim_is_served(setup)


@pytest.mark.slow
async def test_nested_and_oversized_json_get_clean_errors(setup):
    srv, key = setup["server"], setup["keys"]["alice"]
    async with await connect(setup, "alice") as a:
        for frame in ("[" * 50_000, '{"a":' * 50_000, "[" * 50_000 + "]" * 50_000):
            await a.ws.send(frame)
            assert (await a.ping())["user"] == "alice"  # the connection survived
        errors = [e for e in a.errors if "max_json_depth" in str(e)]
        assert len(errors) == 3, a.errors
        with pytest.raises(TartletError) as e:  # deep args inside a valid request
            await a._request({"type": "launch", "inferlet": "echo", "args": {"x": json.loads("[" * 70 + "]" * 70)}})
        assert e.value.code == "bad_request" and "max_json_depth" in e.value.message
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    for body in ("[" * 50_000, '{"model": ' * 50_000):
        r = httpx.post(srv.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        assert "max_json_depth" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/chat/completions", content=b"{" + b" " * (FRAME + 1) + b"}", headers=headers, timeout=30)
    assert r.status_code == 413 and "max_message_bytes" in r.json()["error"]["message"]
    r = httpx.post(srv.url + "/v1/completions", content=b"\xff\xfe", headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    await victim_is_served(setup)


@pytest.mark.slow
async def test_unsafe_upload_paths_are_refused_before_writing(setup):
    uploads = setup["data"] / "uploads"
    before = sorted(p.name for p in uploads.iterdir()) if uploads.exists() else []
    ok = "async def main(args):\n    return 1\n"
    async with await connect(setup, "alice") as a:
        for files, words in [
            ({"main.py": ok, "a\0b.py": "x"}, "NUL"),
            ({"main.py": ok, "x" * 5000 + ".py": "x"}, "longer than"),
            ({"main.py": ok, "d/" + "y" * 300 + ".py": "x"}, "longer than"),
            ({"main.py": ok, "a//b.py": "x"}, "empty"),
            ({"main.py": ok, "./b.py": "x"}, "'.'"),
            ({"main.py": ok, "d/../../b.py": "x"}, "'..'"),
            ({"main.py": ok, "/etc/b.py": "x"}, "relative"),
            ({"main.py": ok, "d\\b.py": "x"}, "relative"),
            ({"main.py": ok, ".hidden": "x"}, "hidden"),
            ({"main.py": ok, "Main.py": "x"}, "clash"),
            ({"main.py": ok, "lib": "x", "lib/m.py": "x"}, "both a file and a folder"),
            ({"main.py": ok, "b.py": "\ud800"}, "Unicode"),
            ({f"m{i}.py": "" for i in range(300)} | {"main.py": ok}, "at most"),
            ({"main.py": 5}, "non-empty object"),
            ({"x.py": ok}, "main.py"),
        ]:
            with pytest.raises(TartletError) as e:
                await a._request({"type": "upload", "files": files})
            assert e.value.code == "bad_request" and words in e.value.message, (words, e.value.message)
            assert len(e.value.message) < 400
            no_server_path(setup, e.value.message)
        h = (await a._request({"type": "upload", "files": {"main.py": ok, "lib/util.py": "X = 1\n"}}))["program"]
    after = sorted(p.name for p in uploads.iterdir())
    assert not [n for n in after if n.startswith(".tmp")]  # nothing half-written left behind
    assert set(after) - set(before) == {h.split(":")[1]}
    await victim_is_served(setup)


@pytest.mark.slow
async def test_wrong_field_types_are_bad_requests_naming_the_field(setup):
    async with await connect(setup, "alice") as a:
        live = await a.launch("silent", time_limit_s=60)
        assert await live.recv() == "ready"
        for kind in ("send", "close_input", "attach", "detach", "abort"):
            for bad in ({"a": 1}, [1], 5, True, 1.5):
                with pytest.raises(TartletError) as e:
                    await a._request({"type": kind, "instance": bad, "data": "x"})
                assert e.value.code == "bad_request" and "`instance`" in e.value.message, (kind, bad, e.value.message)
        for req, field in [
            ({"type": {"launch": 1}}, "`type`"),
            ({"type": "launch", "inferlet": {"n": 1}}, "`inferlet`"),
            ({"type": "launch", "program": ["sha256:00"]}, "`program`"),
            ({"type": "launch", "inferlet": "echo", "args": [1]}, "`args`"),
            ({"type": "launch", "inferlet": "echo", "time_limit_s": "10"}, "`time_limit_s`"),
            ({"type": "launch", "inferlet": "echo", "time_limit_s": True}, "`time_limit_s`"),
            ({"type": "launch", "inferlet": "echo", "attach": "yes"}, "`attach`"),
            ({"type": "launch", "inferlet": "echo", "abort_on_disconnect": 1}, "`abort_on_disconnect`"),
            ({"type": "send", "instance": live.id, "data": {"t": 1}}, "`data`"),
            ({"type": "send", "instance": live.id, "data_b64": 7}, "`data_b64`"),
            ({"type": "launch", "program": "sha256:" + "z" * 64}, "sha256:<hex>"),
        ]:
            with pytest.raises(TartletError) as e:
                await a._request(req)
            assert e.value.code == "bad_request" and field in e.value.message, (req, e.value.message)
        await a.abort(live.id)
        await live.wait()
        assert not [e for e in a.errors if "internal" in str(e)]
    await victim_is_served(setup)


@pytest.mark.slow
async def test_data_dir_files_are_private(setup):
    data: Path = setup["data"]
    async with await connect(setup, "alice") as a:
        await a._request({"type": "upload", "files": {"main.py": "async def main(args):\n    return 2\n", "pkg/m.py": ""}})

    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(data) == 0o700
    assert mode(data / "keys.json") == 0o600
    assert mode(data / "store.sqlite") == 0o600
    uploads = data / "uploads"
    assert mode(uploads) == 0o700
    for p in uploads.rglob("*"):
        assert mode(p) == (0o700 if p.is_dir() else 0o600), p


# -- the same limits in-process (no server needed) -----------------------------------


def test_bus_bounds_bytes_and_topics_and_frees_what_a_subscription_held():
    from tartlet.host.messaging import MessageBus
    from tartlet.sdk.errors import LimitError

    bus = MessageBus(max_user_bytes=10, max_user_topics=3)
    bus.push("alice", "q", "12345")
    s1, s2 = bus.subscribe("alice", "t"), bus.subscribe("alice", "t")
    with pytest.raises(LimitError, match="max_messaging_bytes_per_user"):
        bus.broadcast("alice", "t", "abc")  # two copies of 3 bytes on top of 5: 11 > 10
    assert bus.usage("alice") == {"bytes": 5, "topics": 2}
    assert bus.broadcast("bob", "t", "abc") == 0 and bus.usage("bob") == {"bytes": 0, "topics": 0}
    pending = bus.next(s1)  # a waiting subscriber takes its copy at once: only s2's is held
    assert bus.broadcast("alice", "t", "abc") == 2 and pending.result(0) == "abc"
    assert bus.usage("alice")["bytes"] == 8
    bus.unsubscribe(s2)  # its undelivered copy is dropped
    assert bus.usage("alice")["bytes"] == 5
    bus.pull("alice", "w")  # a waiting pull keeps topic "w" alive
    with pytest.raises(LimitError, match="max_topics_per_user"):
        bus.subscribe("alice", "fourth")
    assert bus.pull("alice", "q").result(0) == "12345"  # drained: topic "q" is forgotten
    assert bus.usage("alice") == {"bytes": 0, "topics": 2}
    bus.unsubscribe(s1)
    bus.subscribe("alice", "fourth")


def test_session_inbox_and_size_limits():
    from tartlet.host.session import ByteBudget, Session
    from tartlet.sdk.errors import LimitError

    budget = ByteBudget(8, "max_backlog_bytes", "session messages waiting")
    s = Session(max_message_bytes=6, budget=budget, owner="alice")
    with pytest.raises(LimitError, match="max_session_message_bytes"):
        s.send("x" * 7)
    with pytest.raises(LimitError, match="max_session_message_bytes"):
        s.push(b"y" * 7)
    s.push("é" * 3)  # 6 bytes of UTF-8
    with pytest.raises(LimitError, match=r"max_backlog_bytes"):
        s.push("abc")
    assert s.receive().result(0) == "ééé" and budget.held("alice") == 0
    s.push("abc")
    s.end()  # the instance ended: what it never received is dropped
    assert budget.held("alice") == 0 and s.pending_bytes() == 0
    with pytest.raises(EOFError):
        s.receive().result(0)


async def test_builds_are_counted_per_user_and_as_instances(monkeypatch, tmp_path):
    import threading

    from tartlet.host.state import HostState
    from tartlet.protocol import ProtocolError
    from tartlet.runtime import builder
    from tartlet.runtime.program import Program
    from tartlet.server.config import config_from_dict
    from tartlet.server.service import Service

    cfg = config_from_dict({"data_dir": str(tmp_path), "limits": {"max_builds_per_user": 1, "max_instances_per_user": 2}})
    svc = Service(cfg, HostState(), auth=True)
    release, started = threading.Event(), []

    class SlowSandbox:
        def prepare(self, program: Program) -> Program:
            started.append(program.name)
            release.wait(60)
            return program

    svc._sandbox = SlowSandbox()
    monkeypatch.setattr(builder, "pending_build", lambda p: f"key-{p.name}")
    prog = {n: Program(n, tmp_path, tmp_path / f"{n}.py") for n in ("a", "a2", "b")}
    first = asyncio.create_task(svc.prepare(prog["a"], True, "alice"))
    same = asyncio.create_task(svc.prepare(prog["a"], True, "alice"))  # shares the running build
    bobs = asyncio.create_task(svc.prepare(prog["b"], True, "bob"))
    while len(started) < 2:
        await asyncio.sleep(0.01)
    with pytest.raises(ProtocolError) as e:
        await svc.prepare(prog["a2"], True, "alice")
    assert e.value.code == "limit" and "max_builds_per_user" in str(e.value)
    release.set()
    await asyncio.gather(first, same, bobs)
    assert sorted(started) == ["a", "b"]  # one build per program
    # a build counts as a running instance: one running + one building = alice's cap of 2
    waiter = tmp_path / "w.py"
    waiter.write_text("from tartlet import session\nasync def main(args):\n    return await session.receive()\n")
    inst = svc.launch("alice", Program("w", tmp_path, waiter), {})
    release.clear()
    building = asyncio.create_task(svc.prepare(prog["a2"], True, "alice"))
    while "a2" not in started:
        await asyncio.sleep(0.01)
    with pytest.raises(ProtocolError) as e:
        svc.launch("alice", Program("w", tmp_path, waiter), {})
    assert e.value.code == "limit" and "max_instances_per_user" in str(e.value)
    release.set()
    await building
    inst.session.push("bye")
    await inst.wait()
    assert inst.result == "bye"


def test_dependencies_are_found_without_importing_them(tmp_path, monkeypatch):
    import sys

    from tartlet.runtime.builder import _dependency_dirs
    from tartlet.runtime.program import Program, ProgramError

    for name in ("tomli_w", "this"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    prog = Program("deps", tmp_path, tmp_path / "main.py", {"dependencies": ["tomli_w"]})
    (found,) = _dependency_dirs(prog)
    assert found.name == "tomli_w" and (found / "__init__.py").is_file()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "this.py").write_text("raise SystemExit('imported!')\n")  # in the cwd: never picked up
    prog.manifest["dependencies"] = ["this"]
    (found,) = _dependency_dirs(prog)  # the stdlib's `this` is found as a file, not run
    assert found.name == "this.py" and found.parent != tmp_path
    prog.manifest["dependencies"] = ["this.x"]  # importing `this.x` would run `this` first
    with pytest.raises(ProgramError, match="top-level"):
        _dependency_dirs(prog)
    assert "tomli_w" not in sys.modules and "this" not in sys.modules
