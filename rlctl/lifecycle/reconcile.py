"""Reconcile the registry with reality: runs marked ``running`` whose process is gone.

What this is: ``reconcile_stale_runs()``. A training process holds an flock on
``<run_dir>/.lock`` for its whole life, and the kernel drops it when the process
dies (SIGKILL, OOM, power loss), so a ``running`` row whose lock can be taken
belongs to a dead process. Such a run becomes ``interrupted`` when it has a
committed checkpoint (``rlctl resume`` continues it) and ``failed`` otherwise,
with an event saying why: the registry must agree with the file system,
which is the truth.

What this is not: a cross-host liveness check. Runs whose directory is not on
this machine are left alone (flock is host-local).
"""

from __future__ import annotations

from rlctl.contracts.types import RunRecord
from rlctl.engine.rundir import RunDir
from rlctl.registry.store import Registry


def reconcile_stale_runs(registry: Registry, limit: int = 200) -> list[RunRecord]:
    """Mark dead ``running`` runs; return the updated records."""
    fixed = []
    for run in registry.list_runs(limit=limit, status="running"):
        if not run.run_dir or not (directory := RunDir(run.run_dir)).lock_is_free():
            continue
        resumable = directory.newest_step() is not None
        status = "interrupted" if resumable else "failed"
        why = "the training process is gone (its run-directory lock was free)"
        registry.update_run(run.id, status=status, error=None if resumable else why)
        registry.add_event(run.id, "reconciled", f"{why}; marked {status}",
                           {"resumable": resumable})
        fixed.append(registry.get_run(run.id))
    return fixed
