"""Run a run's steps with the driver its placement calls for: the synchronous loop or the overlapped one.

What this is: ``drive``. A placement that gave the roles a fleet of rollout
workers (the overlapped modes, every Ray run, or a local ``mode: sync`` run
placed with ``fleet=True``) goes through the overlapped driver
(rlctl.engine.overlap); a local synchronous run through the plain loop
(rlctl.engine.loop.run_sync). Both call the same training step.

What this is not: building the roles (rlctl.placement) or the run around the
loop (rlctl.lifecycle.run).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from rlctl.contracts.roles import MetricSink
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.loop import Checkpointer, Evaluate, Observer, run_sync
from rlctl.engine.overlap import run_overlapped
from rlctl.engine.producers import RolloutFleet
from rlctl.engine.roles import START, ResumePoint, Roles
from rlctl.engine.spec import LoopSpec


def drive(roles: Roles, spec: LoopSpec, sinks: Sequence[MetricSink], *, observer: Observer | None = None,
          resume: ResumePoint = START, checkpoint: Checkpointer | None = None, heartbeat: Heartbeat = NO_HEARTBEAT,
          directory: Path | None = None, recover: Callable[[], ResumePoint] | None = None,
          store: object = None, evaluate: Evaluate | None = None) -> dict[str, float]:
    """Run ``roles`` from ``resume`` to ``spec.steps``: the plain loop, or the overlapped driver when the
    placement gave the roles a fleet of rollout workers (``directory`` holds its queue; ``recover`` restores a
    lost learner in-run; ``evaluate`` is the periodic eval, run at every step end); return the last step's
    metrics."""
    if isinstance(roles.rollout, RolloutFleet):
        if directory is None:
            raise ValueError("the overlapped driver needs a directory for its trajectory queue")
        return run_overlapped(roles, spec, directory / "queue", sinks, observer=observer, resume=resume,
                              checkpoint=checkpoint, heartbeat=heartbeat, recover=recover, store=store,
                              evaluate=evaluate)
    if spec.mode != "sync":
        raise ValueError(f"mode={spec.mode} needs a placement with rollout workers (rlctl.placement)")
    return run_sync(roles, spec, sinks, observer=observer, start_step=resume.step, checkpoint=checkpoint,
                    heartbeat=heartbeat, evaluate=evaluate)
