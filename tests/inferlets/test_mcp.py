"""The SDK's MCP client (tartlet.sdk.mcp) against a real MCP server (the
official ``mcp`` package over Streamable HTTP on loopback, both reply
styles: event streams and JSON bodies), from a native inferlet and from the
same inferlet built into a WASM component; servers configured by name in
the server config, their endpoints allowed (and only them), their headers
added by the host; URLs not allowed are refused with a clear error."""

from __future__ import annotations

import textwrap

import pytest

pytest.importorskip("mcp")

from harness import run_ok  # noqa: E402
from mcp_harness import start_mcp_server  # noqa: E402
from tartlet.host.http import HttpPolicy  # noqa: E402
from tartlet.runtime.program import load_program  # noqa: E402
from tartlet.sdk.mcp import parse_sse  # noqa: E402
from tartlet.server.app import configure_http  # noqa: E402
from tartlet.server.config import config_from_dict  # noqa: E402

SECRET = "Bearer s3cret-token"

PROBE = textwrap.dedent('''\
    """MCP probe: exercises tartlet.sdk.mcp against the server named in args."""
    import asyncio

    from tartlet.sdk import http, mcp


    async def main(args):
        out = {"servers": mcp.available_servers()}
        async with await mcp.connect(args["server"]) as s:
            out["protocol"] = s.protocol_version
            out["server_name"] = s.server_info.get("name")
            tools = await s.list_tools()
            out["tools"] = [t.name for t in tools]
            out["add_schema"] = next(t.input_schema for t in tools if t.name == "add")
            page = await s.page("tools/list", "tools")
            out["first_page"] = [[t["name"] for t in page.items], page.next_cursor]
            r = await s.call_tool("add", {"a": 2, "b": 40})
            out["add"] = [r.text, r.structured, r.is_error]
            many = await asyncio.gather(*(s.call_tool("add", {"a": i, "b": i}) for i in range(4)))
            out["concurrent"] = [m.text for m in many]
            out["weather"] = (await s.call_tool("get_weather", {"city": "Paris"})).text
            f = await s.call_tool("fail", {"reason": "test"})
            out["fail"] = [f.is_error, f.text]
            out["resources"] = sorted(x.uri for x in await s.list_resources())
            [note] = await s.read_resource("note://hello")
            out["note"] = [note.text, note.mime_type]
            [blob] = await s.read_resource("data://blob")
            out["blob"] = list(blob.blob)
            out["prompts"] = [p.name for p in await s.list_prompts()]
            out["greet"] = (await s.get_prompt("greet", {"name": "Ada"})).as_chat()
            errors = {}
            for key, call in [("unknown_resource", lambda: s.read_resource("note://nope")),
                              ("unknown_method", lambda: s.request("bogus/method"))]:
                try:
                    await call()
                    errors[key] = None
                except mcp.McpError as e:
                    errors[key] = [e.code, str(e)]
            out["errors"] = errors
            # the server forgets the session: the next call starts a new one
            old = s.session_id
            await http.fetch(s.url, "DELETE", headers={"mcp-session-id": old, "mcp-protocol-version": s.protocol_version})
            out["after_expiry"] = (await s.call_tool("add", {"a": 1, "b": 1})).text
            out["new_session"] = s.session_id is not None and s.session_id != old
        refused = []
        for bad in args.get("refused", []):
            try:
                await mcp.connect(bad)
                refused.append(None)
            except mcp.McpError as e:
                refused.append(str(e))
        out["refused"] = refused
        return out
''')


@pytest.fixture(scope="module")
def mcp_servers():
    servers = {"demo": start_mcp_server(), "demo-json": start_mcp_server(json_response=True)}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(scope="module")
def configured(host_state, mcp_servers, tmp_path_factory):
    """The shared host state, configured as `tartlet serve` would from
    ``[mcp.servers.demo]`` (with an Authorization header) and
    ``[mcp.servers.demo-json]``, and no ``[http] allow_hosts``."""
    cfg = config_from_dict({
        "data_dir": str(tmp_path_factory.mktemp("mcp-data")),
        "mcp": {"servers": {
            "demo": {"url": mcp_servers["demo"].url, "headers": {"Authorization": SECRET}},
            "demo-json": {"url": mcp_servers["demo-json"].url},
        }},
    })
    saved = host_state.http, host_state.mcp_servers
    configure_http(host_state, cfg)
    yield host_state
    host_state.http.close()
    host_state.http, host_state.mcp_servers = saved


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    d = tmp_path_factory.mktemp("mcp-probe")
    (d / "main.py").write_text(PROBE)
    (d / "inferlet.toml").write_text('name = "mcp-probe"\nversion = "0.1.0"\nentry = "main.py"\n')
    return d


def refused_urls(servers) -> list[str]:
    url = servers["demo"].url
    return ["http://127.0.0.1:9/mcp", url.replace("/mcp", "/admin"), "nope"]


def check_probe(out: dict, servers, name: str) -> None:
    assert out["servers"] == {"demo": servers["demo"].url, "demo-json": servers["demo-json"].url}
    assert out["protocol"] == "2025-06-18" and out["server_name"] == "tartlet-test"
    # all pages followed: 7 tools served 2 per page
    assert out["tools"] == ["add", "get_weather", "fail", "extra_1", "extra_2", "extra_3", "extra_4"]
    assert out["first_page"] == [["add", "get_weather"], "2"]
    assert out["add_schema"]["properties"]["a"]["type"] == "integer" and out["add_schema"]["required"] == ["a", "b"]
    assert out["add"] == ["42", {"result": 42}, False]
    assert out["concurrent"] == ["0", "2", "4", "6"]
    assert out["weather"] == "The weather in Paris is sunny, 21 C."
    assert out["fail"][0] is True and "failed on purpose: test" in out["fail"][1]
    assert out["resources"] == ["data://blob", "note://hello"]
    assert out["note"] == ["Hello from a resource", "text/plain"]
    assert out["blob"] == list(range(8))
    assert out["prompts"] == ["greet"]
    assert out["greet"] == [{"role": "user", "content": "Say hello to Ada, warmly."}]
    code, msg = out["errors"]["unknown_resource"]
    assert code == -32602 and "Unknown resource: note://nope" in msg and name in msg
    code, msg = out["errors"]["unknown_method"]
    assert code == -32601 and "bogus/method" in msg and "Method not found" in msg
    assert out["after_expiry"] == "2" and out["new_session"] is True
    off_list, other_path, unknown = out["refused"]
    assert "cannot reach MCP server" in off_list and "not in the HTTP allowlist" in off_list and "[mcp.servers.NAME]" in off_list
    assert "not in the HTTP allowlist" in other_path  # the endpoint is allowed, not its whole host
    assert "no MCP server named 'nope'" in unknown and "demo, demo-json" in unknown


@pytest.mark.parametrize("name", ["demo", "demo-json"])
async def test_native_inferlet_uses_a_real_mcp_server(name, configured, mcp_servers, probe, runtime):
    seen = len(mcp_servers[name].headers)
    out = await run_ok(runtime, load_program(probe), {"server": name, "refused": refused_urls(mcp_servers)})
    check_probe(out, mcp_servers, name)
    assert mcp_servers[name].calls[-1] == {"tool": "get_weather", "city": "Paris"}
    reqs = mcp_servers[name].headers[seen:]
    # only the two initialize requests (the first, and the one after the session expired) carry no session id
    assert len(reqs) > 20 and len([h for h in reqs if "mcp-session-id" not in h]) == 2
    assert all(h["mcp-protocol-version"] == "2025-06-18" for h in reqs if "mcp-session-id" in h)
    # the configured header is added by the host to every request of that server, never shown to the inferlet
    auth = {h.get("authorization") for h in reqs}
    assert auth == ({SECRET} if name == "demo" else {None})
    assert SECRET not in repr(out)


@pytest.mark.slow
@pytest.mark.wasm  # a componentize-py build (cached) and a wasmtime compile
async def test_sandboxed_inferlet_uses_a_real_mcp_server(configured, mcp_servers, probe, runtime):
    pytest.importorskip("wasmtime")
    pytest.importorskip("componentize_py")
    from tartlet.runtime.builder import build
    from tartlet.runtime.wasm import WasmRuntime

    wasm = build(probe)
    args = {"server": "demo", "refused": refused_urls(mcp_servers)}
    out = await run_ok(WasmRuntime(configured), wasm, args)
    check_probe(out, mcp_servers, "demo")
    assert out == await run_ok(runtime, load_program(probe), args)  # same as native


async def test_mcp_url_not_allowed_is_refused_with_a_clear_error(configured, tmp_path, runtime):
    prog = tmp_path / "refused.py"
    prog.write_text(textwrap.dedent('''\
        from tartlet.sdk import mcp

        async def main(args):
            try:
                await mcp.connect(args["url"])
            except mcp.McpError as e:
                return {"error": str(e), "code": e.code}
            return {"error": None}
    '''))
    out = await run_ok(runtime, load_program(prog), {"url": "http://127.0.0.1:8/mcp"})
    assert out["code"] is None
    assert out["error"].startswith("cannot reach MCP server 'http://127.0.0.1:8/mcp' at http://127.0.0.1:8/mcp: host '127.0.0.1' is not in the HTTP allowlist")
    assert "[mcp.servers.NAME]" in out["error"] and "[http] allow_hosts" in out["error"]


def test_endpoint_matching_is_exact_up_to_default_port_case_and_trailing_slash():
    pol = HttpPolicy(endpoints={"http://Example.com/mcp": {"X-Key": "k"}, "https://a.example/x/": {}})
    assert pol.endpoint("http://example.com:80/mcp/") == {"X-Key": "k"}
    assert pol.endpoint("http://example.com/mcp?x=1") == {"X-Key": "k"}
    assert pol.endpoint("https://a.example:443/x") == {}
    for url in ("http://example.com/mcp2", "http://example.com/", "https://example.com/mcp",
                "http://example.com:81/mcp", "http://other.com/mcp", "http://example.com/mcp/../admin", "not a url"):
        assert pol.endpoint(url) is None, url
    assert not pol.allowed("example.com", None)  # the host itself is not opened


def test_parse_sse_follows_the_event_stream_rules():
    body = "event: message\r\ndata: {\"a\":\r\ndata:1}\r\n\r\n: comment\n\nid: 7\ndata: two\n\ndata: last"
    assert parse_sse(body) == ['{"a":\n1}', "two", "last"]
    assert parse_sse("event: ping\n\n") == []
