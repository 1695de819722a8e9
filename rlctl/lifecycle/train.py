"""Train a new run end to end: ``train()``, the library function behind ``rlctl train``.

What this is: build every role first (so a bad config, plugin, data or model
fails before a run row exists), then record the run with its provenance and
run it through ``Run`` (rlctl.lifecycle.run), which owns status, events, sinks,
checkpoints, the run directory's lock and signals, for train and resume alike.

What this is not: placing roles (rlctl.placement), the loop (rlctl.engine.loop), the run lifecycle
(rlctl.lifecycle.run) or its display (the CLI).
"""

from __future__ import annotations

import time
from pathlib import Path

from rlctl.config.models import RunConfig
from rlctl.engine.faults import drain_recoveries
from rlctl.engine.rundir import RunDir
from rlctl.hooks.manager import Plugins
from rlctl.lifecycle.run import RegistrySink, Run, TrainCallbacks, TrainResult, checkpoint_store
from rlctl.registry.store import Registry

__all__ = ["RegistrySink", "TrainCallbacks", "TrainResult", "checkpoint_store", "train"]


def train(config: RunConfig, *, registry: Registry, plugins: Plugins, home: Path, run_dir: Path | None = None,
          callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Train ``config`` as a new run; ``run_dir`` defaults to ``<home>/runs/<run id>``."""
    from rlctl.placement import place

    started = time.perf_counter()
    if run_dir is not None:
        RunDir(run_dir).refuse_foreign_checkpoints()
    progress = callbacks.warm_start if callbacks else None
    drain_recoveries()  # reports from roles built before this run in this process (a library session) are not its
    placement = place(config, plugins, cache_root=home / "cache", progress=progress)
    run = Run.create(placement, registry=registry, plugins=plugins, home=home, run_dir=run_dir, callbacks=callbacks,
                     started=started)
    return run.execute()
