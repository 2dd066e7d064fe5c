"""A real MCP server for tests: the official ``mcp`` package's
``MCPServer`` (FastMCP, renamed in mcp 2.x) over Streamable HTTP on a
loopback port, served by uvicorn in a thread of the test process.

Tools: ``add(a, b)``, ``get_weather(city)`` (records its calls),
``fail(reason)`` (raises ``ToolError``: an ``isError`` result), plus ``extra_1`` ...
``extra_4``; ``tools/list`` is served in pages of 2 tools (``nextCursor``)
so clients must paginate (``schemas``: the input schemas it lists). Resources: ``note://hello`` (text) and
``data://blob`` (bytes). Prompt: ``greet(name)``. Every HTTP request's
headers are recorded in ``headers``.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ListToolsResult, PaginatedRequestParams

PAGE = 2
WEATHER = {"Paris": "sunny, 21 C", "Tokyo": "rainy, 14 C", "Oslo": "snow, -3 C"}


@dataclass
class McpTestServer:
    url: str
    calls: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool name -> inputSchema as listed
    _server: Any = None
    _thread: Any = None

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def start_mcp_server(json_response: bool = False) -> McpTestServer:
    """Start the server; ``json_response``: answer requests with JSON
    bodies instead of event streams. Returns once it accepts connections."""
    srv = MCPServer("tartlet-test")
    state = McpTestServer(url="")

    @srv.tool()
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @srv.tool()
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        state.calls.append({"tool": "get_weather", "city": city})
        return f"The weather in {city} is {WEATHER.get(city, 'cloudy, 17 C')}."

    @srv.tool()
    def fail(reason: str) -> str:
        """Always fails."""
        raise ToolError(f"failed on purpose: {reason}")

    for i in range(1, 5):
        srv.tool(name=f"extra_{i}", description=f"Extra tool {i}.")(lambda: "extra")

    @srv.resource("note://hello", mime_type="text/plain")
    def hello() -> str:
        return "Hello from a resource"

    @srv.resource("data://blob", mime_type="application/octet-stream")
    def blob() -> bytes:
        return bytes(range(8))

    @srv.prompt()
    def greet(name: str) -> str:
        """Greet someone."""
        return f"Say hello to {name}, warmly."

    async def paged_tools(ctx: Any, params: PaginatedRequestParams) -> ListToolsResult:
        tools = await srv.list_tools()
        start = int(params.cursor or 0)
        nxt = str(start + PAGE) if start + PAGE < len(tools) else None
        return ListToolsResult(tools=tools[start : start + PAGE], next_cursor=nxt)

    state.schemas = {name: srv._tool_manager.get_tool(name).parameters for name in ("add", "get_weather", "fail")}
    srv._lowlevel_server.add_request_handler("tools/list", PaginatedRequestParams, paged_tools)
    app = srv.streamable_http_app(json_response=json_response)

    async def recording(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            state.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await app(scope, receive, send)

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(recording, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test MCP server did not start")
        time.sleep(0.02)
    state.url, state._server, state._thread = f"http://127.0.0.1:{port}/mcp", server, thread
    return state
