"""The Ray Serve application of ``tartlet serve --replicas N``: a
:class:`TartletReplica` deployment (each replica is today's server: engines,
runtime, host state and the Starlette app, fed by
:class:`~tartlet.cluster.tunnel.ReplicaTunnel`) routed by
:class:`~tartlet.cluster.router.TartletRouter`, behind one
:class:`TartletGateway` deployment that serves HTTP itself
(:mod:`tartlet.cluster.gateway`; Ray Serve's own HTTP proxy is not started).

Ray Serve gives the replicas, their placement (``num_cpus`` =
``[cluster] threads_per_replica``), health checks (:meth:`TartletReplica.check_health`),
restarts and autoscaling (``[cluster] min_replicas`` / ``max_replicas``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.config import RequestRouterConfig

from ..server.config import ServerConfig

log = logging.getLogger(__name__)

#: Seconds between Ray Serve's health checks of a replica.
HEALTH_CHECK_PERIOD_S = 2.0
#: Requests (streams, WebSocket sessions) one replica may hold at once:
#: Tartlet bounds work per user itself ([limits]); Ray's default of 5 would
#: queue the sixth stream behind the first five.
MAX_ONGOING_REQUESTS = 4096
#: Ray Serve's own logs: warnings only, no per-call access lines (each
#: replica's ``tartlet.access`` log names every HTTP request).
LOGGING = {"log_level": "WARNING", "enable_access_log": False}


class TartletReplica:
    """One replica: loads the models and serves forwarded requests.

    Args:
        cfg_json: the :class:`ServerConfig` as JSON.
        auth: False to accept every client as user ``local``.
    """

    async def __init__(self, cfg_json: str, auth: bool) -> None:  # type: ignore[misc]  # Ray Serve awaits an async __init__
        from ..host.state import gc_for_serving
        from ..runtime.instance import set_instance_id_prefix
        from ..server.app import build_app, load_state, setup_logging
        from ..server.service import Service
        from .tunnel import ReplicaTunnel

        setup_logging()
        cfg = ServerConfig.model_validate_json(cfg_json)
        self.replica_id: str = serve.get_replica_context().replica_id.unique_id
        set_instance_id_prefix(self.replica_id)
        self.state = await asyncio.to_thread(load_state, cfg)
        self.service = Service(cfg, self.state, auth=auth, shared=True)
        gc_for_serving()  # the loaded models live as long as the replica: collections skip them
        self.service.replica_id = self.replica_id
        self.tunnel = ReplicaTunnel(build_app(self.service), self.replica_id)
        log.info("replica %s ready", self.replica_id)

    async def http(self, scope: dict[str, Any], body: bytes, route: Any = None) -> AsyncIterator[list[dict[str, Any]]]:
        """A forwarded HTTP request (see :meth:`ReplicaTunnel.http`)."""
        async for events in self.tunnel.http(scope, body):
            yield events

    async def http_start(self, gateway: str, key: str, scope: dict[str, Any], body: bytes, route: Any = None) -> str:
        """Start a forwarded HTTP request (see :meth:`ReplicaTunnel.http_start`)."""
        return self.tunnel.http_start(gateway, key, scope, body)

    async def http_cancel(self, key: str, route: Any = None) -> None:
        """A forwarded request's client went away."""
        self.tunnel.http_cancel(key)

    async def events(self, gateway: str, route: Any = None) -> AsyncIterator[list[tuple[str, dict[str, Any] | None]]]:
        """The events of ``gateway``'s requests here (see :meth:`ReplicaTunnel.events`)."""
        async for batch in self.tunnel.events(gateway):
            yield batch

    async def ws(self, conn: str, scope: dict[str, Any], route: Any = None) -> AsyncIterator[list[dict[str, Any]]]:
        """A forwarded WebSocket session (see :meth:`ReplicaTunnel.ws`)."""
        async for events in self.tunnel.ws(conn, scope):
            yield events

    async def ws_frames(self, conn: str, frames: list[str], route: Any = None) -> bool:
        """The client's frames for session ``conn`` (see :meth:`ReplicaTunnel.ws_frames`)."""
        return self.tunnel.ws_frames(conn, frames)

    async def check_health(self) -> None:
        """Ray Serve's health check: every engine's scheduler thread is alive.

        Raises:
            RuntimeError: an engine stopped (Ray Serve then replaces this replica).
        """
        for name, slot in self.state.models.items():
            if not slot.engine.scheduler.alive():
                raise RuntimeError(f"the engine of model {name!r} stopped")

    async def __del__(self) -> None:
        """Graceful shutdown: end the instances, finish snapshot writes, close the store."""
        from ..server.app import close_state

        try:
            await self.tunnel.close()
            await self.service.shutdown()
        finally:
            await asyncio.to_thread(close_state, self.state)


class TartletGateway:
    """The entry point: serves the gateway app (:mod:`tartlet.cluster.gateway`)
    with uvicorn on ``host:port`` itself, in its replica, rather than behind
    Ray Serve's HTTP proxy. Every streamed chunk then crosses one Ray Serve
    call (replica to gateway) instead of two, and the proxy's process is not
    on the path: on a 2-core machine that proxy took ~19% of a core at 64
    streams (docs/benchmarks.md). The deployment is placed on the node that
    ran ``tartlet serve``, so the announced address stays true across its
    restarts.

    Args:
        replicas: the replica deployment's handle.
        host, port: where to listen.
        max_body_bytes: ``[limits] max_message_bytes`` (request bodies and
            WebSocket frames).
        routing: ``[cluster] routing``.
    """

    async def __init__(self, replicas: Any, host: str, port: int, max_body_bytes: int, routing: str) -> None:  # type: ignore[misc]
        import uvicorn

        from ..server.app import listen_socket, setup_logging
        from .gateway import Gateway
        from .router import live_replicas, release

        setup_logging()
        self.app = Gateway(replicas, live_replicas, max_body_bytes, routing, release)
        self.server = uvicorn.Server(uvicorn.Config(
            self.app, log_level="warning", lifespan="off", ws_max_size=max_body_bytes, loop="asyncio", timeout_graceful_shutdown=5,
        ))  # fmt: skip
        self.task = asyncio.ensure_future(self.server.serve(sockets=[listen_socket(host, port)]))
        while not self.server.started and not self.task.done():
            await asyncio.sleep(0.01)
        if self.task.done():
            self.task.result()  # raises why it could not start (the port is taken, say)

    async def check_health(self) -> None:
        """Ray Serve's health check.

        Raises:
            RuntimeError: the HTTP server stopped.
        """
        if self.task.done():
            raise RuntimeError("the gateway's HTTP server stopped")

    async def __del__(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 10)
        except (asyncio.TimeoutError, Exception):
            self.task.cancel()


def build_application(cfg: ServerConfig, auth: bool, port: int, node_ip: str) -> Any:
    """The Ray Serve application (``serve.run`` it) for ``cfg``: ``[cluster]``
    replicas or autoscaling bounds, each replica's engines with
    ``threads_per_replica`` threads, and the gateway listening on
    ``cfg.host:port`` on the node at ``node_ip``."""
    c = cfg.cluster
    cfg = cfg.model_copy(deep=True)
    for m in cfg.models:
        m.threads = c.threads_per_replica
    scaling: dict[str, Any]
    if c.min_replicas is not None or c.max_replicas is not None:
        lo = c.min_replicas if c.min_replicas is not None else 1
        hi = c.max_replicas if c.max_replicas is not None else max(lo, c.replicas, 1)
        scaling = {"autoscaling_config": {
            "min_replicas": lo, "max_replicas": hi, "initial_replicas": min(max(c.replicas, lo, 1), hi),
            "target_ongoing_requests": c.target_ongoing_requests,
        }}  # fmt: skip
    else:
        scaling = {"num_replicas": max(c.replicas, 1)}
    replica: Any = serve.deployment(
        TartletReplica, name="TartletReplica", ray_actor_options={"num_cpus": c.threads_per_replica},
        max_ongoing_requests=MAX_ONGOING_REQUESTS, health_check_period_s=HEALTH_CHECK_PERIOD_S, logging_config=LOGGING,
        request_router_config=RequestRouterConfig(
            request_router_class="tartlet.cluster.router.TartletRouter",  # type: ignore[arg-type]  # Ray types it oddly; a str is documented
            request_router_kwargs={"imbalance_threshold": c.imbalance_threshold, "imbalance_ratio": c.imbalance_ratio},
        ),
        **scaling,
    )  # fmt: skip
    gateway: Any = serve.deployment(
        TartletGateway, name="TartletGateway", num_replicas=1, logging_config=LOGGING,
        ray_actor_options={"num_cpus": 0, "resources": {f"node:{node_ip}": 0.001}},
    )  # fmt: skip
    return gateway.bind(replica.bind(cfg.model_dump_json(), auth), cfg.host, port, cfg.limits.max_message_bytes, c.routing)
