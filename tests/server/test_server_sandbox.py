"""`tartlet serve` with its default program policy: uploaded programs are
built into WebAssembly components and run sandboxed, installed `.wasm`
components launch by name, and the server's limits (pages, instances per
user) and child launches hold inside the sandbox too.

One uploaded probe program (one build, cached by content hash) serves every
case; its cases are what an untrusted client might send.
"""

from __future__ import annotations

import pytest

from server_harness import ServerProcess, cli, cli_in_process, write_config, write_inferlet

pytest.importorskip("wasmtime")
pytest.importorskip("componentize_py")

from tartlet.client import Client, TartletError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.wasm]  # a `tartlet serve` subprocess and component builds

MAX_PAGES = 24
MAX_INSTANCES = 2

PROBE = """
from tartlet import Model, Sampler
from tartlet.sdk import children, session


async def main(args):
    case = args["case"]
    if case == "echo":
        n = 0
        while True:
            try:
                msg = await session.receive()
            except EOFError:
                return {"count": n}
            n += 1
            session.send(msg.upper())
    if case == "generate":
        model = Model.load()
        with model.new_context() as ctx:
            ctx.fill(args["prompt"])
            return await ctx.generate(Sampler.greedy(), max_tokens=args["max_tokens"], eos=False).collect_tokens()
    if case == "passwd":
        with open("/etc/passwd") as f:
            return f.read()
    if case == "hog":
        model = Model.load()
        with model.new_context() as ctx:
            ctx.fill("one two three four five six seven eight " * 80)
            await ctx.flush()
            return "not reached"
    if case == "child":
        child = children.launch("text-completion", {"prompt": args["prompt"], "max_tokens": args["max_tokens"]})
        result = await child.wait()
        return {"text": result["text"], "child_id": child.id}
    if case == "wait":
        session.send("waiting")
        return await session.receive()
    raise ValueError(f"unknown case {case!r}")
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("sandbox-server")
    cfg = write_config(
        d / "config.toml", d / "data",
        f"""
        [limits]
        max_pages_per_instance = {MAX_PAGES}
        max_instances_per_user = {MAX_INSTANCES}
        max_wall_time_s = 300
        [programs]
        sandbox_memory_mb = 256
        """,
    )  # fmt: skip
    progs = d / "progs"
    write_inferlet(progs, "probe", PROBE)
    native = progs / "native-probe"  # the same source, installed natively for comparison
    native.mkdir()
    (native / "main.py").write_text((progs / "probe.py").read_text())
    (native / "inferlet.toml").write_text('name = "native-probe"\nentry = "main.py"\n')
    assert cli_in_process("install", str(native), "--config", str(cfg)).returncode == 0
    built = d / "boxed-probe.wasm"
    r = cli("build", str(progs / "probe.py"), "-o", str(built), timeout=600)
    assert r.returncode == 0, r.stderr
    r = cli_in_process("install", str(built), "--config", str(cfg))
    assert r.returncode == 0, r.stderr
    bad = d / "broken.wasm"
    bad.write_bytes(b"\0asm not really")
    r = cli_in_process("install", str(bad), "--config", str(cfg))
    assert r.returncode != 0 and "component" in r.stderr.lower(), r.stderr
    server = ServerProcess(cfg, "--no-auth")
    yield {"server": server, "progs": progs}
    server.stop()


@pytest.fixture
def server(setup):
    yield setup["server"]
    setup["server"].wait_pages_free()


async def connect(setup) -> Client:
    return await Client.connect(setup["server"].url)


async def test_uploaded_program_runs_sandboxed_with_session_io(setup, server):
    async with await connect(setup) as c:
        inst = await c.launch(setup["progs"] / "probe.py", {"case": "echo"}, time_limit_s=600)  # first launch builds
        await inst.send("hello")
        assert await inst.recv() == "HELLO"
        await inst.close_input()
        ex = await inst.wait()
        assert ex.ok and ex.result == {"count": 1}, ex
        listed = {i["id"]: i for i in await c.list()}
        assert listed[inst.id]["runtime"] == "wasm"


async def test_sandboxed_upload_matches_native_install_token_for_token(setup, server):
    args = {"case": "generate", "prompt": "The capital of France is", "max_tokens": 12}
    async with await connect(setup) as c:
        boxed = await (await c.launch(setup["progs"] / "probe.py", args)).wait()
        native_inst = await c.launch("native-probe", args)
        native = await native_inst.wait()
        component = await (await c.launch("boxed-probe", args)).wait()  # the installed .wasm
        assert boxed.ok and native.ok and component.ok, (boxed, native, component)
        assert len(native.result) == 12 and boxed.result == native.result == component.result
        runtimes = {i["id"]: i["runtime"] for i in await c.list()}
        assert runtimes[native_inst.id] == "native"


async def test_sandbox_contains_file_access_and_page_hog(setup, server):
    async with await connect(setup) as c:
        ex = await (await c.launch(setup["progs"] / "probe.py", {"case": "passwd"})).wait()
        assert ex.status == "failed" and "passwd" in ex.error, ex
        ex = await (await c.launch(setup["progs"] / "probe.py", {"case": "hog"})).wait()
        assert ex.status == "failed" and "page limit" in ex.error and str(MAX_PAGES) in ex.error, ex
        # the server still serves
        ok = await (await c.launch(setup["progs"] / "probe.py", {"case": "generate", "prompt": "Hi", "max_tokens": 3})).wait()
        assert ok.ok and len(ok.result) == 3


async def test_sandboxed_parent_launches_a_child(setup, server):
    async with await connect(setup) as c:
        q = {"prompt": "What is the capital of France?", "max_tokens": 16}
        inst = await c.launch(setup["progs"] / "probe.py", {"case": "child", **q})
        ex = await inst.wait()
        direct = await (await c.launch("text-completion", q)).wait()  # native, launched by the client
        assert ex.ok and direct.ok, (ex, direct)
        assert "Paris" in ex.result["text"] and ex.result["text"] == direct.result["text"]
        listed = {i["id"]: i for i in await c.list()}
        child = listed[ex.result["child_id"]]
        assert child["parent"] == inst.id and child["runtime"] == "wasm" and child["status"] == "finished"


async def test_instance_cap_counts_native_and_sandboxed(setup, server):
    async with await connect(setup) as c:
        a = await c.launch("native-probe", {"case": "wait"})
        b = await c.launch(setup["progs"] / "probe.py", {"case": "wait"})
        assert await a.recv() == "waiting" and await b.recv() == "waiting"
        with pytest.raises(TartletError) as e:
            await c.launch("boxed-probe", {"case": "wait"})
        assert e.value.code == "limit"
        for inst in (a, b):
            await inst.send("done")
            assert (await inst.wait()).result == "done"
