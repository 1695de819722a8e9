"""Role interfaces: what the loop may call on each backend.

What this is: typing.Protocols for the roles of SPEC/DESIGN (task source,
rollout backend, reward function, learner backend, metric sink). Backends are
plain classes in plugins/ that satisfy these by shape; rlctl.hooks checks the
shape when a plugin registers.

What this is not: an implementation or a base class to inherit from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

from rlctl.contracts.types import (
    CheckpointManifest,
    CheckpointState,
    LearnerState,
    RewardResult,
    RolloutRequest,
    TaskData,
    Trajectory,
    WeightUpdate,
)

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.contracts.batch import TrainBatch


@runtime_checkable
class TaskSource(Protocol):
    """Loads the prompts of a task as three frozen splits."""

    def load(self) -> TaskData:
        """Return every split. Raise DataError naming the bad row on bad data."""
        ...


@runtime_checkable
class RolloutBackend(Protocol):
    """Generates trajectories from the current policy weights."""

    policy_version: int

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """Return ``group_size`` trajectories per request, grouped in request order."""
        ...

    def update_weights(self, update: WeightUpdate) -> None:
        """Apply a whole weight version; serve it only once every tensor is applied."""
        ...

    def health(self) -> Mapping[str, Any]:
        """Report liveness and the policy version being served."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one trajectory against its prompt's reference answer."""

    name: str
    version: str

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        """Return components, total and grader version. Never turn an error into 0."""
        ...


@runtime_checkable
class LearnerBackend(Protocol):
    """Owns the trainable policy, its optimizer and the frozen reference."""

    policy_version: int

    def logprobs(self, batch: "TrainBatch") -> Any:
        """Per-token log pi_theta of the batch's tokens under its sampling config, [N, T]."""
        ...

    def train_step(self, batch: "TrainBatch") -> Mapping[str, float]:
        """Run the configured PPO epochs / mini-batches on one batch; return metrics."""
        ...

    def export_weights(self) -> WeightUpdate:
        """The current policy weights, tagged with ``policy_version``."""
        ...


@runtime_checkable
class CheckpointableLearner(Protocol):
    """A learner whose state a checkpoint can hold (optional: needed for checkpoint.every_steps > 0).

    Kept apart from LearnerBackend so that a learner without checkpoint support
    still runs with checkpoints off; the engine checks for it with isinstance.
    """

    def checkpoint_state(self) -> LearnerState:
        """A private copy of weights, optimizer, LR schedule, scaler, generators and policy version."""
        ...

    def load_checkpoint_state(self, state: LearnerState) -> None:
        """Restore exactly what ``checkpoint_state`` returned; raise CheckpointError if it does not fit."""
        ...


@runtime_checkable
class StatefulRollout(Protocol):
    """A rollout backend with its own resumable state (optional, e.g. a seeded sampler).

    ``state()`` returns a tree of JSON data and tensors that the core never
    reads; ``load_state`` takes it back. A backend without these methods is
    resumed by weights alone.
    """

    def state(self) -> Mapping[str, Any]: ...

    def load_state(self, state: Mapping[str, Any]) -> None: ...


@runtime_checkable
class CheckpointStore(Protocol):
    """Where checkpoints live (local disk by default). Only committed checkpoints exist to readers.

    ``save`` may return before the checkpoint is durable (at most one save in
    flight); ``wait`` blocks until it is and re-raises its failure.
    """

    def save(self, state: CheckpointState) -> str:
        """Start saving ``state``; return the checkpoint's path."""
        ...

    def wait(self) -> None: ...

    def close(self, abort: bool = False) -> None:
        """Finish (or, with ``abort``, cleanly abandon) the save in flight."""
        ...

    def list_committed(self) -> list[tuple[str, CheckpointManifest]]:
        """Committed checkpoints as ``(path, manifest)``, oldest first (checksums not verified)."""
        ...

    def load(self, path: str) -> CheckpointState:
        """Verify every checksum of the checkpoint at ``path`` and read it back."""
        ...


@runtime_checkable
class MetricSink(Protocol):
    """Receives each step's metrics (a registry table, a JSONL file, a tracker)."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Fault(Protocol):
    """An injectable fault kind (``rlctl inject --fault KIND``): arms handlers at real failure sites."""

    def arm(self, ctx: Any) -> Any:
        """Arm this fault for a run (``ctx`` is a rlctl.engine.faults.FaultContext); return a disarm function."""
        ...


@runtime_checkable
class LrScalable(Protocol):
    """A learner whose learning rate can be lowered mid-run (the NaN rollback does)."""

    def scale_lr(self, factor: float) -> float:
        """Multiply the learning rate by ``factor`` for the rest of the run; return the new base LR."""
        ...


ROLE_PROTOCOLS: dict[str, type] = {
    "task_source": TaskSource,
    "rollout_backend": RolloutBackend,
    "reward_function": RewardFunction,
    "learner_backend": LearnerBackend,
    "metric_sink": MetricSink,
    "fault": Fault,
}
