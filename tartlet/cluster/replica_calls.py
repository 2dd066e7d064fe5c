"""What the gateway and its WebSocket fan-out share about calling replicas:
Ray Serve calls under a fresh request id, what a lost replica looks like,
the fan-out timeout, and the ASGI callables' types."""

from __future__ import annotations

import contextvars
import uuid
from typing import Any, Awaitable, Callable

from .routing import ReplicaGone

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: Seconds a call to one replica for ``/health``, ``/metrics`` or ``list`` may take.
FANOUT_TIMEOUT_S = 30.0
#: What a lost replica's instances and unanswered requests report.
REPLICA_LOST = "replica_lost"


def is_replica_lost(e: BaseException) -> bool:
    """Whether ``e`` (raised by a Ray Serve call) means the replica died or
    cannot be reached (Ray's actor errors), not that the request failed."""
    import ray.exceptions

    return isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError, ReplicaGone))


def call(method: Any, *args: Any, **kwargs: Any) -> Any:
    """``method.remote(*args, **kwargs)`` under a fresh Ray Serve internal
    request id. Ray Serve 2.60 gives every handle call made while serving one
    incoming request that request's internal id, and its request router
    indexes pending calls by that id: of two calls in flight at once (the
    health fan-out, a WebSocket session's stream and its frames) the second
    was never assigned a replica. (Sets a private context field of the
    pinned Ray version, in a copied context.)"""

    def go() -> Any:
        from ray.serve import context

        context._set_request_context(_internal_request_id=uuid.uuid4().hex)
        return method.remote(*args, **kwargs)

    return contextvars.copy_context().run(go)


def header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None
