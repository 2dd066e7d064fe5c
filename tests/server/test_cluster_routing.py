"""The routing policy of ``tartlet serve --replicas`` (tartlet/cluster/routing.py)
and the gateway's metrics merge, without Ray: which replica each request
goes to, given what was routed before and the load."""

from __future__ import annotations

import random

import pytest

from tartlet.cluster.routing import RoutingPolicy, chat_prefix, text_prefix


def _chat(*contents: str, model: str = "m") -> dict:
    roles = ["system", "user", "assistant"]
    return {"model": model, "messages": [{"role": roles[min(i, 1) if i < 2 else 2 - i % 2], "content": c} for i, c in enumerate(contents)]}


def test_prefix_hashes_chain_per_message():
    a = chat_prefix(_chat("sys", "hi"))
    b = chat_prefix(_chat("sys", "hi", "hello", "more"))
    assert len(a) == 2 and len(b) == 4 and b[:2] == a
    assert chat_prefix(_chat("sys", "hi", model="other"))[0] != a[0]  # the model seeds the chain
    assert chat_prefix(_chat("other sys", "hi"))[1] != a[1]  # chained: same message after another prefix differs
    assert chat_prefix({"messages": "nope"}) == []
    t = text_prefix({"model": "m", "prompt": "x" * 600})
    assert len(t) == 3 and text_prefix({"model": "m", "prompt": "x" * 512}) == t[:2]
    assert text_prefix({"model": "m", "prompt": "x" * 300})[:1] == t[:1]  # a partial last block is its own hash


def test_a_conversation_returns_to_the_replica_holding_its_prefix():
    p = RoutingPolicy(imbalance_threshold=4, rng=random.Random(0))
    replicas = ["a", "b"]
    turn1 = chat_prefix(_chat("shared system", "question 1"))
    first = p.choose(replicas, {"prefix": turn1})[0]
    p.routed(first, {"prefix": turn1})
    p.completed(first)
    turn2 = chat_prefix(_chat("shared system", "question 1", "answer 1", "question 2"))
    for _ in range(10):
        assert p.choose(replicas, {"prefix": turn2})[0] == first


def test_a_shared_system_prompt_does_not_pull_new_conversations_onto_one_replica():
    p = RoutingPolicy(imbalance_threshold=4, rng=random.Random(1))
    counts = {"a": 0, "b": 0}
    for i in range(40):  # 40 new conversations, all with one system prompt, each left running
        route = {"prefix": chat_prefix(_chat("shared system", f"question {i}"))}
        r = p.choose(["a", "b"], route)[0]
        p.routed(r, route)
        counts[r] += 1
    assert counts == {"a": 20, "b": 20}  # least loaded first: exactly even


def test_a_document_spilled_once_by_load_returns_to_its_home_replica():
    """Capacity-bound prefixes (more documents than one replica's page pool
    holds): load once sends document 7 to b; b then serves other documents
    (its pool evicts 7 first), so 7 goes home to a again, even with b less
    loaded, instead of counting as held by both for ever (which let every
    document drift onto both replicas and each pool thrash)."""
    p = RoutingPolicy(imbalance_threshold=2, rng=random.Random(6), fresh_requests=4)
    doc = lambda i: {"prefix": chat_prefix(_chat("document 7: a long reference text", f"question {i}"))}  # noqa: E731
    p.routed("a", doc(0))
    p.completed("a")
    p.add("a", 3)  # a busy: leads b by 3 > 2
    assert p.choose(["a", "b"], doc(1))[0] == "b"
    p.routed("b", doc(1))
    p.completed("b")
    p.add("a", -2)  # a: 1 in flight, b: 0
    assert p.choose(["a", "b"], doc(2))[0] == "b"  # b got it within the last 4 requests: equally fresh, load decides
    for i in range(5):  # b serves five other documents
        other = {"prefix": chat_prefix(_chat(f"document {i}", "q"))}
        p.routed("b", other)
        p.completed("b")
    assert p.choose(["a", "b"], doc(3))[0] == "a"  # a got 7 last: home, though b is less loaded
    p.add("a", 2)  # a: 3 in flight, past the threshold: load comes first again
    assert p.choose(["a", "b"], doc(4))[0] == "b"


def test_load_comes_before_affinity():
    p = RoutingPolicy(imbalance_threshold=2, rng=random.Random(2))
    route = {"session": "s:user-1"}
    p.routed("a", route)  # the session lives on a, which now has 1 in flight
    assert p.choose(["a", "b"], route)[0] == "a"
    p.routed("a", {})
    p.routed("a", {})  # a: 3 in flight, b: 0 -> a leads by more than 2
    assert p.choose(["a", "b"], route)[0] == "b"
    for _ in range(3):
        p.completed("a")
    assert p.choose(["a", "b"], route)[0] == "a"


def test_busy_replicas_a_few_requests_apart_keep_affinity():
    p = RoutingPolicy(imbalance_threshold=4, imbalance_ratio=1.5, rng=random.Random(5))
    route = {"session": "s:user-2"}
    p.routed("a", route)
    for _ in range(19):
        p.routed("a", {})  # a: 20 in flight
    for _ in range(14):
        p.routed("b", {})  # b: 14 -> a leads by 6 (> 4) but only 1.43x (< 1.5)
    assert p.choose(["a", "b"], route)[0] == "a"
    p.routed("a", {})
    p.routed("a", {})  # a: 22 = 1.57x b: past both bounds
    assert p.choose(["a", "b"], route)[0] == "b"


def test_snapshot_affinity_and_forgetting_a_dead_replica():
    p = RoutingPolicy(rng=random.Random(3))
    p.routed("b", {"snapshot": "alice/base"})
    p.completed("b")
    assert p.choose(["a", "b", "c"], {"snapshot": "alice/base"})[0] == "b"
    p.forget("b")
    assert p.choose(["a", "c"], {"snapshot": "alice/base"})[0] in ("a", "c")
    assert "b" not in p.in_flight


def test_pinned_requests_go_to_their_replica_or_nowhere():
    p = RoutingPolicy()
    assert p.choose(["a", "b"], {"pin": "b"}) == ["b"]
    assert p.choose(["a", "b"], {"pin": "gone"}) == []
    assert p.choose([], {}) == []


def test_merge_metrics_labels_every_sample_with_its_replica():
    from prometheus_client.parser import text_string_to_metric_families

    from tartlet.cluster.gateway import merge_metrics

    one = (
        "# HELP tartlet_tokens_generated_total Tokens.\n# TYPE tartlet_tokens_generated_total counter\n"
        'tartlet_tokens_generated_total{model="m"} 3.0\n'
        "# HELP tartlet_up Up.\n# TYPE tartlet_up gauge\ntartlet_up 1.0\n"
    )
    merged = merge_metrics({"r1": one, "r2": one.replace("3.0", "5.0")})
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    samples = [(s.labels["replica"], s.value) for s in fams["tartlet_tokens_generated"].samples]
    assert sorted(samples) == [("r1", 3.0), ("r2", 5.0)]
    assert {s.labels["replica"] for s in fams["tartlet_up"].samples} == {"r1", "r2"}
    assert merged.count("# TYPE tartlet_up gauge") == 1


def test_power_of_two_ignores_affinity_and_takes_the_less_loaded_of_two():
    p = RoutingPolicy(rng=random.Random(4))
    route = {"session": "s:x", "policy": "power-of-two"}
    p.routed("a", {"session": "s:x"})  # a holds the session and 1 request
    picks = {p.choose(["a", "b"], route)[0] for _ in range(20)}
    assert picks == {"b"}  # with two replicas both are sampled: the less loaded wins, affinity or not
    p.completed("a")
    assert {p.choose(["a", "b"], route)[0] for _ in range(50)} == {"a", "b"}  # equal load: random
    assert p.choose(["a", "b"], {"pin": "a", "policy": "power-of-two"}) == ["a"]  # pins still hold


async def test_replica_tunnel_multiplexes_requests_on_one_batched_stream():
    """tartlet/cluster/tunnel.py without Ray: two requests started by one
    gateway stream their events on that gateway's one stream, each ending with
    None; a cancelled request's app sees http.disconnect."""
    import asyncio

    from tartlet.cluster.tunnel import ReplicaTunnel

    seen_disconnect = asyncio.Event()

    async def app(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        if body == b"forever":
            assert (await receive())["type"] == "http.disconnect"
            seen_disconnect.set()
            return
        for i in range(3):
            await send({"type": "http.response.body", "body": body + str(i).encode(), "more_body": True})
            await asyncio.sleep(0)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    t = ReplicaTunnel(app, "r1")
    scope = {"type": "http", "method": "POST", "path": "/x", "headers": []}
    assert t.http_start("gw", "a", scope, b"A") == "r1"
    t.http_start("gw", "b", scope, b"B")
    t.http_start("gw", "c", scope, b"forever")
    got: dict[str, list] = {"a": [], "b": [], "c": []}
    batches = 0
    stream = t.events("gw")
    while got["a"][-1:] != [None] or got["b"][-1:] != [None]:
        batch = await stream.__anext__()
        batches += 1
        for key, ev in batch:
            got[key].append(ev)
    assert [e["body"] for e in got["a"][1:-1]] == [b"A0", b"A1", b"A2"]
    assert [e["body"] for e in got["b"][1:-1]] == [b"B0", b"B1", b"B2"]
    assert got["a"][0]["start"] == 200 and [b"x-tartlet-replica", b"r1"] in got["a"][0]["headers"]
    assert batches < 8  # 2 x (start + 3 bodies + end) = 10 events came batched
    t.http_cancel("c")
    await asyncio.wait_for(seen_disconnect.wait(), 5)
    rest = await stream.__anext__()
    assert ("c", None) in rest
    await stream.aclose()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Serve's own pydantic fields
def test_cluster_config_becomes_ray_serve_deployments():
    """build_application: fixed replicas or autoscaling bounds, CPUs per
    replica, the router and its threshold, the gateway pinned to a node."""
    from tartlet.cluster.deployments import build_application
    from tartlet.server.config import ServerConfig

    def deployments(cluster: dict):
        app = build_application(ServerConfig.model_validate({"cluster": cluster}), auth=True, port=8123, node_ip="10.0.0.7")
        gateway = app._bound_deployment
        replica = gateway.init_args[0]._bound_deployment
        return gateway, replica

    gateway, replica = deployments({"replicas": 3, "threads_per_replica": 2, "imbalance_threshold": 7})
    assert replica._deployment_config.num_replicas == 3
    assert replica.ray_actor_options["num_cpus"] == 2
    router = replica._deployment_config.request_router_config
    assert router.request_router_class.endswith("TartletRouter") and router.request_router_kwargs == {"imbalance_threshold": 7, "imbalance_ratio": 1.5}
    assert gateway.init_args[1:] == ("127.0.0.1", 8123, 8 * 2**20, "tartlet")
    assert gateway.ray_actor_options["resources"] == {"node:10.0.0.7": 0.001}
    _, scaled = deployments({"replicas": 2, "min_replicas": 1, "max_replicas": 5, "target_ongoing_requests": 8})
    auto = scaled._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.initial_replicas, auto.target_ongoing_requests) == (1, 5, 2, 8)
