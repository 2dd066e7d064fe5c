"""``/metrics``: Prometheus exposition through ``prometheus_client``, one
registry per server, names by the Prometheus conventions, and
``tartlet_tokens_generated_total`` counting sampled tokens (not decode steps).
Runs in-process over ``httpx.ASGITransport`` on the shared engine."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import run_ok
from tartlet.host.state import HostState
from tartlet.server.app import build_app
from tartlet.server.config import config_from_dict
from tartlet.server.service import Service


@pytest.fixture
def service(engine, tmp_path):
    state = HostState()
    state.add_engine(engine)
    return Service(config_from_dict({"data_dir": str(tmp_path)}), state, auth=False)


async def scrape(service: Service, accept: str | None = None) -> httpx.Response:
    headers = {"Accept": accept} if accept else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(service)), base_url="http://t") as c:
        return await c.get("/metrics", headers=headers)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a Prometheus text page."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text) for s in fam.samples
    }


async def test_names_types_and_units(service, engine):
    r = await scrape(service)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    counters = {n for n, f in fams.items() if f.type == "counter"}
    assert {"tartlet_tokens_generated", "tartlet_tokens_computed", "tartlet_forward_seconds",
            "tartlet_queue_wait_seconds", "tartlet_instances_launched"} <= counters
    for f in fams.values():  # every counter sample is exposed as NAME_total; no gauge ends in _total
        if f.type == "counter":
            assert all(s.name == f.name + "_total" for s in f.samples), f.name
        else:
            assert not f.name.endswith("_total"), f.name
    assert fams["tartlet_kv_pool_pages"].type == "gauge" and fams["tartlet_batch_size"].type == "histogram"
    values = samples(r.text)
    model = (("model", service.state.default_model),)
    assert values[("tartlet_kv_pool_pages", model)] == engine.pool.num_pages
    assert values[("tartlet_kv_pool_bytes", model)] == engine.pool.nbytes()
    assert values[("tartlet_kv_pages", model + (("state", "free"),))] <= engine.pool.num_pages


async def test_large_values_are_exact(service):
    service.launched = 1_234_567_891  # {value:g} printed 1.23457e+09
    assert samples((await scrape(service)).text)[("tartlet_instances_launched_total", ())] == 1_234_567_891


async def test_tokens_generated_counts_sampled_tokens(service, engine):
    before = samples((await scrape(service)).text)
    res = await run_ok(service.runtime, "text-completion", {"prompt": "Hi", "max_tokens": 5})
    after = samples((await scrape(service)).text)

    def delta(name: str) -> float:
        return sum(v - before.get(k, 0) for k, v in after.items() if k[0] == name)

    assert delta("tartlet_tokens_generated_total") == len(res["tokens"]) == engine.scheduler.stats.tokens_generated - sum(
        v for k, v in before.items() if k[0] == "tartlet_tokens_generated_total")
    assert delta("tartlet_tokens_computed_total") >= len(res["tokens"])
    assert delta("tartlet_model_calls_total") >= 1 and delta("tartlet_batch_size_count") >= 1


async def test_one_registry_per_server(engine, tmp_path):
    services = []
    for i in range(2):
        state = HostState()
        state.add_engine(engine)
        services.append(Service(config_from_dict({"data_dir": str(tmp_path / str(i))}), state, auth=False))
    services[1].launched = 7
    a, b = [samples((await scrape(s)).text) for s in services]
    assert a[("tartlet_instances_launched_total", ())] == 0 and b[("tartlet_instances_launched_total", ())] == 7


async def test_openmetrics_on_request(service):
    r = await scrape(service, "application/openmetrics-text; version=1.0.0")
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")
