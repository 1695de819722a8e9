"""Reconcile the registry with reality: runs marked ``running`` whose process is gone.

What this is: ``reconcile_stale_runs()``. A training process holds an flock on
``<run_dir>/.lock`` for its whole life, and the kernel drops it when the process
dies (SIGKILL, OOM, power loss), so a ``running`` row whose lock can be taken
belongs to a dead process. Such a run becomes ``interrupted`` when it has a
committed checkpoint (``rlctl resume`` continues it) and ``failed`` otherwise,
with an event saying why (RELIABILITY B.7: registry consistent with the file
system).

What this is not: a cross-host liveness check. Runs whose directory is not on
this machine are left alone (flock is host-local).
"""

from __future__ import annotations

import fcntl
from pathlib import Path

from rlctl.contracts.types import RunRecord
from rlctl.registry.store import Registry


def reconcile_stale_runs(registry: Registry, limit: int = 200) -> list[RunRecord]:
    """Mark dead ``running`` runs; return the updated records."""
    fixed = []
    for run in registry.list_runs(limit=limit, status="running"):
        lock = Path(run.run_dir) / ".lock" if run.run_dir else None
        if lock is None or not lock.is_file() or not _lock_is_free(lock):
            continue
        resumable = _has_committed_checkpoint(Path(run.run_dir))
        status = "interrupted" if resumable else "failed"
        why = "the training process is gone (its run-directory lock was free)"
        registry.update_run(run.id, status=status, error=None if resumable else why)
        registry.add_event(run.id, "reconciled", f"{why}; marked {status}",
                           {"resumable": resumable})
        fixed.append(registry.get_run(run.id))
    return fixed


def _lock_is_free(path: Path) -> bool:
    with path.open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return True


def _has_committed_checkpoint(run_dir: Path) -> bool:
    root = run_dir / "checkpoints"
    return root.is_dir() and any((p / "COMMITTED").is_file() for p in root.glob("step-*"))
