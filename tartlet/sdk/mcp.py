"""MCP client for inferlets: tools, resources and prompts of Model Context
Protocol servers.

Follows the MCP specification revision **2025-06-18**
(https://modelcontextprotocol.io/specification/2025-06-18), and accepts
servers that negotiate **2025-03-26**. Only the client side of the
*Streamable HTTP* transport
(https://modelcontextprotocol.io/specification/2025-06-18/basic/transports#streamable-http)
is spoken, directly as JSON:

- every JSON-RPC 2.0 message is one HTTP POST to the server's endpoint URL
  with ``Accept: application/json, text/event-stream``;
- the reply to a request is either a JSON body (one response, or a batch
  array) or a ``text/event-stream`` body whose ``data:`` events carry the
  response (and maybe notifications, kept in :attr:`McpClient.notifications`);
- the ``Mcp-Session-Id`` header of the ``initialize`` reply is sent back on
  every later request, with ``MCP-Protocol-Version``; an HTTP 404 on a
  request carrying a session id means the session expired, and the client
  initializes a new one and retries once (as the spec requires);
- the handshake is ``initialize`` followed by the
  ``notifications/initialized`` notification; :meth:`McpClient.close` ends
  the session with HTTP DELETE.

Every request goes through the host's HTTP call (:func:`tartlet.http.fetch`),
so the same code runs in native and sandboxed (WASM) inferlets, and the
host's HTTP policy applies: the server configured as ``[mcp.servers.NAME]
url = "..."`` is reachable at exactly that URL; any other URL must be on the
``[http] allow_hosts`` list. The host reads each reply whole, so a server
must close the event stream of a POST after its response (the spec's SHOULD;
every SDK server does), within the host's HTTP time limit. Server-to-client
requests (sampling, elicitation, roots) are not supported: the client
declares no capabilities, so servers do not send them. This module uses no
third-party package (it is bundled into WASM builds).

Usage::

    from tartlet import mcp

    mcp.available_servers()                  # {"weather": "http://127.0.0.1:9000/mcp"}
    async with await mcp.connect("weather") as server:
        tools = await server.list_tools()    # [Tool(name="forecast", ...)]
        result = await server.call_tool("forecast", {"city": "Paris"})
        print(result.text, result.is_error)
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field
from typing import Any, cast

from . import _binding, http
from .errors import HttpError

#: The revision this client asks for in ``initialize``.
PROTOCOL_VERSION = "2025-06-18"
#: Revisions this client accepts from a server (both define Streamable HTTP).
SUPPORTED_VERSIONS = ("2025-06-18", "2025-03-26")
#: Most pages one ``list_*`` call follows (a server sending cursors forever
#: is an error, not a hang).
MAX_PAGES = 1000
#: Notifications kept per client (the oldest are dropped first).
MAX_NOTIFICATIONS = 100

_ACCEPT = "application/json, text/event-stream"


class McpError(RuntimeError):
    """An MCP request failed.

    Attributes:
        code: the JSON-RPC error code when the server answered with a
            JSON-RPC error (e.g. -32601 method not found, -32602 invalid
            params), else None (transport failure, HTTP error, malformed
            reply, unknown server name).
        data: the JSON-RPC error's ``data`` member, if any.
    """

    def __init__(self, message: str, code: int | None = None, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.data = data


@dataclass
class Tool:
    """A tool a server offers (``tools/list``): ``name``, ``description``,
    ``input_schema`` (JSON Schema of the arguments object), optional
    ``title``, ``output_schema`` and ``annotations``; ``raw`` is the JSON
    object as the server sent it."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    title: str | None = None
    output_schema: dict[str, Any] | None = None
    annotations: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict)

    def to_function(self) -> dict[str, Any]:
        """The tool as an OpenAI-style function spec ``{"name",
        "description", "parameters"}`` (what the ``tool-call`` inferlet and
        chat templates take)."""
        return {"name": self.name, "description": self.description, "parameters": self.input_schema}


@dataclass
class ToolResult:
    """The result of ``tools/call``: ``content`` (list of content blocks,
    each a JSON object with a ``type``: text, image, audio, resource_link,
    resource), ``structured`` (the ``structuredContent`` object, or None)
    and ``is_error`` (the tool itself failed: the error is described in
    ``content``; protocol errors raise :class:`McpError` instead)."""

    content: list[dict[str, Any]]
    structured: Any = None
    is_error: bool = False

    @property
    def text(self) -> str:
        """The content as text: text blocks as they are, embedded text
        resources by their text, other blocks as ``[type: uri or mime]``,
        joined by newlines."""
        parts = []
        for block in self.content:
            kind = block.get("type")
            if kind == "text":
                parts.append(str(block.get("text", "")))
            elif kind == "resource" and isinstance(block.get("resource"), dict) and "text" in block["resource"]:
                parts.append(str(block["resource"]["text"]))
            else:
                what = block.get("uri") or block.get("mimeType") or ""
                parts.append(f"[{kind}: {what}]" if what else f"[{kind}]")
        if not parts and self.structured is not None:
            parts.append(json.dumps(self.structured))
        return "\n".join(parts)


@dataclass
class Resource:
    """A resource a server offers (``resources/list``): ``uri``, ``name``,
    optional ``title``, ``description``, ``mime_type``; ``raw`` as sent."""

    uri: str
    name: str = ""
    title: str | None = None
    description: str = ""
    mime_type: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class ResourceContent:
    """One item of ``resources/read``: ``uri``, ``mime_type``, and either
    ``text`` (str) or ``blob`` (bytes, decoded from the base64 the server
    sent)."""

    uri: str
    mime_type: str | None = None
    text: str | None = None
    blob: bytes | None = None


@dataclass
class Prompt:
    """A prompt template a server offers (``prompts/list``): ``name``,
    ``description``, ``arguments`` (list of ``{"name", "description",
    "required"}``); ``raw`` as sent."""

    name: str
    description: str = ""
    arguments: list[dict[str, Any]] = field(default_factory=list)
    title: str | None = None
    raw: dict[str, Any] = field(default_factory=dict)


@dataclass
class PromptResult:
    """The result of ``prompts/get``: ``description`` and ``messages``
    (``{"role": "user" | "assistant", "content": content block}``)."""

    description: str
    messages: list[dict[str, Any]]

    def as_chat(self) -> list[dict[str, str]]:
        """The messages as chat-template messages ``{"role", "content":
        str}`` (text of each content block, as :attr:`ToolResult.text`)."""
        return [{"role": m.get("role", "user"), "content": ToolResult([m.get("content") or {}]).text} for m in self.messages]


@dataclass
class Page:
    """One page of a ``*/list`` call: ``items`` (JSON objects as sent) and
    ``next_cursor`` (None on the last page)."""

    items: list[dict[str, Any]]
    next_cursor: str | None


def available_servers() -> dict[str, str]:
    """The MCP servers configured on this host: ``{name: endpoint URL}``
    (server config ``[mcp.servers.NAME] url = ...``)."""
    return dict(_binding.host().mcp_servers())


async def connect(server: str) -> "McpClient":
    """Open a session with an MCP server (``initialize`` handshake done).

    Args:
        server: the name of a configured server (see
            :func:`available_servers`), or an ``http(s)://`` endpoint URL
            (allowed only when its host is on the ``[http] allow_hosts``
            list).

    Raises:
        TypeError: ``server`` is not a str.
        McpError: unknown server name, the server unreachable or refused by
            the host's HTTP policy, or a failed handshake (including a
            protocol version this client does not support).
    """
    client = McpClient(server)
    await client.initialize()
    return client


def parse_sse(body: str) -> list[str]:
    """The ``data`` of each event of a ``text/event-stream`` body, as the
    WHATWG HTML "server-sent events" parsing rules define it: lines end
    with CRLF, LF or CR; ``data:`` lines of one event are joined with
    ``\\n``; a blank line ends an event; ``:`` lines are comments; one
    space after the colon is dropped. Events without data are skipped."""
    events: list[str] = []
    data: list[str] = []
    pending = False
    for line in body.replace("\r\n", "\n").replace("\r", "\n").split("\n"):
        if not line:
            if pending:
                events.append("\n".join(data))
            data, pending = [], False
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            data.append(value)
            pending = True
    if pending:  # a stream that ended without the final blank line
        events.append("\n".join(data))
    return events


class McpClient:
    """A session with one MCP server over Streamable HTTP.

    ``McpClient(server)`` does no I/O; :meth:`initialize` (or ``async
    with``) performs the handshake. Requests may run concurrently (each is
    its own HTTP POST). ``server_info``, ``capabilities``,
    ``instructions`` and ``protocol_version`` hold what the server said in
    ``initialize``.

    Raises (constructor):
        TypeError: ``server`` is not a str.
        McpError: ``server`` is neither a configured name nor an http(s) URL.
    """

    def __init__(self, server: str) -> None:
        if not isinstance(server, str):
            raise TypeError(f"an MCP server is a configured name or an http(s) URL (str), got {type(server).__name__}")
        configured = available_servers()
        if server in configured:
            self.name, self.url = server, configured[server]
        elif server.startswith(("http://", "https://")):
            self.name, self.url = server, server
        else:
            names = ", ".join(sorted(configured)) or "none"
            raise McpError(f"no MCP server named {server!r} is configured on this host (configured: {names}; "
                           "add [mcp.servers.NAME] url = \"...\" to the server config)")
        self.session_id: str | None = None
        self.protocol_version: str | None = None
        self.server_info: dict[str, Any] = {}
        self.capabilities: dict[str, Any] = {}
        self.instructions: str | None = None
        #: notifications the server sent inside event streams (newest last)
        self.notifications: list[dict[str, Any]] = []
        self._next_id = 1
        self._init_lock: asyncio.Lock | None = None

    # -- lifecycle -----------------------------------------------------------------
    async def initialize(self) -> dict[str, Any]:
        """Run the handshake: ``initialize`` (asking for
        :data:`PROTOCOL_VERSION`), then ``notifications/initialized``.
        Returns the server's ``initialize`` result.

        Raises:
            McpError: transport or JSON-RPC failure, or a negotiated
                version not in :data:`SUPPORTED_VERSIONS`.
        """
        self.session_id = None
        self.protocol_version = None
        params = {
            "protocolVersion": PROTOCOL_VERSION,
            "capabilities": {},
            "clientInfo": {"name": "tartlet", "version": "0.1.0"},
        }
        result, headers = await self._exchange("initialize", params)
        version = result.get("protocolVersion") if isinstance(result, dict) else None
        if version not in SUPPORTED_VERSIONS:
            self.session_id = headers.get("mcp-session-id")
            await self.close()
            raise McpError(f"MCP server {self.name!r} speaks protocol version {version!r}; "
                           f"this client supports {', '.join(SUPPORTED_VERSIONS)}")
        self.session_id = headers.get("mcp-session-id")
        self.protocol_version = version
        self.server_info = dict(result.get("serverInfo") or {})
        self.capabilities = dict(result.get("capabilities") or {})
        self.instructions = result.get("instructions")
        await self._post({"jsonrpc": "2.0", "method": "notifications/initialized"}, "notifications/initialized")
        return cast(dict[str, Any], result)  # a dict: its protocolVersion passed the check above

    async def close(self) -> None:
        """End the session (HTTP DELETE with the session id; best effort:
        servers may answer 405, and a failure to reach the server is
        ignored). The client can be initialized again afterwards."""
        sid, self.session_id = self.session_id, None
        if sid is None:
            return
        try:
            await http.fetch(self.url, "DELETE", headers=self._headers(sid))
        except Exception:  # noqa: BLE001 - closing is best effort; the server expires sessions itself
            pass

    async def __aenter__(self) -> "McpClient":
        if self.protocol_version is None:
            await self.initialize()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- tools -----------------------------------------------------------------------
    async def list_tools(self) -> list[Tool]:
        """Every tool of the server (``tools/list``, all pages).

        Raises:
            McpError: as :meth:`request`, or more than :data:`MAX_PAGES` pages.
        """
        items = await self._all("tools/list", "tools")
        out = []
        for t in items:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise McpError(f"MCP server {self.name!r} listed a tool without a name: {str(t)[:200]}")
            given = t.get("inputSchema")
            schema: dict[str, Any] = given if isinstance(given, dict) else {"type": "object"}
            out.append(Tool(t["name"], str(t.get("description") or ""), schema, t.get("title"),
                            t.get("outputSchema"), t.get("annotations"), t))
        return out

    async def call_tool(self, name: str, arguments: dict[str, Any] | None = None) -> ToolResult:
        """Call tool ``name`` with ``arguments`` (``tools/call``).

        A tool that fails reports it in the result (``is_error`` True, the
        message in ``content``), as the spec prescribes; an unknown tool may
        be reported either way, depending on the server.

        Raises:
            TypeError: ``name`` not a str or ``arguments`` not a dict.
            McpError: as :meth:`request` (e.g. invalid params, -32602).
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"a tool name is a non-empty str, got {name!r:.100}")
        if arguments is not None and not isinstance(arguments, dict):
            raise TypeError(f"tool arguments are a dict, got {type(arguments).__name__}")
        r = await self.request("tools/call", {"name": name, "arguments": arguments or {}})
        content = r.get("content")
        if not isinstance(content, list):
            raise McpError(f"MCP server {self.name!r}: tools/call result has no content list: {str(r)[:200]}")
        return ToolResult([c for c in content if isinstance(c, dict)], r.get("structuredContent"), bool(r.get("isError", False)))

    # -- resources ---------------------------------------------------------------------
    async def list_resources(self) -> list[Resource]:
        """Every resource of the server (``resources/list``, all pages).

        Raises:
            McpError: as :meth:`request`.
        """
        items = await self._all("resources/list", "resources")
        return [
            Resource(str(r.get("uri")), str(r.get("name") or ""), r.get("title"), str(r.get("description") or ""),
                     r.get("mimeType"), r)
            for r in items if isinstance(r, dict) and "uri" in r
        ]

    async def list_resource_templates(self) -> list[dict[str, Any]]:
        """Every resource template (``resources/templates/list``, all
        pages): JSON objects with ``uriTemplate`` (RFC 6570), ``name``, ...

        Raises:
            McpError: as :meth:`request`.
        """
        return await self._all("resources/templates/list", "resourceTemplates")

    async def read_resource(self, uri: str) -> list[ResourceContent]:
        """The contents of resource ``uri`` (``resources/read``).

        Raises:
            TypeError: ``uri`` not a str.
            McpError: as :meth:`request` (unknown resources are usually
                JSON-RPC error -32002 or -32602).
        """
        if not isinstance(uri, str) or not uri:
            raise TypeError(f"a resource URI is a non-empty str, got {uri!r:.100}")
        r = await self.request("resources/read", {"uri": uri})
        out = []
        for c in r.get("contents") or []:
            if not isinstance(c, dict):
                continue
            blob = c.get("blob")
            try:
                data = base64.b64decode(blob, validate=True) if isinstance(blob, str) else None
            except ValueError:
                raise McpError(f"MCP server {self.name!r}: resource {uri!r} has a blob that is not base64") from None
            out.append(ResourceContent(str(c.get("uri", uri)), c.get("mimeType"), c.get("text"), data))
        return out

    # -- prompts -----------------------------------------------------------------------
    async def list_prompts(self) -> list[Prompt]:
        """Every prompt of the server (``prompts/list``, all pages).

        Raises:
            McpError: as :meth:`request`.
        """
        items = await self._all("prompts/list", "prompts")
        return [
            Prompt(p["name"], str(p.get("description") or ""), list(p.get("arguments") or []), p.get("title"), p)
            for p in items if isinstance(p, dict) and isinstance(p.get("name"), str)
        ]

    async def get_prompt(self, name: str, arguments: dict[str, str] | None = None) -> PromptResult:
        """Prompt ``name`` filled with ``arguments`` (``prompts/get``; the
        spec's argument values are strings).

        Raises:
            TypeError: ``name`` not a str, or ``arguments`` not ``str -> str``.
            McpError: as :meth:`request`.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"a prompt name is a non-empty str, got {name!r:.100}")
        args = dict(arguments or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in args.items()):
            raise TypeError("prompt arguments map str to str (MCP prompts/get)")
        r = await self.request("prompts/get", {"name": name, "arguments": args})
        return PromptResult(str(r.get("description") or ""), [m for m in r.get("messages") or [] if isinstance(m, dict)])

    # -- pagination ----------------------------------------------------------------------
    async def page(self, method: str, key: str, cursor: str | None = None) -> Page:
        """One page of a list call: ``await client.page("tools/list",
        "tools", cursor)`` returns ``Page(items, next_cursor)``.

        Raises:
            TypeError: ``cursor`` neither None nor a str.
            McpError: as :meth:`request`, or the result has no ``key`` list.
        """
        if cursor is not None and not isinstance(cursor, str):
            raise TypeError(f"a cursor is a str (from nextCursor), got {type(cursor).__name__}")
        r = await self.request(method, {} if cursor is None else {"cursor": cursor})
        items = r.get(key)
        if not isinstance(items, list):
            raise McpError(f"MCP server {self.name!r}: {method} result has no {key!r} list: {str(r)[:200]}")
        nxt = r.get("nextCursor")
        return Page(items, nxt if isinstance(nxt, str) and nxt else None)

    async def _all(self, method: str, key: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        cursor, seen = None, set()
        for _ in range(MAX_PAGES):
            p = await self.page(method, key, cursor)
            items += p.items
            if p.next_cursor is None:
                return items
            if p.next_cursor in seen:
                raise McpError(f"MCP server {self.name!r}: {method} repeated cursor {p.next_cursor!r:.100}")
            seen.add(p.next_cursor)
            cursor = p.next_cursor
        raise McpError(f"MCP server {self.name!r}: {method} gave more than {MAX_PAGES} pages")

    # -- JSON-RPC over Streamable HTTP -----------------------------------------------------
    async def request(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send JSON-RPC request ``method`` and return its ``result``
        object. Initializes first if needed; on HTTP 404 for an expired
        session, initializes again and retries once.

        Raises:
            McpError: the server unreachable or refused by the host's HTTP
                policy, an HTTP error status, a reply that is not JSON-RPC,
                or a JSON-RPC error (``code``, ``data`` set).
        """
        if self.protocol_version is None:
            await self._reinitialize(None)
        sid = self.session_id
        try:
            result, _ = await self._exchange(method, params)
        except _SessionExpired:
            await self._reinitialize(sid)
            result, _ = await self._exchange(method, params)
        if not isinstance(result, dict):
            raise McpError(f"MCP server {self.name!r}: {method} result is not an object: {str(result)[:200]}")
        return result

    async def _reinitialize(self, expired: str | None) -> None:
        if self._init_lock is None:
            self._init_lock = asyncio.Lock()
        async with self._init_lock:
            if self.protocol_version is not None and self.session_id != expired:
                return  # a concurrent request already opened a new session
            await self.initialize()

    def _headers(self, sid: str | None) -> dict[str, str]:
        h = {"accept": _ACCEPT, "content-type": "application/json"}
        if sid is not None:
            h["mcp-session-id"] = sid
        if self.protocol_version is not None:
            h["mcp-protocol-version"] = self.protocol_version
        return h

    async def _exchange(self, method: str, params: dict[str, Any] | None) -> tuple[Any, dict[str, str]]:
        rid = self._next_id
        self._next_id += 1
        msg: dict[str, Any] = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        r = await self._post(msg, method)
        ctype = r.headers.get("content-type", "").split(";")[0].strip().lower()
        text = r.body.decode("utf-8", errors="replace")
        try:
            if ctype == "text/event-stream":
                messages = [json.loads(d) for d in parse_sse(text) if d.strip()]
            elif ctype == "application/json":
                messages = [json.loads(text)]
            else:
                raise McpError(f"MCP server {self.name!r}: {method} answered with content type {ctype or 'none'!r} "
                               "(Streamable HTTP replies are application/json or text/event-stream)")
        except json.JSONDecodeError as e:
            raise McpError(f"MCP server {self.name!r}: {method} reply is not JSON ({e}): {text[:200]!r}") from None
        flat: list[Any] = []
        for m in messages:
            flat += m if isinstance(m, list) else [m]
        response = None
        for m in flat:
            if not isinstance(m, dict):
                continue
            if m.get("id") == rid and ("result" in m or "error" in m):
                response = m
            elif "method" in m and "id" not in m:
                self.notifications.append(m)
                del self.notifications[:-MAX_NOTIFICATIONS]
        if response is None:
            raise McpError(f"MCP server {self.name!r}: no JSON-RPC response to {method} (id {rid}) in its reply: {text[:200]!r}")
        if "error" in response:
            raise _rpc_error(self.name, method, response["error"])
        return response["result"], r.headers

    async def _post(self, msg: dict[str, Any], method: str) -> http.Response:
        sid = self.session_id
        try:
            r = await http.fetch(self.url, "POST", headers=self._headers(sid), body=json.dumps(msg))
        except HttpError as e:  # refused by the host's allowlist, or the fetch failed
            hint = ""
            if "allowlist" in str(e) or "disabled" in str(e):
                hint = (" (configure the server as [mcp.servers.NAME] url = \"...\" in the server config, "
                        "which allows exactly that URL, or add its host to [http] allow_hosts)")
            raise McpError(f"cannot reach MCP server {self.name!r} at {self.url}: {e}{hint}") from e
        if r.status == 404 and sid is not None and method != "initialize":
            raise _SessionExpired()
        if not r.ok:
            err = None
            try:
                body = json.loads(r.body)
                err = body.get("error") if isinstance(body, dict) else None
            except ValueError:
                pass
            if isinstance(err, dict):
                raise _rpc_error(self.name, method, err, f" (HTTP {r.status})")
            raise McpError(f"MCP server {self.name!r}: {method} failed with HTTP {r.status}: {r.text()[:200]!r}")
        return r


class _SessionExpired(Exception):
    """HTTP 404 on a request with a session id (spec: start a new session)."""


def _rpc_error(name: str, method: str, err: Any, suffix: str = "") -> McpError:
    if not isinstance(err, dict):
        return McpError(f"MCP server {name!r}: {method} failed: {str(err)[:200]}{suffix}")
    code = err.get("code") if isinstance(err.get("code"), int) else None
    return McpError(f"MCP server {name!r}: {method} failed: {err.get('message', '')} (JSON-RPC error {code}){suffix}",
                    code, err.get("data"))
