"""Which replica serves a request: the routing policy of ``tartlet serve
--replicas N``, apart from Ray (the Ray Serve request router,
:mod:`tartlet.cluster.router`, calls it; tests call it directly).

The gateway describes each request by a :class:`Route` (a plain dict on the
wire): a replica it must reach (``pin``: a WebSocket session's own replica,
or the replica that runs a named instance), an affinity key (``session``:
the OpenAI ``user`` field or an ``x-tartlet-session`` header), the
cumulative hashes of the prompt's blocks (``prefix``, see
:func:`chat_prefix` and :func:`text_prefix`) and a named snapshot the
request opens (``snapshot``).

Load comes first: a replica whose requests in flight lead the least loaded
replica's by more than ``imbalance_threshold`` and by more than
``imbalance_ratio`` times is not eligible. Among the others
the policy prefers, in order, the replica of the session, the one that
holds the snapshot, and the one whose remembered prefixes match the longest
run of the request's leading blocks (each block hash remembers the replicas
it was routed to, and when); among replicas that match alike, the one that
got it most recently (a replica's page pool evicts the least recently used
pages, so a prefix that load once sent to a second replica is soon gone
there and keeps its home), unless each got it within the last
:data:`FRESH_REQUESTS` requests (a system prompt shared by every
conversation matches every replica alike, and does not pull all of them
onto one). Ties and
requests with no affinity go to the least loaded replica (a random one among
equals). What a replica holds is learnt from the routing decisions
themselves (as Ray Serve LLM's ``PrefixCacheAffinityRouter`` does), not
reported by the replicas: a prefix evicted from a replica's page pool is
still remembered until the bounded maps forget it (least recently used).
"""

from __future__ import annotations

import collections
import hashlib
import json
import random
import threading
from typing import Any, Iterable, TypedDict

#: The routing policy that ignores affinity (see :class:`Route`).
POWER_OF_TWO = "power-of-two"
#: Characters per block of a completion prompt's prefix hashes.
TEXT_BLOCK_CHARS = 256
#: Block hashes remembered (least recently used forgotten first).
MAX_PREFIX_ENTRIES = 200_000
#: Requests (with a prompt prefix) within which replicas that got a prefix
#: count as equally likely to hold it (see :meth:`RoutingPolicy._prefix_holder`).
FRESH_REQUESTS = 4
#: Session and snapshot keys remembered.
MAX_KEYS = 100_000


class ReplicaGone(ConnectionError):
    """A request pinned to a replica that is no longer running (it died or
    was replaced): it fails at once instead of waiting for that replica."""

    def __init__(self, replica: str) -> None:
        super().__init__(f"replica {replica} is not running")
        self.replica = replica


class Route(TypedDict, total=False):
    """What the gateway tells the router of one request (every key optional).

    Attributes:
        pin: the id of the only replica that may serve it.
        session: an affinity key: requests with the same key go to the
            same replica while load allows.
        prefix: hex hashes of the prompt's leading blocks, each chained
            with the ones before (so equal hashes mean equal prefixes).
        snapshot: ``"<user>/<name>"`` of a named snapshot the request opens.
        policy: ``"power-of-two"``: ignore affinity and pick the less loaded
            of two random replicas (Ray Serve's default router, on this
            router's own counts of requests in flight): the baseline that
            ``benchmarks/bench_cluster.py`` compares with.
        hold: a key under which the request counts in flight on the chosen
            replica until the gateway releases it (a streamed response, a
            WebSocket session).
    """

    pin: str
    session: str
    prefix: list[str]
    snapshot: str
    policy: str
    hold: str


def _chain(parts: Iterable[bytes], seed: str) -> list[str]:
    h = hashlib.sha256(seed.encode()).digest()
    out = []
    for part in parts:
        h = hashlib.sha256(h + part).digest()
        out.append(h.hex()[:32])
    return out


def chat_prefix(body: dict[str, Any]) -> list[str]:
    """The prefix hashes of a chat completion request body: one per message
    (role, content, tool calls: canonical JSON), chained, seeded with the
    model name and the tool definitions (they are rendered before the
    messages). An unreadable body gives ``[]``."""
    msgs = body.get("messages")
    if not isinstance(msgs, list):
        return []
    seed = json.dumps([body.get("model"), body.get("tools")], sort_keys=True, default=str)
    parts = []
    for m in msgs:
        if not isinstance(m, dict):
            break
        parts.append(json.dumps([m.get("role"), m.get("content"), m.get("tool_calls")], sort_keys=True, default=str).encode())
    return _chain(parts, seed)


def text_prefix(body: dict[str, Any]) -> list[str]:
    """The prefix hashes of a completion request body: one per
    :data:`TEXT_BLOCK_CHARS` characters of its prompt (a string, or the
    first of a list of strings), chained, seeded with the model name."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        return []
    blocks = [prompt[i:i + TEXT_BLOCK_CHARS].encode() for i in range(0, len(prompt), TEXT_BLOCK_CHARS)]
    return _chain(blocks, json.dumps(body.get("model"), default=str))


class _Lru:
    """A bounded map, least recently used dropped first."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.d: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, k: str) -> Any:
        v = self.d.get(k)
        if v is not None:
            self.d.move_to_end(k)
        return v

    def put(self, k: str, v: Any) -> None:
        self.d[k] = v
        self.d.move_to_end(k)
        while len(self.d) > self.cap:
            self.d.popitem(last=False)


class RoutingPolicy:
    """Chooses replicas and remembers what it sent where.

    Args:
        imbalance_threshold: requests in flight by which a replica may lead
            the least loaded one and still be chosen for affinity
            (``[cluster] imbalance_threshold``) ...
        imbalance_ratio: ... or by which factor (``[cluster]
            imbalance_ratio``); past both, the least loaded wins.
        rng: random source for ties (tests pass a seeded one).
        fresh_requests: prefixed requests routed to a replica since it got a
            prefix within which it counts as holding it as surely as any
            other (:data:`FRESH_REQUESTS`).
    """

    def __init__(self, imbalance_threshold: int = 4, rng: random.Random | None = None, imbalance_ratio: float = 1.5,
                 fresh_requests: int = FRESH_REQUESTS) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.fresh_requests = fresh_requests
        self.imbalance_ratio = imbalance_ratio
        self.rng = rng or random.Random()
        self.in_flight: dict[str, int] = collections.defaultdict(int)
        # Ray Serve reports routing on its router thread, the gateway holds
        # requests on its own event loop's thread: counts change under a lock
        self._lock = threading.Lock()
        self._prefix = _Lru(MAX_PREFIX_ENTRIES)  # block hash -> {replica id: its _count when it last got the block}
        self._count: dict[str, int] = collections.defaultdict(int)  # requests with a prefix routed to each replica
        self._session = _Lru(MAX_KEYS)  # session key -> replica id
        self._snapshot = _Lru(MAX_KEYS)  # "user/name" -> replica id

    def choose(self, candidates: list[str], route: Route | None) -> list[str]:
        """The replicas to try for ``route``, best first (empty: a pinned
        replica that is not among ``candidates``, i.e. gone).

        Args:
            candidates: ids of the replicas that may take requests now.
            route: the request's :class:`Route` (None: no affinity).
        """
        route = route or {}
        pin = route.get("pin")
        if pin is not None:
            return [pin] if pin in candidates else []
        if not candidates:
            return []
        load = {r: self.in_flight.get(r, 0) for r in candidates}
        if route.get("policy") == POWER_OF_TWO:
            two = self.rng.sample(candidates, min(2, len(candidates)))
            return sorted(two, key=lambda r: load[r])
        floor = min(load.values())
        eligible = [r for r in candidates if not self._overloaded(load[r], floor)]
        for key, table in (("session", self._session), ("snapshot", self._snapshot)):
            k = route.get(key)
            if isinstance(k, str):
                r = table.get(k)
                if r in eligible:
                    return [r, *self._by_load([c for c in candidates if c != r], load)]
        prefix = route.get("prefix") or []
        if prefix and len(eligible) > 1:
            first = self._prefix_holder(prefix, eligible, load)
            if first is not None:
                return [first, *self._by_load([c for c in candidates if c != first], load)]
        return self._by_load(eligible, load) + self._by_load([c for c in candidates if c not in eligible], load)

    def _prefix_holder(self, prefix: list[str], eligible: list[str], load: dict[str, int]) -> str | None:
        """The replica among ``eligible`` likeliest to hold ``prefix``'s
        pages, or None (no affinity: none of them matches, or all match
        alike). First the longest run of leading blocks remembered on the
        replica; among replicas tied there, the one that got the last
        matched block the fewest requests ago (its page pool evicts least
        recently used pages first, so a prefix it got once, when load sent
        it there, and not since is likely gone); replicas that got it within
        the last ``fresh_requests`` requests count as equally fresh, and
        load picks among them (a system prompt in every request matches
        every replica alike and does not pull new conversations onto one)."""
        matched = {r: 0 for r in eligible}
        live = set(eligible)
        last: dict[str, int] = {}
        for h in prefix:
            holders = self._prefix.get(h)
            live &= holders.keys() if holders is not None else set()
            if not live:
                break
            for r in live:
                matched[r] += 1
                last[r] = holders[r]
        best = max(matched.values())
        if best == 0:
            return None
        age = {r: max(0, self._count[r] - last[r] - self.fresh_requests) for r in eligible if matched[r] == best}
        youngest = min(age.values())
        top = [r for r in age if age[r] == youngest]
        if len(top) == len(eligible):
            return None
        return self._by_load(top, load)[0]

    def _overloaded(self, n: int, floor: int) -> bool:
        """Whether a replica with ``n`` requests in flight leads the least
        loaded (``floor``) too far to be chosen for affinity: by more than
        ``imbalance_threshold`` requests *and* by more than
        ``imbalance_ratio`` times (SGLang's router uses the same two-sided
        rule, ``balance_abs_threshold`` and ``balance_rel_threshold``). An
        idle replica takes the request from one holding more than
        ``imbalance_threshold`` requests; two busy replicas a few requests
        apart keep their affinity. So at low load affinity may put up to
        ``imbalance_threshold`` + 1 requests on one replica while another
        is idle (a system prompt that only one replica has seen yet
        attracts new conversations until then)."""
        return n - floor > self.imbalance_threshold and n > self.imbalance_ratio * floor

    def _by_load(self, replicas: list[str], load: dict[str, int]) -> list[str]:
        shuffled = list(replicas)
        self.rng.shuffle(shuffled)
        return sorted(shuffled, key=lambda r: load.get(r, 0))

    def add(self, replica: str, n: int) -> None:
        """Count ``n`` more (or, negative, fewer) requests in flight on ``replica`` (never below 0)."""
        with self._lock:
            self.in_flight[replica] = max(0, self.in_flight.get(replica, 0) + n)

    def routed(self, replica: str, route: Route | None) -> None:
        """Remember that a request with ``route`` went to ``replica`` and
        count it in flight until :meth:`completed`."""
        self.add(replica, 1)
        self.remember(replica, route)

    def remember(self, replica: str, route: Route | None) -> None:
        """Remember ``route``'s affinities (session, snapshot, prefix) to ``replica``."""
        route = route or {}
        if route.get("pin") is not None or route.get("policy") == POWER_OF_TWO:
            return
        if isinstance(route.get("session"), str):
            self._session.put(route["session"], replica)
        if isinstance(route.get("snapshot"), str):
            self._snapshot.put(route["snapshot"], replica)
        prefix = route.get("prefix") or []
        if not prefix:
            return
        self._count[replica] += 1
        stamp = self._count[replica]
        for h in prefix:
            holders = self._prefix.get(h)
            if holders is None:
                self._prefix.put(h, {replica: stamp})
            else:
                holders[replica] = stamp

    def completed(self, replica: str) -> None:
        """A request routed to ``replica`` ended."""
        self.add(replica, -1)

    def forget(self, replica: str) -> None:
        """``replica`` is gone: drop its load and every affinity to it."""
        with self._lock:
            self.in_flight.pop(replica, None)
        self._count.pop(replica, None)
        for table in (self._session, self._snapshot):
            for k in [k for k, v in table.d.items() if v == replica]:
                del table.d[k]
        for k, holders in list(self._prefix.d.items()):
            holders.pop(replica, None)
            if not holders:
                del self._prefix.d[k]
