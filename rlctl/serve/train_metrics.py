"""``train.metrics_port``: a trainer serves its latest step metrics at ``/metrics`` while it runs.

What this is: ``MetricsEndpoint``, a metric sink (``write(step, metrics)``,
``close()``) that the run adds beside its other sinks when
``train.metrics_port`` is set (rlctl.ops.run). It receives every logged
step's metrics, the ones the registry stores, and serves the latest of them
in the Prometheus text format at ``http://127.0.0.1:PORT/metrics``:
``rlctl_train_step``, ``rlctl_train_<name>`` for each metric (``/`` and other
characters outside ``[a-zA-Z0-9_]`` become ``_``; non-finite values stay
NaN / +Inf / -Inf), all labelled with the ``run_id``, plus the server's own
request metrics. Port 0 picks a free port; the URL is written to
``<run_dir>/metrics.url`` either way. The server is ``rlctl serve``'s stack
(uvicorn + Starlette, rlctl.serve.listener): loopback only, a foreign Host
or any Origin refused, request deadlines.

What this is not: a history (scrape it, or read the registry / metrics.jsonl)
or reachable from other machines (it binds 127.0.0.1; put a scraper beside
the trainer).
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any, Mapping

from rlctl.serve.http_common import HttpOptions, Routes
from rlctl.serve.listener import HttpServer
from rlctl.serve.metrics import ServeMetrics

_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def metric_name(key: str) -> str:
    """``rlctl_train_`` + the metric's name with every character outside [a-zA-Z0-9_] as ``_``."""
    return "rlctl_train_" + _UNSAFE.sub("_", key)


class MetricsEndpoint:
    """Serves the latest logged step's metrics on 127.0.0.1:``port`` from a thread until ``close()``."""

    def __init__(self, port: int, *, run_id: str, run_dir: str | Path | None = None, host: str = "127.0.0.1") -> None:
        self.run_id = run_id
        self._latest: tuple[int, dict[str, float]] | None = None  # replaced whole: read without a lock
        metrics = ServeMetrics(collect=self._families, engine=False)
        routes = Routes(gets={}, posts={}, max_body_bytes=1, name="rlctl-train-metrics", metrics=metrics)
        self.server = HttpServer(routes, host, port, http=HttpOptions(max_connections=64, max_requests=8),
                                 risk="read the run's metrics")
        self.url = self.server.url
        if run_dir is not None:
            (Path(run_dir) / "metrics.url").write_text(self.url + "\n")
        self._thread = threading.Thread(target=self.server.serve_forever, name="rlctl-train-metrics", daemon=True)
        self._thread.start()

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self._latest = (int(step), {str(k): float(v) for k, v in metrics.items()})

    def close(self) -> None:
        self.server.shutdown()
        self._thread.join(timeout=10)

    def _families(self) -> list[Any]:
        from prometheus_client.core import GaugeMetricFamily

        latest = self._latest
        if latest is None:
            return []
        step, values = latest
        out = [GaugeMetricFamily("rlctl_train_step", "The last logged training step", labels=["run_id"])]
        out[0].add_metric([self.run_id], step)
        seen = {"rlctl_train_step"}
        for key in sorted(values):
            name = metric_name(key)
            if name in seen:  # two keys that differ only in unsafe characters: the first one wins
                continue
            seen.add(name)
            family = GaugeMetricFamily(name, f"Step metric {key!r} of the last logged step", labels=["run_id"])
            family.add_metric([self.run_id], values[key])
            out.append(family)
        return out
