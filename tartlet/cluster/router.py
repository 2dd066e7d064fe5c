"""The Ray Serve request router of the replica deployment: it reads the
``route`` keyword argument that the gateway passes with every call and asks
:class:`~tartlet.cluster.routing.RoutingPolicy` for the replica.

Ray Serve builds one router per deployment handle, in the process that
holds the handle (the gateway); :data:`ROUTERS` lets the gateway there ask
which replicas are running (:func:`live_replicas`)."""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .routing import ReplicaGone, Route, RoutingPolicy

#: The routers of this process (normally one: the gateway's handle to the replicas).
ROUTERS: "weakref.WeakSet[TartletRouter]" = weakref.WeakSet()


class _QuietReplicaGone(logging.Filter):
    """Ray Serve logs an exception that ends a routing task with its
    traceback; a :class:`ReplicaGone` is an expected outcome, already
    returned to the caller."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ReplicaGone))


#: The filter on Ray Serve's logger (one object, so adding it again is a no-op).
QUIET = _QuietReplicaGone()


def live_replicas() -> list[str]:
    """Ids of the replicas the routers of this process know as running."""
    seen: dict[str, None] = {}
    for router in list(ROUTERS):
        for rid in router.curr_replicas:
            seen[rid.unique_id] = None
    return list(seen)


def load() -> dict[str, int]:
    """Requests in flight per replica, as the routers of this process count them."""
    out: dict[str, int] = {}
    for router in list(ROUTERS):
        for replica, n in list(router.policy.in_flight.items()):
            out[replica] = out.get(replica, 0) + n
    return out


def release(key: str) -> None:
    """The request or session held under ``key`` (``route["hold"]``) ended:
    it no longer counts on its replica."""
    for router in list(ROUTERS):
        router.release(key)


def _route(pending: PendingRequest | None) -> Route | None:
    if pending is None:
        return None
    route = pending.kwargs.get("route")
    return route if isinstance(route, dict) else None  # type: ignore[return-value]


class TartletRouter(RequestRouter):
    """Routes by :class:`~tartlet.cluster.routing.Route` (``route=`` of each
    call): pinned calls to their replica, the rest by load, then session,
    snapshot and prefix affinity (see :mod:`tartlet.cluster.routing`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.policy = RoutingPolicy()
        self._held: dict[str, str] = {}  # route["hold"] key -> the replica it counts on
        self._lock = threading.Lock()
        # Ray Serve may ship this class by value (cloudpickle), with globals of
        # its own: register in the imported module, where live_replicas looks.
        import tartlet.cluster.router as registry

        registry.ROUTERS.add(self)
        logging.getLogger("ray.serve").addFilter(registry.QUIET)

    def initialize_state(self, imbalance_threshold: int = 4, imbalance_ratio: float = 1.5, **kwargs: Any) -> None:
        """Ray Serve passes ``request_router_kwargs`` here."""
        self.policy.imbalance_threshold = imbalance_threshold
        self.policy.imbalance_ratio = imbalance_ratio

    async def _select_from_candidate_replicas(self, candidates: list[RunningReplica], backoff_index: int) -> RunningReplica | None:
        """The first candidate, without Ray's queue-length probe: the policy
        has ranked them by its own count of requests in flight, and a probe
        can time out (0.1-1 s deadline) while a replica is busy loading or
        the machine is saturated, which left requests waiting for tens of
        seconds on a 2-core machine. (Overrides a private hook of the
        pinned Ray Serve 2.60.)"""
        for r in candidates:
            if r.replica_id in self.curr_replicas:
                return r
        return None

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        route = _route(pending_request)
        pin = route.get("pin") if route else None
        if pin is not None and pin not in by_id and pending_request is not None:
            # Gone for good (a replacement gets a new id). Returning no
            # candidate would make Ray retry at once, forever, on the router's
            # event loop: fail the request instead, and end this routing task.
            err = ReplicaGone(pin)
            if not pending_request.future.done():
                pending_request.future.set_exception(err)
            raise err
        order = self.policy.choose(list(by_id), route)
        if order and route:
            self._decided(order[0], route)
        return [[by_id[r]] for r in order]

    def _decided(self, replica: str, route: Route) -> None:
        """``replica`` will get the request (the first candidate is the one
        taken, see :meth:`_select_from_candidate_replicas`): remember its
        affinities, and count it in flight under ``route["hold"]`` until
        :meth:`release`. Counting here, not in Ray's routed/completed
        callbacks: the completion of a short call could be lost under load
        (its callback registered after it ended), which left it counted for
        ever and skewed every later choice."""
        key = route.get("hold")
        with self._lock:
            if key is not None:
                prev = self._held.get(key)
                if prev == replica:
                    return
                if prev is not None:  # chosen again (a retry): move the count
                    self.policy.add(prev, -1)
                self._held[key] = replica
                self.policy.add(replica, 1)
            self.policy.remember(replica, route)

    def release(self, key: str) -> None:
        """Stop counting what was held under ``key``."""
        with self._lock:
            replica = self._held.pop(key, None)
        if replica is not None:
            self.policy.add(replica, -1)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.policy.forget(replica_id.unique_id)
        with self._lock:
            for key in [k for k, r in self._held.items() if r == replica_id.unique_id]:
                del self._held[key]
        super().on_replica_actor_died(replica_id)
