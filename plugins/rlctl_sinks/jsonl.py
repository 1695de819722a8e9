"""JSONL metric sink: one ``{"step": s, "metrics": {...}}`` line per logged step.

What this is: a MetricSink that appends to ``<run_dir>/metrics.jsonl`` and
flushes every line, so a crash loses at most the line being written. Like the
registry's upserts, it is idempotent by step: when a resumed run logs step s
again, the lines for steps >= s left by the earlier attempt are cut off first,
so the file never holds a step twice (also when a NaN rollback re-runs steps
inside one process).

What this is not: the registry (the run's metrics always go there as well).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping


_TORN = 2**62  # sorts after every real step, so the next write cuts a torn line


class JsonlSink:
    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._earlier = _line_offsets(self.path)  # [(byte offset, step)] of lines already there
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        cut = next((offset for offset, seen in self._earlier if seen >= step), None)
        if cut is not None:  # a re-run step (resume, or a rollback inside this process)
            self._fh.truncate(cut)
            self._fh.seek(cut)
            self._earlier = [(offset, seen) for offset, seen in self._earlier if offset < cut]
        offset = self._fh.tell()
        clean = {k: (v if math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self._fh.write(json.dumps({"step": step, "metrics": clean}, sort_keys=True) + "\n")
        self._fh.flush()
        self._earlier.append((offset, step))

    def close(self) -> None:
        self._fh.close()


def _line_offsets(path: Path) -> list[tuple[int, int]]:
    if not path.is_file():
        return []
    out, offset = [], 0
    with path.open("rb") as fh:
        for raw in fh:
            try:
                out.append((offset, int(json.loads(raw)["step"])))
            except (ValueError, KeyError, TypeError):  # a torn last line from a crash: always cut
                out.append((offset, _TORN))
                break
            offset += len(raw)
    return out
