"""The agent inferlets on the real default model with local tool servers:
``mcp-agent`` against a real MCP server (tools listed and called over MCP)
and ``react-agent`` against HTTP tools. Each test checks real behaviour:
the tool was called (the server saw it) with arguments valid under the
tool's schema, its result is in the context, and the run ended with an
answer."""

from __future__ import annotations

import http.server
import json
import threading
import time
from urllib.parse import parse_qs, urlsplit

import jsonschema
import pytest

pytest.importorskip("mcp")

from harness import run_ok  # noqa: E402
from mcp_harness import start_mcp_server  # noqa: E402
from tartlet.server.app import configure_http  # noqa: E402
from tartlet.server.config import config_from_dict  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Oslo", "Lima"]}}, "required": ["city"]}
TOPIC = {"type": "object", "properties": {"topic": {"type": "string", "maxLength": 30}}, "required": ["topic"]}
WEATHER = {"Paris": "sunny, 21 C", "Tokyo": "rainy, 14 C", "Oslo": "snow, -3 C", "Lima": "cloudy, 18 C"}
ARTICLE = (
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the "
    "engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889. It is 330 metres tall, "
    "about the same height as an 81-storey building, and was the tallest man-made structure in the world until the "
    "Chrysler Building in New York City was finished in 1930. It has three levels for visitors, with restaurants on "
    "the first and second levels. The top level's upper platform is 276 m above the ground. Tickets can be bought to "
    "ascend by stairs or lift to the first and second levels. About seven million people visit it every year."
)
DELAY_S = 0.3


class _Tools(http.server.BaseHTTPRequestHandler):
    """GET /weather?city=X, POST /article {"topic"}; every request logged
    with its arguments and start/end times. With ``barrier`` set, each GET
    waits there until as many requests are in flight (``met``: they were)."""

    log: list[dict] = []
    barrier: threading.Barrier | None = None

    def _reply(self, text: str, status: int = 200) -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("content-type", "text/plain")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        t0 = time.monotonic()
        url = urlsplit(self.path)
        args = {k: v[0] for k, v in parse_qs(url.query).items()}
        met = None
        if self.barrier is not None:
            try:
                self.barrier.wait()
                met = True
            except threading.BrokenBarrierError:
                met = False
        time.sleep(DELAY_S)
        self.log.append({"tool": url.path.strip("/"), "args": args, "t0": t0, "t1": time.monotonic(), "met": met})
        self._reply(f"{args.get('city')}: {WEATHER.get(args.get('city'), 'unknown')}")

    def do_POST(self) -> None:  # noqa: N802
        t0 = time.monotonic()
        args = json.loads(self.rfile.read(int(self.headers["content-length"])))
        time.sleep(DELAY_S)
        self.log.append({"tool": urlsplit(self.path).path.strip("/"), "args": args, "t0": t0, "t1": time.monotonic()})
        self._reply(ARTICLE)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture(scope="module")
def tool_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Tools)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def mcp_server():
    s = start_mcp_server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def configured(host_state, mcp_server, tool_server, tmp_path_factory):
    """The shared host state configured as `tartlet serve` would be with
    ``[mcp.servers.demo]`` and the tool server's host:port allowed."""
    cfg = config_from_dict({
        "data_dir": str(tmp_path_factory.mktemp("agents-data")),
        "http": {"allow_hosts": [urlsplit(tool_server).netloc]},
        "mcp": {"servers": {"demo": {"url": mcp_server.url}}},
    })
    saved = host_state.http, host_state.mcp_servers
    configure_http(host_state, cfg)
    yield host_state
    host_state.http.close()
    host_state.http, host_state.mcp_servers = saved


def http_tools(base: str) -> list[dict]:
    return [
        {"name": "weather", "description": "Current weather of a city.", "url": f"{base}/weather", "method": "GET", "parameters": CITY},
        {"name": "article", "description": "Encyclopedia article about a topic.", "url": f"{base}/article", "method": "POST", "parameters": TOPIC},
    ]


@pytest.mark.slow  # a whole agent run
async def test_mcp_agent_calls_an_mcp_tool_and_answers(configured, mcp_server, runtime):
    before = len(mcp_server.calls)
    r = await run_ok(runtime, "mcp-agent", {
        "prompt": "What is the weather in Paris?", "server": "demo", "tools": ["get_weather", "add"], "max_tokens": 40,
    })
    assert r["server"] == "demo" and r["tools"] == ["add", "get_weather"]
    [call] = r["calls"]
    # the call is valid under the tool's schema as the MCP server listed it, and the server ran it
    assert call["name"] == "get_weather", call
    jsonschema.validate(call["arguments"], mcp_server.schemas["get_weather"])
    assert mcp_server.calls[before:] == [{"tool": "get_weather", "city": call["arguments"]["city"]}]
    assert call["result"].startswith(f"The weather in {call['arguments']['city']} is") and not call["is_error"]
    assert call["result"] in r["transcript"]  # the result reached the context
    assert r["answer"].strip() and r["finish_reason"] in ("eos", "length")


@pytest.mark.slow  # a whole agent run
async def test_react_agent_calls_http_tools_and_answers(configured, tool_server, runtime):
    _Tools.log.clear()
    r = await run_ok(runtime, "react-agent", {
        "prompt": "What is the weather in Paris and in Tokyo?", "tools": http_tools(tool_server), "max_steps": 3, "max_tokens": 40,
    })
    calls = [c for s in r["steps"] for c in s["calls"]]
    assert calls, r
    schemas = {t["name"]: t["parameters"] for t in http_tools(tool_server)}
    for c in calls:
        jsonschema.validate(c["arguments"], schemas[c["name"]])
        assert c["result"] in r["transcript"]
    assert sorted((e["tool"], e["args"]) for e in _Tools.log if e["tool"] == "weather") == sorted(
        (c["name"], c["arguments"]) for c in calls if c["name"] == "weather")
    assert r["answer"] and r["finish_reason"] in ("eos", "length", "stop")


@pytest.mark.slow  # a whole agent run
async def test_react_agent_runs_the_calls_of_one_step_concurrently(configured, tool_server, runtime):
    _Tools.log.clear()
    _Tools.barrier = threading.Barrier(2, timeout=60)  # a request waits for the other: only concurrent calls pass
    try:
        r = await run_ok(runtime, "react-agent", {
            "prompt": "What is the weather in Paris and in Tokyo?", "tools": http_tools(tool_server)[:1], "max_steps": 1,
            "min_parallel": 2, "max_parallel": 2, "max_tokens": 40,
        })
    finally:
        _Tools.barrier = None
    [step] = r["steps"]
    assert len(step["calls"]) == 2
    for c in step["calls"]:
        jsonschema.validate(c["arguments"], CITY)
        assert f"[weather] {c['result']}" in r["transcript"]
    # the first call was sent while the model was still writing the second
    first, second = step["calls"]
    assert first["issued_at"] < second["issued_at"] == step["action_tokens"] - 1
    # and both requests were in flight together at the tool server
    assert [e["met"] for e in _Tools.log] == [True, True]
    assert sorted((e["args"] for e in _Tools.log), key=str) == sorted((c["arguments"] for c in step["calls"]), key=str)
    assert r["answer"]


@pytest.mark.slow  # a whole agent run
async def test_react_agent_summarizes_long_outputs_then_masks_and_drops_their_pages(configured, tool_server, runtime):
    _Tools.log.clear()
    r = await run_ok(runtime, "react-agent", {
        "prompt": "How tall is the Eiffel Tower?", "tools": http_tools(tool_server)[1:], "max_steps": 1,
        "long_output_tokens": 32, "max_tokens": 40,
    })
    [step] = r["steps"]
    for call in step["calls"]:
        jsonschema.validate(call["arguments"], TOPIC)
        assert call["result"] == ARTICLE
    assert ARTICLE in r["transcript"] and len(_Tools.log) == len(step["calls"])
    # the model wrote a one-line summary after the observation, then the
    # observation's tokens were masked and its full pages dropped
    assert step["summary"] and f"Summary: {step['summary']}\nThought:" in r["transcript"]
    assert r["masked_tokens"] > 100 * len(step["calls"]) and r["dropped_pages"] >= 5 * len(step["calls"])
    assert r["live_pages"] == r["pages"] - r["dropped_pages"]
    assert r["answer"]
