"""The overlapped driver's ledger of what each step trained, and the audit that rebuilds the committed history.

What this is: ``Ledger`` (an append-only, fsynced JSON-lines file beside the
trajectory queue: one entry per trained step with the groups it took,
dropped and reweighted, plus a ``start``, ``rewind`` or ``end`` entry when a
run starts, a lost learner is restored, or the run ends) and ``audit``, which
replays it against the queue's log and final cursor to prove that no
acknowledged group was lost and none was trained twice.

What this is not: the queue (rlctl.engine.queue) or the loop (rlctl.engine.overlap).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from rlctl.engine.queue import TrajectoryQueue


class Ledger:
    """Append-only, fsynced record of what each step trained and dropped (and of rewinds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, entry: Mapping[str, Any]) -> None:
        os.write(self._fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


# -- audit ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Audit:
    """The committed training history rebuilt from the ledger, checked against the log and the final cursor."""

    steps: int
    trained: int
    double_counted: int
    dropped: int
    lost: tuple[str, ...]  # acknowledged groups consumed by the cursor but never trained, or skipped draw keys
    pending: int  # acknowledged, not yet trained: buffered for the next step or a resume
    max_staleness: int


def audit(queue_dir: Path) -> Audit:
    """Rebuild what each committed step trained (a start or rewind discards later steps); find loss or repeats."""
    history: dict[int, Mapping[str, Any]] = {}
    final: Mapping[str, Any] | None = None
    for line in (queue_dir / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "step" in entry:
            history[int(entry["step"])] = entry
            final = None
        elif "rewind" in entry or "start" in entry:
            floor = int(entry.get("rewind", entry.get("start", 0)))
            history = {k: v for k, v in history.items() if k < floor}
            final = None
        elif "end" in entry:
            final = entry
    trained = [gid for k in sorted(history) for gid in history[k]["taken"]]
    dropped = {gid for k in history for gid in history[k]["dropped"]}
    queue = TrajectoryQueue(queue_dir)
    try:
        logged = {g.group_id: g for g in queue._iter_log()}
        compacted = queue.known_keys() - {g.key for g in logged.values()}
    finally:
        queue.close()
    done = set(trained) | dropped
    lost: list[str] = []
    if final is not None:
        cursor = final["cursor"]
        consumed = set(cursor["resolved"])
        for gid, group in logged.items():
            if gid not in done and (group.seq < cursor["watermark"] or group.seq in consumed):
                lost.append(gid)  # the cursor says consumed, the history never trained or dropped it
        top = max((logged[g].key for g in done if g in logged), default=-1)
        keys = {g.key for g in logged.values()} | compacted | set(final.get("in_flight", ()))
        lost += [f"d{k}" for k in range(top + 1) if k not in keys]  # a drawn prompt never acknowledged
    staleness = [dv for k in history for dv in history[k].get("staleness", ())]
    return Audit(steps=len(history), trained=len(trained), double_counted=len(trained) - len(set(trained)),
                 dropped=len(dropped), lost=tuple(lost), pending=sum(1 for g in logged if g not in done),
                 max_staleness=max(staleness, default=0))
