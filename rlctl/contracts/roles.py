"""Role interfaces: what the loop may call on each backend.

What this is: typing.Protocols for the roles (task source, rollout backend,
reward function, learner backend, metric sink). Backends are plain classes in
plugins/ that satisfy these by shape; rlctl.hooks checks the shape when a
plugin's factory builds one. Every method or attribute that core (engine, ops)
uses on a role is declared here, so a third-party backend that satisfies the
Protocol runs (tests/unit/test_role_contracts.py checks this by recording
every attribute core touches). Core never branches on a backend's name: what
it needs to know about a backend (e.g. memory terms) it asks through these
Protocols.

What this is not: an implementation or a base class to inherit from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Protocol, Sequence, runtime_checkable

from rlctl.contracts.types import (
    EnvStep,
    EpisodeLimits,
    LearnerMemory,
    RewardResult,
    RolloutMemory,
    RolloutRequest,
    TaskData,
    Trajectory,
    WeightUpdate,
)
from rlctl.contracts.checkpoints import CheckpointManifest, CheckpointState, LearnerState

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from rlctl.contracts.batch import AdvantageInputs, TrainBatch


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
        """Report liveness and the policy version being served (JSON-like values)."""
        ...

    def resident_tensors(self) -> Mapping[str, Sequence["Tensor"]]:
        """Tensors held in this process between calls, by memory-ledger term (``"rollout weights"``).

        The dry-run measures these against its ledger; a backend whose weights
        live in another process returns ``{}``.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class EpisodeState(Protocol):
    """One running episode of an environment (per-episode state lives here, not in the Environment).

    ``step`` gets the tokens the policy wrote in its last turn, exactly as the
    engine sampled them, and returns what the environment appends (token ids,
    never the policy's text re-tokenized). It must return within the
    environment's ``step_timeout_s``; a tool that fails is reported in
    ``EnvStep.tool_status``, not hidden, and leaves the state as it was: the
    episode driver may run the same step again (the verifier retry policy).
    """

    def step(self, policy_tokens: Sequence[int]) -> "EnvStep": ...


@runtime_checkable
class Environment(Protocol):
    """Drives multi-turn episodes: the policy writes, the environment answers, until done or a limit.

    ``stop`` are the strings that end a policy turn (a tool call's closing
    marker) on top of the sampling config's own; ``limits`` bound every
    episode (turns, total tokens, per-step timeout).
    """

    name: str
    version: str
    stop: tuple[str, ...]
    limits: "EpisodeLimits"

    def start(self, prompt_id: str, prompt_tokens: Sequence[int], row: Any = None) -> EpisodeState:
        """Begin one episode of a task row (``row``: its PromptRecord when the caller has it)."""
        ...


@runtime_checkable
class Tool(Protocol):
    """One callable tool (``calculator``, ``python``): text arguments in, text result out."""

    name: str
    version: str

    def call(self, arguments: str, timeout_s: float) -> str:
        """The tool's answer; raise ToolError (bad call, crash, garbage) or TimeoutError. Never return a fake answer."""
        ...


@runtime_checkable
class CancellableRollout(Protocol):
    """A rollout backend that can stop some requests' rows between decode steps (optional).

    ``cancelled()`` is polled between steps and returns the indices (into
    ``requests``) whose client went away; their rows stop and their
    trajectories come back cut short. ``rlctl serve rollout`` uses it so a
    disconnected client frees its rows at once.
    """

    def generate_cancellable(self, requests: Sequence[RolloutRequest],
                             cancelled: Callable[[], Collection[int]]) -> list[Trajectory]: ...


@runtime_checkable
class RunDirAware(Protocol):
    """A rollout backend with files of its own that belong to the run, e.g. the logs of engine servers it
    launched (optional). Told the run's directory once the run exists (after the backend was built)."""

    def use_run_dir(self, run_dir: str) -> None: ...


@runtime_checkable
class ReadableWeights(Protocol):
    """A rollout backend that can show the weights it serves (optional): the base a delta update applies to,
    and the layout (names, shapes, dtypes) a server checks an update against before it loads it."""

    def state_dict(self) -> Mapping[str, "Tensor"]: ...


@runtime_checkable
class RewardFunction(Protocol):
    """Scores one trajectory against its prompt's reference answer."""

    name: str
    version: str

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        """Return components, total and grader version. Never turn an error into 0."""
        ...


@runtime_checkable
class BatchRewardFunction(RewardFunction, Protocol):
    """A reward function that can also score many samples in one call (one request to a reward-model server).

    Optional: core uses ``score_batch`` when a reward function has it, and ``score`` otherwise.
    """

    def score_batch(self, trajectories: Sequence[Trajectory], references: Sequence[str]) -> list[RewardResult]:
        """One result per sample, in order; same rules as ``score`` (an error is an error_code, never 0)."""
        ...


@runtime_checkable
class LearnerBackend(Protocol):
    """Owns the trainable policy, its optimizer and the frozen reference."""

    policy_version: int

    def logprobs(self, batch: "TrainBatch") -> "Tensor":
        """Per-token log pi_theta of the batch's tokens under its sampling config, [N, T] (0 off response)."""
        ...

    def ref_logprobs(self, batch: "TrainBatch") -> "Tensor | None":
        """Per-token log-probs under the frozen reference, [N, T]; None when there is none (KL coef 0)."""
        ...

    def train_step(self, batch: "TrainBatch") -> Mapping[str, float]:
        """Run the configured PPO epochs / mini-batches on one batch; return metrics.

        ``policy_version`` goes up by one when the weights changed, and not when
        every update of the step was skipped (non-finite gradients).

        Optional companion: CapturingLearner.train_step_with_logprobs.
        """
        ...

    def export_weights(self) -> WeightUpdate:
        """The current policy weights, tagged with ``policy_version``."""
        ...

    def save_pretrained(self, directory: str) -> None:
        """Write the current policy into the (empty, existing) ``directory`` as a Hugging Face model.

        Core makes the directory durable (fsync, atomic rename); the learner
        only writes files.
        """
        ...

    def resident_tensors(self) -> Mapping[str, Sequence["Tensor"]]:
        """Tensors held between steps, by memory-ledger term.

        Terms: ``"policy parameters"``, ``"policy gradients"``, ``"policy
        optimizer states"``, ``"reference parameters"`` (and ``"master
        weights"`` when low-precision parameters keep an fp32 copy). The
        dry-run measures these against its ledger.
        """
        ...


@runtime_checkable
class CapturingLearner(Protocol):
    """A learner that returns, with an update, log pi of the trained tokens under the weights before it (optional).

    The training step reads D_lag (and the proximal policy of decoupled PPO)
    from it instead of a separate ``logprobs`` pass; the torch learner takes
    them from its training forward, so they cost nothing.
    """

    def train_step_with_logprobs(self, batch: "TrainBatch") -> tuple[Mapping[str, float], "Tensor"]:
        """``train_step(batch)`` and log pi before it, [N, T] (0 off ``action_mask``)."""
        ...


@runtime_checkable
class RestartableLearner(Protocol):
    """A learner whose processes can be restarted under it (optional: a Ray learner actor, Ray rank actors).

    A restarted learner refuses work until it is restored from a checkpoint or
    told to serve from its initial state (``accept_initial_state``: the run has
    no committed checkpoint yet).
    """

    def accept_initial_state(self) -> None: ...


@runtime_checkable
class ShardedLearnerOptions(Protocol):
    """A learner plugin's validated options for a learner whose ranks hold shards (optional, e.g. FSDP2).

    The placement reserves one bundle per rank and starts the ranks where they
    run; the dry run plans ``world_size`` devices.
    """

    world_size: int


@runtime_checkable
class ZeroStagedOptions(Protocol):
    """A learner plugin's validated options that shard like DeepSpeed ZeRO (optional; the dry run reads the stages)."""

    def zero_stages(self) -> tuple[int, ...]: ...


@runtime_checkable
class LearnerMemoryTerms(Protocol):
    """A learner plugin's validated options that describe its memory (the dry-run asks before any weights load).

    ``gpu_plan``: the ledger plans a GPU run of a real model; settings the user
    left at their defaults may then be reported as a GPU run would use them.
    """

    def memory_terms(self, *, gpu_plan: bool) -> LearnerMemory: ...


@runtime_checkable
class LearnerAvailability(Protocol):
    """A learner plugin's validated options that can say it cannot run here (optional).

    ``unavailable()`` returns None when the learner can run, else why not and
    how to fix it (e.g. an optional dependency that is not installed); the dry
    run reports it plainly instead of planning for a learner that cannot start.
    """

    def unavailable(self) -> str | None: ...


@runtime_checkable
class RolloutMemoryTerms(Protocol):
    """A rollout plugin's validated options that describe its memory (see LearnerMemoryTerms)."""

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory: ...


@runtime_checkable
class EngineLaunchCheck(Protocol):
    """A rollout plugin's validated options that can refuse a model before launching engine servers (optional;
    e.g. a head_dim the engine's kernels reject): ``rlctl dryrun`` asks, so the problem shows before a launch."""

    def launch_problem(self, head_dim: int) -> str | None:
        """Why the servers this config launches would refuse a model with ``head_dim``, or None."""


@runtime_checkable
class LengthTailOptions(Protocol):
    """A rollout plugin's validated options that impose a response-length tail (optional; e.g. the local
    engine's benchmark option): the staleness simulator draws lengths from it instead of a smoke step's."""

    def length_tail(self) -> tuple[float, int] | None:
        """``(alpha, minimum)`` of the Pareto tail every row is decoded to, or None when it is off."""
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
class ShardedCheckpointLearner(Protocol):
    """A learner whose ranks each write their own shard of a checkpoint (optional, e.g. FSDP2).

    ``save_shards`` is called between two steps with an empty directory inside
    the checkpoint being written (``<checkpoint>/shards``); every rank writes
    its files there and the call returns the rest of the state (no tensors in
    ``weights``; ``shard_dir`` set). The checkpoint store then checksums the
    shard files into the same COMMITTED manifest as every other file.
    ``load_shards`` restores from a verified checkpoint's ``shard_dir``, also
    on a different number of ranks than saved it (resharding).
    """

    def save_shards(self, directory: str) -> LearnerState: ...

    def load_shards(self, state: LearnerState) -> None: ...


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

    def stage_shards(self, step: int) -> str:
        """An empty ``shards`` directory inside step ``step``'s (uncommitted) checkpoint, for a sharded learner."""
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
class AdvantageEstimator(Protocol):
    """Turns one step's rewards into per-token advantages, and says which policy loss goes with them.

    ``policy_loss`` is "token" (PPO clip per token) or "sequence" (GSPO);
    ``loss_agg`` the default aggregation when the config leaves it unset;
    ``clip`` (low, high) overrides algo.clip_eps when not None; ``needs_critic``
    asks the engine for a value model; ``kl_in_token_rewards`` means the
    estimator consumes per-token KL itself (else the engine subtracts the
    sequence KL from the rewards when the KL goes into the reward);
    ``max_sample_rounds`` bounds the rollout rounds of one step when
    ``keep_groups`` drops groups (1 = no refill); ``min_group_size`` is the
    smallest G it works with (2 for a group baseline).
    """

    policy_loss: str
    loss_agg: str
    clip: tuple[float, float] | None
    needs_critic: bool
    kl_in_token_rewards: bool
    max_sample_rounds: int
    min_group_size: int

    def shape_rewards(self, rewards: Any, lengths: Any, max_tokens: int) -> Any:
        """Rewards ``[B, G]`` after length shaping (identity for most estimators)."""
        ...

    def keep_groups(self, rewards: Any, valid: Any) -> Any:
        """``[B]`` bool: the groups worth training on (all of them unless the estimator filters)."""
        ...

    def advantages(self, inputs: "AdvantageInputs") -> tuple[Any, Mapping[str, float]]:
        """Per-token advantages ``[N, T]`` (0 outside the action mask) and statistics to log."""
        ...

    def value_targets(self, inputs: "AdvantageInputs") -> Any:
        """The critic's regression targets ``[N, T]`` (None when ``needs_critic`` is False)."""
        ...


@runtime_checkable
class Fault(Protocol):
    """An injectable fault kind (``rlctl inject --fault KIND``): arms handlers at real failure sites."""

    def arm(self, ctx: Any) -> Any:
        """Arm this fault for a run (``ctx`` is a rlctl.engine.faults.FaultContext); return a disarm function."""
        ...


@runtime_checkable
class CriticBackend(Protocol):
    """Owns the value model (a scalar head on the policy's architecture) and its own optimizer."""

    def values(self, batch: "TrainBatch") -> Any:
        """V(s_t) for every token t of the batch, ``[N, T]`` fp32, 0 outside the action mask."""
        ...

    def train_step(self, batch: "TrainBatch", returns: Any, old_values: Any) -> Mapping[str, float]:
        """Regress the values onto ``returns`` ``[N, T]`` (clipped around ``old_values``); return metrics."""
        ...

    def resident_tensors(self) -> Mapping[str, Any]:
        """Tensors held between steps, by memory-ledger term (``"critic parameters"``, ``"critic gradients"``,
        ``"critic optimizer states"``); the dry run measures them against its ledger."""
        ...

    def state(self) -> Mapping[str, Any]:
        """Weights, optimizer and generator state as a tree of JSON data and tensors (private copies)."""
        ...

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore exactly what ``state`` returned; raise CheckpointError if it does not fit."""
        ...


@runtime_checkable
class WeightTransport(Protocol):
    """Moves one weight version from the publisher to its readers (``register_weight_transports``).

    ``send`` moves every shard and then makes the version visible at once
    (never half of one); ``fetch`` returns the newest committed version with
    its verified tensors. ``location`` is where the last version sent went,
    for a reader to open (a directory for the disk transport; "" when nothing
    names it, e.g. in-process hand-over).
    """

    name: str
    location: str

    def send(self, draft: Any, shards: Sequence[Any]) -> Any:
        """Move ``shards`` (rlctl.engine.weight_codec.ShardDraft), then commit ``draft``; the committed
        WeightManifest."""
        ...

    def fetch(self, timeout_s: float | None = None) -> tuple[Any, Mapping[str, Any]]:
        """The newest committed version: its WeightManifest and its verified stored tensors."""
        ...


@runtime_checkable
class ClosableLearner(Protocol):
    """A learner holding processes or actors besides this one (a sharded learner's ranks; optional): the run
    calls ``close`` when it ends, so none of them outlives it. Idempotent."""

    def close(self) -> None: ...


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
    "advantage_estimator": AdvantageEstimator,
    "critic_backend": CriticBackend,
    "fault": Fault,
    "weight_transport": WeightTransport,
    "environment": Environment,
    "tool": Tool,
}
