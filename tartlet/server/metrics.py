"""``/metrics``: Prometheus metrics of one server, via ``prometheus_client``.

Each server has its own :class:`prometheus_client.CollectorRegistry` (from
:func:`make_registry`), never the process-wide default one, so several apps
in one process (tests) do not collide. Its one collector reads the values at
scrape time: counters from each engine's ``scheduler.stats``
(:class:`tartlet.engine.core.stats.SchedulerStats`), gauges from
``pool.stats()`` and the service; read without locks (monotonic counters, a
scrape may be one batch stale).

Names follow the Prometheus conventions: counters end in ``_total``, units
are spelled in the name (``_seconds``, ``_bytes``), labels ``model`` (the
served model's name) and ``state`` (KV pages).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from .service import Service

#: Upper bounds of the batch-size histogram buckets (requests per model call).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: (metric name without ``_total``, SchedulerStats field, help) of the per-model counters.
_SCHEDULER_COUNTERS = (
    ("tartlet_tokens_generated", "tokens_generated",
     "Tokens sampled by the engine (probes excluded; speculative drafts count when verified)."),
    ("tartlet_decode_steps", "decode_steps", "Single-token forward request chunks run (decode steps)."),
    ("tartlet_tokens_computed", "tokens_computed", "Tokens run through the model (prefill and decode)."),
    ("tartlet_prefix_tokens_reused", "prefix_tokens_reused",
     "Prompt tokens served from the prefix cache instead of computed."),
    ("tartlet_model_calls", "model_calls", "Batched model calls."),
    ("tartlet_forward_seconds", "forward_seconds", "Time spent in model calls, seconds."),
    ("tartlet_queue_wait_seconds", "queue_wait_seconds",
     "Summed wait of forward requests between submission and their batch, seconds."),
    ("tartlet_forward_requests", "batched_requests",
     "Forward requests batched (divide queue wait by this for the mean)."),
    ("tartlet_mixed_model_calls", "mixed_calls",
     "Model calls holding both decode (one-token) and prefill (multi-token) chunks."),
    ("tartlet_batch_wait_seconds", "batch_wait_seconds",
     "Scheduler time waiting for last round's sequences to come back before a call, seconds."),
    ("tartlet_scheduler_overhead_seconds", "overhead_seconds",
     "Scheduler time in its own Python between model calls (batching, commands, resolving), seconds."),
)


class ServerCollector(Collector):
    """Yields the metrics of ``service`` at each scrape."""

    def __init__(self, service: Service) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        models = [(name, served.engine) for name, served in service.state.models.items()]
        for name, field, help_ in _SCHEDULER_COUNTERS:
            c = CounterMetricFamily(name, help_, labels=["model"])
            for model, engine in models:
                c.add_metric([model], getattr(engine.scheduler.stats, field))
            yield c
        h = HistogramMetricFamily("tartlet_batch_size", "Requests per model call.", labels=["model"])
        for model, engine in models:
            sizes = dict(engine.scheduler.stats.batch_sizes)
            buckets = [(str(b), sum(c for k, c in sizes.items() if k <= b)) for b in BATCH_BUCKETS]
            h.add_metric([model], buckets + [("+Inf", sum(sizes.values()))], sum(k * c for k, c in sizes.items()))
        yield h
        pages = GaugeMetricFamily(
            "tartlet_kv_pages", "KV pages by state: used (referenced), cached (reusable), free.", labels=["model", "state"]
        )
        pool_pages = GaugeMetricFamily("tartlet_kv_pool_pages", "KV pages in the pool.", labels=["model"])
        pool_bytes = GaugeMetricFamily("tartlet_kv_pool_bytes", "Memory of the KV page pool (keys and values), bytes.",
                                       labels=["model"])
        for model, engine in models:
            st = engine.pool.stats()
            for state in ("used", "cached", "free"):
                pages.add_metric([model, state], getattr(st, state))
            pool_pages.add_metric([model], st.total)
            pool_bytes.add_metric([model], engine.pool.nbytes())
        yield from (pages, pool_pages, pool_bytes)
        yield from _snapshot_counters(service)
        yield GaugeMetricFamily("tartlet_running_instances", "Inferlet instances running now.", value=service.running())
        yield CounterMetricFamily("tartlet_instances_launched", "Instances launched by clients and API requests.",
                                  value=service.launched)
        yield CounterMetricFamily("tartlet_limit_refusals", "Launches refused by the per-user instance limit.",
                                  value=service.limit_refusals)


#: (metric name without ``_total``, PageWriteStats field, help) of the snapshot store counters.
_SNAPSHOT_COUNTERS = (
    ("tartlet_snapshot_bytes_written", "bytes_written", "Bytes of snapshot files and page files written."),
    ("tartlet_snapshot_pages_written", "pages_written", "Snapshot page files written (pages not on disk yet)."),
    ("tartlet_snapshot_pages_reused", "pages_reused", "Pages a snapshot save named without reading them (stored before)."),
    ("tartlet_snapshot_write_seconds", "write_seconds", "Time of the snapshot writer in writes, seconds."),
    ("tartlet_snapshot_write_cpu_seconds", "write_cpu_seconds", "CPU time of the snapshot writer thread in writes, seconds."),
)


def _snapshot_counters(service: Service) -> Iterator[Metric]:
    """Counters of each model's snapshot store (:class:`tartlet.host.snapshot_pages.PageWriteStats`);
    a model without a data dir has none."""
    stores = [(name, served.snapshots.store) for name, served in service.state.models.items()]
    for name, field, help_ in _SNAPSHOT_COUNTERS:
        c = CounterMetricFamily(name, help_, labels=["model"])
        for model, store in stores:
            if store is not None:
                c.add_metric([model], getattr(store.pages.stats, field))
        yield c


def make_registry(service: Service) -> CollectorRegistry:
    """A new registry holding the metrics of ``service`` (one per server)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(service))
    return registry


def render(registry: CollectorRegistry, accept: str | None = None) -> tuple[bytes, str]:
    """The exposition of ``registry`` in the format the ``Accept`` header
    asks for (Prometheus text by default, OpenMetrics on request).

    Returns:
        (body, content type).
    """
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type
