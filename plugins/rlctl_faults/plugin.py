"""Built-in fault kinds: the entry point ``faults = "rlctl_faults.plugin"``.

What this is: registers each fault kind with its options model, exactly as a
third-party plugin would (``register_faults``).

What this is not: the recovery policies (rlctl.incidents.recovery and the roles
themselves) or the fault sites (rlctl.engine.faults).
"""

from __future__ import annotations

from typing import Callable

from rlctl import hookimpl
from rlctl_faults import kinds


@hookimpl
def register_faults(register: Callable[..., None]) -> None:
    """Register nan, oom, verifier-timeout, verifier-error, tool-timeout, tool-error, bad-checkpoint, learner-crash, slow-rollout,
    slow-learner, worker-crash, network-partition, weight-sync-failure."""
    register("nan", kinds.NanFault, options=kinds.NanOptions)
    register("oom", kinds.OomFault, options=kinds.OomOptions)
    register("verifier-timeout", kinds.VerifierTimeout, options=kinds.VerifierOptions)
    register("verifier-error", kinds.VerifierError, options=kinds.VerifierOptions)
    register("tool-timeout", kinds.ToolTimeout, options=kinds.ToolOptions)
    register("tool-error", kinds.ToolErrorFault, options=kinds.ToolOptions)
    register("bad-checkpoint", kinds.BadCheckpoint, options=kinds.BadCheckpointOptions)
    register("learner-crash", kinds.LearnerCrash, options=None)
    register("slow-rollout", kinds.SlowRollout, options=kinds.SlowRolloutOptions)
    register("slow-learner", kinds.SlowLearner, options=kinds.SlowRolloutOptions)
    register("worker-crash", kinds.WorkerCrash, options=kinds.WorkerCrashOptions)
    register("network-partition", kinds.NetworkPartition, options=kinds.PartitionOptions)
    register("weight-sync-failure", kinds.WeightSyncFailure, options=kinds.WeightSyncOptions)
