"""``tartlet serve --replicas N``: connect to Ray (``[cluster] ray_address``,
else ``$RAY_ADDRESS``, else a local Ray instance started here and stopped
on exit), run the Tartlet application on Ray Serve
(:func:`tartlet.cluster.deployments.build_application`), its gateway
listening on ``host:port``, and serve until SIGINT/SIGTERM; then delete the
application (each replica ends its instances, finishes its snapshot writes
and closes its store) and shut Ray Serve down."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from typing import Callable

from ..server.config import ServerConfig

log = logging.getLogger(__name__)

#: The Ray Serve application's name.
APP_NAME = "tartlet"
#: Ray Serve's controller loop period, seconds, for a Ray instance started
#: here (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``; Ray's default 0.1): the loop
#: reconciles deployments and took 2.6% of a core on 2 vCPUs under load,
#: CPU the replicas' engines want; at 0.5 s, 1.1%, and a dead replica is
#: still replaced within its health-check period (10 s). An explicit
#: setting in the environment wins; a cluster started with ``ray start``
#: takes the variable from the environment of its own processes.
CONTROL_LOOP_INTERVAL_S = "0.5"


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (Ray Serve's proxy cannot bind port 0)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def start(cfg: ServerConfig, auth: bool = True) -> tuple[int, bool]:
    """Start Ray (or join it) and deploy the application; returns the HTTP
    port and whether Ray was started here (so :func:`stop` shuts it down).

    Raises:
        RuntimeError: the application failed to deploy (a replica could not
            load its model, say); Ray's message says why.
    """
    import ray
    from ray import serve

    from .deployments import build_application

    address = cfg.cluster.ray_address or os.environ.get("RAY_ADDRESS") or None
    started_here = address is None
    if started_here:  # inherited by the processes of the Ray instance started below
        os.environ.setdefault("RAY_SERVE_CONTROL_LOOP_INTERVAL_S", CONTROL_LOOP_INTERVAL_S)
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True, namespace="tartlet")
    port = cfg.port or free_port(cfg.host)
    # the gateway deployment serves HTTP itself: no Ray Serve proxy
    serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
    node_ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    serve.run(build_application(cfg, auth, port, node_ip), name=APP_NAME, route_prefix=None, blocking=False)
    return port, started_here


def stop(started_here: bool) -> None:
    """Delete the application (graceful: replicas run their shutdown), stop
    Ray Serve, and Ray itself when :func:`start` started it."""
    import ray
    from ray import serve

    try:
        serve.delete(APP_NAME)
        serve.shutdown()  # type: ignore[no-untyped-call]
    finally:
        if started_here:
            ray.shutdown()


def serve_cluster(cfg: ServerConfig, auth: bool = True, announce: Callable[[str], None] | None = None) -> None:
    """Run ``tartlet serve --replicas N`` until SIGINT or SIGTERM.

    Prints ``tartlet serving on http://HOST:PORT (auth on|off, N replicas on
    Ray Serve)`` once every replica is ready.
    """
    from ..server.app import setup_logging

    setup_logging()
    port, started_here = start(cfg, auth)
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: done.set())
    try:
        c = cfg.cluster
        n = f"{c.min_replicas}-{c.max_replicas}" if c.min_replicas is not None or c.max_replicas is not None else str(max(c.replicas, 1))
        (announce or (lambda s: print(s, flush=True)))(
            f"tartlet serving on http://{cfg.host}:{port} (auth {'on' if auth and cfg.auth.enabled else 'off'}, {n} replicas on Ray Serve)"
        )
        while not done.wait(0.5):
            time.sleep(0)
    finally:
        stop(started_here)
