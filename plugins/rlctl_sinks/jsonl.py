"""JSONL metric sink: one ``{"step": s, "metrics": {...}}`` line per logged step.

What this is: a MetricSink that appends to ``<run_dir>/metrics.jsonl`` and
flushes every line, so a crash loses at most the line being written. Like the
registry's upserts, it is idempotent by step: when a resumed run logs step s
again, the lines for steps >= s left by the earlier attempt are cut off first,
so the file never holds a step twice (also when a NaN rollback re-runs steps
inside one process). The file mechanics are rlctl.kit's ``StepLines``.

What this is not: the registry (the run's metrics always go there as well).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping

from rlctl.kit import StepLines


class JsonlSink:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self._lines = StepLines(self.path)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._lines.write(step, {"metrics": clean})

    def close(self) -> None:
        self._lines.close()
