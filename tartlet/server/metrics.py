"""``/metrics`` in the Prometheus text exposition format (version 0.0.4).

Counters come from each engine's ``scheduler.stats`` and gauges from
``pool.stats()`` and the runtime; read without locks (monotonic counters,
a scrape may be one batch stale).
"""

from __future__ import annotations

from .service import Service

#: Upper bounds of the batch-size histogram buckets (requests per model call).
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _esc(v: str) -> str:
    return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render(service: Service) -> str:
    """All metrics as Prometheus text."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}")

    models = list(service.state.models.items())

    def per_model(fn) -> list[tuple[str, float]]:  # type: ignore[no-untyped-def]
        return [(f'{{model="{_esc(n)}"}}', fn(s.engine)) for n, s in models]

    metric("tartlet_tokens_generated_total", "counter",
           "Tokens generated: single-token (decode) forward passes run.", per_model(lambda e: e.scheduler.stats.decode_steps))
    metric("tartlet_tokens_computed_total", "counter",
           "Tokens run through the model (prefill and decode).", per_model(lambda e: e.scheduler.stats.tokens_computed))
    metric("tartlet_prefix_tokens_reused_total", "counter",
           "Prompt tokens served from the prefix cache instead of computed.", per_model(lambda e: e.scheduler.stats.prefix_tokens_reused))
    metric("tartlet_model_calls_total", "counter", "Batched model calls.", per_model(lambda e: e.scheduler.stats.model_calls))
    metric("tartlet_forward_seconds_total", "counter", "Time spent in model calls, seconds.",
           per_model(lambda e: float(e.scheduler.stats.forward_seconds)))
    metric("tartlet_queue_wait_seconds_total", "counter",
           "Summed wait of forward requests between submission and their batch, seconds.",
           per_model(lambda e: float(e.scheduler.stats.queue_wait_seconds)))
    metric("tartlet_forward_requests_total", "counter", "Forward requests batched (divide queue wait by this for the mean).",
           per_model(lambda e: e.scheduler.stats.batched_requests))
    # batch-size histogram
    lines.append("# HELP tartlet_batch_size Requests per model call.")
    lines.append("# TYPE tartlet_batch_size histogram")
    for n, s in models:
        sizes = dict(s.engine.scheduler.stats.batch_sizes)
        label = _esc(n)
        for b in BATCH_BUCKETS:
            lines.append(f'tartlet_batch_size_bucket{{model="{label}",le="{b}"}} {sum(c for k, c in sizes.items() if k <= b)}')
        lines.append(f'tartlet_batch_size_bucket{{model="{label}",le="+Inf"}} {sum(sizes.values())}')
        lines.append(f'tartlet_batch_size_sum{{model="{label}"}} {sum(k * c for k, c in sizes.items())}')
        lines.append(f'tartlet_batch_size_count{{model="{label}"}} {sum(sizes.values())}')
    kv = [(n, s.engine.pool.stats()) for n, s in models]
    metric("tartlet_kv_pages", "gauge", "KV pages by state: used (referenced), cached (reusable), free.",
           [(f'{{model="{_esc(n)}",state="{k}"}}', getattr(st, k)) for n, st in kv for k in ("used", "cached", "free")])
    metric("tartlet_kv_pages_total", "gauge", "KV pages in the pool.", [(f'{{model="{_esc(n)}"}}', st.total) for n, st in kv])
    metric("tartlet_running_instances", "gauge", "Inferlet instances running now.", [("", service.running())])
    metric("tartlet_instances_launched_total", "counter", "Instances launched by clients and API requests.", [("", service.launched)])
    metric("tartlet_limit_refusals_total", "counter", "Launches refused by the per-user instance limit.", [("", service.limit_refusals)])
    return "\n".join(lines) + "\n"
