"""The ASGI app (Starlette) and ``serve``: one process, one event loop,
WebSocket ``/ws`` (:mod:`tartlet.server.protocol`), the OpenAI-compatible
``/v1`` routes, ``/health`` and ``/metrics``, served by uvicorn."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
from pathlib import Path
from typing import Any, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route, WebSocketRoute

from ..runtime.config import ServerConfig
from . import metrics
from .openai_api import OpenAiRoutes
from .service import Service
from .ws import ws_endpoint

log = logging.getLogger(__name__)


def build_app(service: Service) -> Starlette:
    """The Starlette app serving ``service``."""
    oa = OpenAiRoutes(service)

    async def health(request: Request) -> Response:
        return JSONResponse({
            "status": "ok", "models": list(service.state.models), "running_instances": service.running(),
            "auth": service.auth,
        })

    async def metrics_route(request: Request) -> Response:
        return PlainTextResponse(metrics.render(service), media_type="text/plain; version=0.0.4")

    routes = [
        WebSocketRoute("/ws", ws_endpoint),
        Route("/health", health),
        Route("/metrics", metrics_route),
        Route("/v1/models", oa.models),
        Route("/v1/chat/completions", oa.chat, methods=["POST"]),
        Route("/v1/completions", oa.completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.state.service = service
    return app


def load_state(cfg: ServerConfig, progress: Callable[[str], None] | None = None) -> Any:
    """Load every configured model and open the store and HTTP fetcher.

    Raises:
        tartlet.engine.loader.ModelLoadError: a model cannot be loaded.
    """
    from ..engine.engine import Engine
    from ..host.http import HttpFetcher, HttpPolicy
    from ..host.state import HostState
    from ..host.store import Store

    from ..host.messaging import MessageBus

    state = HostState()
    for m in cfg.models:
        state.add_engine(Engine.load(m, progress=progress), name=m.model)
    lim = cfg.limits
    state.bus = MessageBus(lim.max_messaging_bytes_per_user, lim.max_topics_per_user)
    Path(cfg.data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)  # a new data dir is the server user's only
    state.store = Store(cfg.store_path)
    h = cfg.http
    state.http = HttpFetcher(HttpPolicy(list(h.allow_hosts), h.max_response_bytes, h.max_request_bytes, h.timeout_s))
    return state


def serve(cfg: ServerConfig, auth: bool = True, announce: Callable[[str], None] | None = None) -> None:
    """Load the models and serve until interrupted (SIGINT/SIGTERM).

    Prints ``tartlet serving on http://HOST:PORT`` once listening (the real
    port when ``cfg.port`` is 0).
    """
    import uvicorn

    state = load_state(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    service = Service(cfg, state, auth=auth)
    app = build_app(service)
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(1024)
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        app, log_level="warning", lifespan="off", ws_max_size=cfg.limits.max_message_bytes, loop="asyncio",
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    (announce or (lambda s: print(s, flush=True)))(f"tartlet serving on http://{cfg.host}:{port} (auth {'on' if service.auth else 'off'})")

    async def main() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:
            await service.shutdown()

    try:
        asyncio.run(main())
    finally:
        state.close()
        if state.http is not None:
            state.http.close()
        if state.store is not None:
            state.store.close()
