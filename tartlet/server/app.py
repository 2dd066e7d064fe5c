"""The ASGI app (Starlette) and ``serve``: one process, one event loop,
WebSocket ``/ws`` (:mod:`tartlet.protocol`), the OpenAI-compatible
``/v1`` routes, ``/health`` and ``/metrics``, served by uvicorn.

Every HTTP request writes one access-log line (logger ``tartlet.access``:
method, path, status, milliseconds, user) to stderr. Errors under ``/v1``
are OpenAI-shaped JSON (``{"error": {"message", "type", "param",
"code"}}``), 404 and 405 included; an unhandled exception is a 500
logged with its traceback (logger ``tartlet.server.app``)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute

from ..host.state import HostState, gc_for_serving
from . import metrics
from .config import ServerConfig
from .embeddings_api import EmbeddingsRoutes
from .memory_budget import machine_ram, memory_warnings, user_count
from .openai_api import OpenAiRoutes
from .openai_errors import ApiError
from .responses_api import ResponsesRoutes
from .service import Service
from .ws import ws_endpoint
from .ws_protocol import protocol_class

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)
access_log = logging.getLogger("tartlet.access")


class AccessLog:
    """ASGI middleware: one ``tartlet.access`` line per HTTP request
    (``METHOD PATH STATUS MS user=USER``); the user is what a route stored in
    ``request.state.user`` (``-`` when none)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            user = (scope.get("state") or {}).get("user", "-")
            ms = (time.perf_counter() - t0) * 1000
            access_log.info("%s %s %d %.1fms user=%s", scope.get("method"), scope.get("path"), status[0], ms, user)


_ERROR_KIND = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error", 405: "invalid_request_error"}


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's 404/405 (and other HTTP errors): OpenAI-shaped JSON under
    ``/v1``, plain text elsewhere."""
    assert isinstance(exc, HTTPException)
    if not request.url.path.startswith("/v1"):
        return PlainTextResponse(str(exc.detail), status_code=exc.status_code, headers=exc.headers)
    if exc.status_code == 404:
        msg, code = f"unknown URL: {request.method} {request.url.path}", "unknown_url"
    elif exc.status_code == 405:
        msg, code = f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    err = ApiError(exc.status_code, msg, code=code, kind=_ERROR_KIND.get(exc.status_code, "invalid_request_error"), headers=exc.headers)
    return err.response()


async def server_error(request: Request, exc: Exception) -> Response:
    """An unhandled exception: logged with its traceback, a 500 with no
    exception details."""
    log.error("500 on %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(500, "internal server error (see the server log)", code="internal_error", kind="server_error").response()


def setup_logging() -> None:
    """Send ``tartlet.*`` INFO and above to stderr (once)."""
    root = logging.getLogger("tartlet")
    if not root.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(h)
        root.setLevel(logging.INFO)
        root.propagate = False


def build_app(service: Service) -> Starlette:
    """The Starlette app serving ``service``."""
    oa = OpenAiRoutes(service)
    responses = ResponsesRoutes(oa)
    embeddings = EmbeddingsRoutes(oa)

    async def health(request: Request) -> Response:
        body = {"status": "ok", "models": list(service.state.models), "running_instances": service.running(), "auth": service.auth}
        if service.replica_id is not None:  # tartlet serve --replicas: which replica, and its process
            body.update(replica=service.replica_id, pid=os.getpid())
        return JSONResponse(body)

    registry = metrics.make_registry(service)

    async def metrics_route(request: Request) -> Response:
        body, content_type = metrics.render(registry, request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    routes = [
        WebSocketRoute("/ws", ws_endpoint),
        Route("/health", health),
        Route("/metrics", metrics_route),
        Route("/v1/models", oa.models),
        Route("/v1/models/{model:path}", oa.model),
        Route("/v1/chat/completions", oa.chat, methods=["POST"]),
        Route("/v1/completions", oa.completions, methods=["POST"]),
        Route("/v1/embeddings", embeddings.create, methods=["POST"]),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.add_middleware(AccessLog)
    app.state.service = service
    return app


def load_state(cfg: ServerConfig, progress: Callable[[str], None] | None = None) -> HostState:
    """Load every configured model and open the store (PostgreSQL when
    ``[store] url`` is set, else the SQLite file ``store_path``) and HTTP fetcher.

    Raises:
        tartlet.engine.loading.loader.ModelLoadError: a model cannot be loaded.
        tartlet.sdk.errors.StoreError: ``[store] url`` cannot be reached.
    """
    from ..engine.core.engine import Engine
    from ..host.messaging import MessageBus
    from ..host.state import HostState
    from ..host.store import Store

    state = HostState()
    for m in cfg.models:
        state.add_engine(Engine.load(m.engine_config(), progress=progress), name=m.model, speculative=m.speculative_settings())
    lim = cfg.limits
    if cfg.store.url:  # replicas share topics through PostgreSQL
        from ..host.pg_messaging import PgMessageBus

        state.bus = PgMessageBus(cfg.store.url, lim.max_messaging_bytes_per_user, lim.max_topics_per_user)
    else:
        state.bus = MessageBus(lim.max_messaging_bytes_per_user, lim.max_topics_per_user)
    Path(cfg.data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)  # a new data dir is the server user's only
    if cfg.store.url:  # shared by replicas; psycopg is imported only here
        from ..host.pg_store import PgStore

        state.store = PgStore(cfg.store.url, lim.max_store_bytes_per_user, lim.max_store_keys_per_user)
    else:
        state.store = Store(cfg.store_path, lim.max_store_bytes_per_user, lim.max_store_keys_per_user)
    configure_http(state, cfg)
    configure_code(state, cfg)
    state.rates = lim.rate_limits()  # Service turns them off without auth
    return state


def configure_code(state: HostState, cfg: ServerConfig) -> None:
    """Give ``state`` the code sandbox of ``[code]`` (None when disabled);
    nothing is built until an inferlet first runs code."""
    from ..host.code_sandbox import CodeSandbox

    c = cfg.code
    if state.code_sandbox is not None:
        state.code_sandbox.close()
    state.code_sandbox = (
        CodeSandbox(
            c.max_time_s, c.max_memory_mb, c.default_memory_mb, c.max_output_bytes, c.workers, c.max_pending_per_user,
            c.max_running_per_user,
        )
        if c.enabled else None
    )  # fmt: skip


def configure_http(state: HostState, cfg: ServerConfig) -> None:
    """Give ``state`` (a HostState) the HTTP fetcher of inferlets and the
    MCP servers they may open: ``[http]`` bounds every fetch; each
    ``[mcp.servers.NAME] url`` is allowed to every inferlet (that endpoint
    only, not its whole host), with the server's ``headers`` added by the
    host (inferlets never see them), and listed by name
    (``tartlet.sdk.mcp.available_servers()``)."""
    from ..host.http import HttpFetcher, HttpPolicy

    h, mcp = cfg.http, cfg.mcp.servers
    endpoints = {s.url: dict(s.headers) for s in mcp.values()}
    state.http = HttpFetcher(HttpPolicy(list(h.allow_hosts), h.max_response_bytes, h.max_request_bytes, h.timeout_s, endpoints))
    state.mcp_servers = {name: s.url for name, s in mcp.items()}


def listen_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free port; read
    it with ``getsockname()``), IPv6 when the host has a colon.

    Its protocol is spelled ``IPPROTO_TCP`` (not 0): asyncio turns Nagle's
    algorithm off (``TCP_NODELAY``) only on sockets whose ``proto`` says
    TCP, and accepted connections inherit it. With Nagle on, a second small
    write (a WebSocket ``exit`` event after a launch reply, an HTTP body
    after its headers, the next streamed chunk) waited for the client's
    delayed ACK: ~40 ms on Linux."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def http_server(cfg: ServerConfig, service: Service) -> uvicorn.Server:
    """The uvicorn server of ``tartlet serve`` for ``service`` (not started)."""
    import uvicorn

    return uvicorn.Server(uvicorn.Config(
        build_app(service), log_level="warning", lifespan="off", ws_max_size=cfg.limits.max_message_bytes,
        ws=protocol_class(), loop="asyncio", timeout_graceful_shutdown=5,
    ))


async def run_http(server: uvicorn.Server, sock: socket.socket, service: Service) -> None:
    """Serve on ``sock`` until ``server.should_exit``, then end the service's
    instances and close its key store."""
    try:
        await server.serve(sockets=[sock])
    finally:
        try:
            await service.shutdown()
        finally:
            service.keys.close()


def close_state(state: HostState) -> None:
    """Release what :func:`load_state` opened: engines, HTTP client, store,
    the PostgreSQL message bus (its waiting pulls fail)."""
    state.close()
    close_bus = getattr(state.bus, "close", None)  # PgMessageBus; the in-process bus has nothing to release
    if close_bus is not None:
        close_bus()
    if state.http is not None:
        state.http.close()
    if state.store is not None:
        state.store.close()


def serve(cfg: ServerConfig, auth: bool = True, announce: Callable[[str], None] | None = None) -> None:
    """Load the models and serve until interrupted (SIGINT/SIGTERM).

    Prints ``tartlet serving on http://HOST:PORT`` once listening (the real
    port when ``cfg.port`` is 0).
    """
    setup_logging()
    state = load_state(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    service = Service(cfg, state, auth=auth)
    gc_for_serving()  # what is loaded lives as long as the server: collections skip it
    for warning in memory_warnings(cfg, user_count(service.keys, service.auth), machine_ram()):
        log.warning("%s", warning)
    sock = listen_socket(cfg.host, cfg.port)
    port = sock.getsockname()[1]
    server = http_server(cfg, service)
    (announce or (lambda s: print(s, flush=True)))(f"tartlet serving on http://{cfg.host}:{port} (auth {'on' if service.auth else 'off'})")
    try:
        asyncio.run(run_http(server, sock, service))
    finally:
        close_state(state)
