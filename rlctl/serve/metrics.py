"""Prometheus metrics of an ``rlctl serve`` server: HTTP requests, errors, latency, and its model thread.

What this is: ``ServeMetrics``, one prometheus_client registry per server
(several servers can live in one process, as in the tests), served at
``GET /metrics`` behind the server's API key (rlctl.serve.asgi). It holds:

- ``rlctl_http_requests_total{route,method,status}``,
  ``rlctl_http_request_errors_total{route,status}`` (status >= 400),
  ``rlctl_http_request_duration_seconds{route}`` and
  ``rlctl_http_requests_in_progress``; ``route`` is a served path or
  ``unmatched``, so clients cannot grow the label set;
- ``rlctl_engine_batch_rows`` and ``rlctl_engine_batch_seconds``
  (histograms, one observation per engine batch / forward pass);
- whatever the service reports at scrape time through ``collect`` (queue
  depth, counters, weight version or model hash; rlctl.serve.server and
  rlctl.serve.reward supply them), read from the model thread's counters
  without locking it.

What this is not: the trainer's step metrics (rlctl.serve.train_metrics) or
the HTTP plumbing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_METHODS = {"GET", "HEAD", "POST"}


class ServeMetrics:
    """One server's registry; ``collect()`` yields the service's own families at every scrape."""

    def __init__(self, collect: Callable[[], Iterable[Any]] | None = None, *, engine: bool = True) -> None:
        """``engine``: also the per-batch histograms (a server with a model thread)."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("rlctl_http_requests", "HTTP requests answered, by route, method and status",
                                ["route", "method", "status"], registry=registry)
        self.errors = Counter("rlctl_http_request_errors", "HTTP requests answered with a status >= 400",
                              ["route", "status"], registry=registry)
        self.latency = Histogram("rlctl_http_request_duration_seconds", "Time from admission to the answer",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.in_progress = Gauge("rlctl_http_requests_in_progress", "Requests admitted and not yet answered",
                                 registry=registry)
        if engine:
            self.batch_rows = Histogram("rlctl_engine_batch_rows", "Rows (sequences) per engine batch",
                                        buckets=_ROW_BUCKETS, registry=registry)
            self.batch_seconds = Histogram("rlctl_engine_batch_seconds", "Engine time per batch",
                                           buckets=_LATENCY_BUCKETS, registry=registry)
        if collect is not None:
            registry.register(_Collector(collect))

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "other"
        self.requests.labels(route, method, str(status)).inc()
        if status >= 400:
            self.errors.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def observe_batch(self, rows: int, seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.batch_seconds.observe(seconds)


class _Collector:
    def __init__(self, collect: Callable[[], Iterable[Any]]) -> None:
        self._collect = collect

    def collect(self) -> Iterable[Any]:
        return list(self._collect())

    def describe(self) -> Iterable[Any]:
        return []  # families are known only at scrape time


def worker_families(stats: Any, *, queue_depth: int, busy: bool, engine: str) -> list[Any]:
    """The families both model threads report: queue depth, busy, and their batch counters."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out = [GaugeMetricFamily("rlctl_engine_queue_depth", f"Requests waiting for or in the {engine} thread",
                             value=queue_depth),
           GaugeMetricFamily("rlctl_engine_busy", f"1 while the {engine} thread runs a batch", value=int(busy))]
    for name, help_text in (("batches", "Engine batches run"), ("requests", "Requests taken into batches"),
                            ("rows", "Rows (sequences) run"), ("cancelled", "Requests cancelled (client left or "
                                                                            "shutdown)"),
                            ("retried_alone", "Requests re-run alone after a shared batch failed")):
        out.append(CounterMetricFamily(f"rlctl_engine_{name}", help_text, value=getattr(stats, name)))
    out.append(CounterMetricFamily("rlctl_engine_seconds", f"Time the {engine} thread spent in batches",
                                   value=stats.engine_seconds))
    return out
