"""JSONL metric sink: one ``{"step": s, "metrics": {...}}`` line per logged step.

What this is: a MetricSink that appends to ``<run_dir>/metrics.jsonl`` and
flushes every line, so a crash loses at most the line being written.

What this is not: the registry (the run's metrics always go there as well).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping


class JsonlSink:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, "metrics": clean}, sort_keys=True) + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
