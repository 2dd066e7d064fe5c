"""Issue 40 ("Reliability") against a real `tartlet serve` (auth on):
names at and past the limits, no server path in any error a guest or a
client sees, the small protocol fixes (NaN time limits, detach of
foreign ids, ``?key=`` only on the WebSocket, close code 1009 for every
over-size message), and the per-user bounds and rates: store bytes,
sandbox memory reserved at launch, launches spaced at the user's rate
while another user is served at once.

Uploads run sandboxed (the default), so the module builds one component."""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import websockets

from server_harness import ServerProcess, add_users, cli_in_process, write_config, write_inferlet

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from tartlet.client import Client, TartletError  # noqa: E402
from tartlet.runtime.program import MAX_NAME_CHARS  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.wasm]  # a `tartlet serve` subprocess and a component build

FRAME = 2 * 2**20
STORE_BYTES = 3 * 2**20

#: every failing call a guest can make without a model, each caught; the
#: error texts come back as the result
PROBE = """
from tartlet import Context, Model, children, messaging, sandbox, session, store


def attempt(errors, fn):
    try:
        fn()
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")


async def main(args):
    case = args["case"]
    if case == "errors":
        errors = []
        for name in ["a" * 300, "b" * 129, "../../etc", "x/y", "", ".hidden", "nul\\0", "no-such-inferlet", "tab\\tname"]:
            attempt(errors, lambda: children.launch(name, {}))
        attempt(errors, lambda: store.set("", "v"))
        attempt(errors, lambda: store.set("k", "x" * (2 << 20)))
        attempt(errors, lambda: messaging.push("", "x"))
        attempt(errors, lambda: Model.load("no-such-model"))
        model = Model.load()
        attempt(errors, lambda: Context.open(model, "no-such-snapshot"))
        try:
            await sandbox.run_python("print(1)", time_limit_s=1e9)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        return errors
    if case == "wait":
        session.send("waiting")
        return await session.receive()
    if case == "hoard":
        kept, error = 0, None
        try:
            for i in range(10):
                store.set(f"blob{i}", "x" * 1_000_000)
                kept += 1
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        for i in range(kept):
            store.delete(f"blob{i}")
        return {"kept": kept, "error": error}
    if case == "leak_path":
        raise RuntimeError("failed in " + __file__)
    if case == "quick":
        return 1
    raise ValueError(case)
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("reliability")
    data = d / "data"
    cfg = write_config(
        d / "config.toml", data,
        f"""
        [limits]
        max_instances_per_user = 32
        max_wall_time_s = 300
        max_message_bytes = {FRAME}
        max_store_bytes_per_user = {STORE_BYTES}
        max_sandbox_memory_mb_per_user = 512
        max_messaging_bytes_per_user = {2**40}
        max_launches_per_s = 5
        rate_burst_s = 1
        max_rate_wait_s = 1
        [programs]
        sandbox_memory_mb = 256
        """,
    )  # fmt: skip
    keys = add_users(cfg, "alice", "mallory", "eve")
    progs = d / "progs"
    write_inferlet(progs, "probe", PROBE)
    native = progs / "native-probe"  # the same source, installed natively
    native.mkdir()
    (native / "main.py").write_text((progs / "probe.py").read_text())
    (native / "inferlet.toml").write_text('name = "native-probe"\nentry = "main.py"\n')
    assert cli_in_process("install", str(native), "--config", str(cfg)).returncode == 0
    server = ServerProcess(cfg)
    yield {"server": server, "keys": keys, "data": data, "progs": progs, "log": cfg.with_suffix(".stderr"), "dir": d}
    server.stop()


async def connect(setup, user: str) -> Client:
    return await Client.connect(setup["server"].url, setup["keys"][user])


def server_paths(setup) -> list[str]:
    """Folders of the server's machine no error text may name."""
    return [str(setup["dir"]), str(setup["data"]), tempfile.gettempdir(), str(Path(__file__).resolve().parents[2]), sys.prefix]


def assert_no_server_path(setup, texts: list[str]) -> None:
    for text in texts:
        for path in server_paths(setup):
            assert path not in text, (path, text)


async def test_names_at_and_past_the_limit_are_clean_errors(setup):
    """A 255+ character name used to be `internal (OSError: File name too
    long)` on the server, and an OSError in the client before sending."""
    seen = []
    async with await connect(setup, "alice") as a:
        for name in ["n" * MAX_NAME_CHARS, "n" * (MAX_NAME_CHARS + 1), "n" * 255, "n" * 256, "n" * 300, "n" * 5000,
                     "a/b", "../x", ".x", "nul\0byte", "ctl\x01"]:  # fmt: skip
            with pytest.raises(TartletError) as e:
                await a.launch(name)  # the client sends it (no OSError here)
            assert e.value.code == "not_found", (len(name), e.value.code, e.value.message)  # no such inferlet
            assert len(e.value.message) < 2000
            seen.append(e.value.message)
        assert "unknown inferlet" in seen[0] and all("at most 128 characters" in m for m in seen[1:6]), seen
        assert not [e for e in a.errors if e.code == "internal"]
    assert_no_server_path(setup, seen)


async def test_no_error_a_guest_or_client_sees_names_a_server_path(setup):
    """Every failing host call of a sandboxed and of a native inferlet, the
    launch errors of bad names, and the error of an instance whose message
    held its own file's path: none names a server folder."""
    texts: list[str] = []
    async with await connect(setup, "alice") as a:
        for target in (setup["progs"] / "probe.py", "native-probe"):
            ex = await (await a.launch(target, {"case": "errors"}, time_limit_s=600)).wait()  # the first builds
            assert ex.ok, ex
            assert len(ex.result) == 15, ex.result
            texts += ex.result
            long_name = ex.result[0]
            assert long_name.startswith("ProgramError") and "at most 128 characters" in long_name, long_name
        for target in (setup["progs"] / "probe.py", "native-probe"):
            ex = await (await a.launch(target, {"case": "leak_path"})).wait()
            assert ex.status == "failed" and "failed in " in ex.error, ex.error
            texts.append(ex.error)
        assert "failed in <programs>/native-probe/main.py" in ex.error  # the native file's path became a placeholder
        texts += [i["error"] for i in await a.list() if i["error"]]
        for req in ({"type": "launch", "inferlet": "x" * 400}, {"type": "launch", "program": "sha256:" + "0" * 64},
                    {"type": "upload", "files": {"main.py": "async def main(args):\n    return 1\n", "../x.py": ""}},
                    {"type": "attach", "instance": "nope"}, {"type": "launch", "inferlet": "no-such"}):  # fmt: skip
            with pytest.raises(TartletError) as e:
                await a._request(req)
            texts.append(e.value.message)
    assert_no_server_path(setup, texts)


async def test_non_finite_time_limits_are_refused(setup):
    async with websockets.connect(setup["server"].url.replace("http", "ws") + "/ws",
                                  additional_headers={"Authorization": f"Bearer {setup['keys']['alice']}"}) as ws:  # fmt: skip
        for i, literal in enumerate(["NaN", "Infinity", "-Infinity", "1e999", "0", "-5"]):
            await ws.send(f'{{"type": "launch", "inferlet": "native-probe", "args": {{"case": "quick"}}, "time_limit_s": {literal}, "id": {i}}}')
            reply = json.loads(await ws.recv())
            assert reply["type"] == "error" and reply["code"] == "bad_request" and "time_limit_s" in reply["message"], reply


async def test_detach_answers_not_found_for_ids_that_are_not_yours(setup):
    async with await connect(setup, "alice") as a, await connect(setup, "eve") as e:
        mine = await a.launch("native-probe", {"case": "wait"})
        assert await mine.recv() == "waiting"
        for who, iid in ((a, "no-such-id"), (e, mine.id)):
            with pytest.raises(TartletError) as err:
                await who._request({"type": "detach", "instance": iid})
            assert err.value.code == "not_found"
        assert (await a._request({"type": "detach", "instance": mine.id}))["type"] == "ok"
        await a.abort(mine.id)


async def test_query_key_is_for_the_websocket_only(setup):
    url, key = setup["server"].url, setup["keys"]["alice"]
    async with websockets.connect(url.replace("http", "ws") + f"/ws?key={key}") as ws:
        await ws.send(json.dumps({"type": "ping", "id": 1}))
        assert json.loads(await ws.recv())["user"] == "alice"
    assert httpx.get(f"{url}/v1/models?key={key}", timeout=30).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30).status_code == 200


@pytest.mark.parametrize("shape", ["text", "binary", "fragments", "fragments-compressed"])
async def test_over_size_messages_close_with_1009(setup, shape):
    url = setup["server"].url.replace("http", "ws") + "/ws"
    big = 10 * 2**20
    for _ in range(3):
        ws = await websockets.connect(url, additional_headers={"Authorization": f"Bearer {setup['keys']['alice']}"},
                                      max_size=None, compression="deflate" if shape.endswith("compressed") else None)  # fmt: skip
        payload = {"text": "x" * big, "binary": b"x" * big}.get(shape) or iter(["y" * 2**20] * 10)
        with pytest.raises(websockets.ConnectionClosedError):
            await ws.send(payload)
            await asyncio.wait_for(ws.recv(), 30)
        await ws.wait_closed()  # closed by the server: nothing for the client to close
        assert ws.close_code == 1009, (shape, ws.close_code, ws.close_reason)
    async with await connect(setup, "alice") as a:  # and the server goes on
        assert (await a.ping())["user"] == "alice"


async def test_the_store_is_bounded_per_user(setup):
    async with await connect(setup, "mallory") as m:
        ex = await (await m.launch("native-probe", {"case": "hoard"})).wait()
    assert ex.ok and ex.result["kept"] == 3, ex.result  # 3 x 1 MB values fit in 3 MiB, not a fourth
    assert ex.result["error"].startswith("LimitError") and "max_store_bytes_per_user" in ex.result["error"]


async def test_sandbox_memory_is_reserved_per_user_at_launch(setup):
    """256 MiB per sandboxed instance, 512 MiB per user: Eve's third
    sandboxed instance is refused while two run; Alice is not affected;
    an ended instance gives its share back."""
    probe = setup["progs"] / "probe.py"
    async with await connect(setup, "eve") as e, await connect(setup, "alice") as a:
        first = await e.launch(probe, {"case": "wait"}, time_limit_s=600)
        second = await e.launch(probe, {"case": "wait"})
        assert await first.recv() == "waiting" and await second.recv() == "waiting"
        with pytest.raises(TartletError) as err:
            await e.launch(probe, {"case": "wait"})
        assert err.value.code == "limit" and "max_sandbox_memory_mb_per_user = 512" in err.value.message
        other = await a.launch(probe, {"case": "wait"})
        assert await other.recv() == "waiting"
        await first.send("bye")
        assert (await first.wait()).result == "bye"
        third = await e.launch(probe, {"case": "wait"})
        assert await third.recv() == "waiting"
        for inst in (second, third, other):
            await inst.send("x")
            await inst.wait()


async def test_a_launch_flood_is_spaced_at_the_users_rate_while_others_are_served(setup):
    """5 launches per second, a 1 s burst: Mallory's 15 launches on one
    connection are answered in turn, spaced at her rate (so they take at
    least ~2 s), while Alice's launch is answered at once; launches of
    Mallory's that would wait more than 1 s (many connections at once) are
    refused with `limit`."""
    async with await connect(setup, "mallory") as m, await connect(setup, "alice") as a:
        t0 = time.monotonic()
        flood = asyncio.gather(*[m.launch("native-probe", {"case": "quick"}) for _ in range(15)])
        await asyncio.sleep(0.3)
        t_alice = time.monotonic()
        await (await a.launch("native-probe", {"case": "quick"})).wait()
        alice_s = time.monotonic() - t_alice
        launched = await flood
        flood_s = time.monotonic() - t0
    assert len(launched) == 15 and flood_s >= 1.5, flood_s  # (15 - 5 in the burst) / 5 per second = 2 s
    assert alice_s < 1.5, alice_s
    clients = [await connect(setup, "mallory") for _ in range(10)]
    try:
        outcomes = await asyncio.gather(*[c.launch("native-probe", {"case": "quick"}) for c in clients], return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
    refused = [o for o in outcomes if isinstance(o, TartletError)]
    assert all(e.code == "limit" and "max_launches_per_s" in e.message for e in refused), refused
    assert 1 <= len(refused) <= 8 and len(outcomes) - len(refused) >= 2, outcomes


async def test_the_server_warned_about_limits_past_the_machines_memory(setup):
    log = Path(setup["log"]).read_text()
    assert "max_messaging_bytes_per_user" in log and "more than this machine's" in log, log[-2000:]
