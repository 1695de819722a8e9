"""What the training loops need to know of a run's config, and nothing else.

What this is: ``LoopSpec`` (every mode: batch shape, KL, stop conditions,
logging) with its ``QueueSpec`` (the trajectory queue and the staleness bound
of the overlapped driver), and ``check_loop_options``, which refuses at start
an option that could not work the same in every mode and placement.

Modes differ only in how far rollout may run ahead of the learner
(``max_ahead``): sync 0 (batch s is generated with version s, so dv = 0),
one_step_off 1, async ``queue.max_staleness``.

What this is not: the loops (rlctl.engine.loop, rlctl.engine.overlap) or the
user-facing config models (rlctl.config).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rlctl.contracts.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.config.models import RunConfig
    from rlctl.contracts.roles import AdvantageEstimator

MODES = ("sync", "one_step_off", "async")


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueSpec:
    """The overlapped driver's queue: how far rollout runs ahead, and what happens to stale groups."""

    max_staleness: int = 1  # async: the bound on dv (policy versions a group may lag behind)
    stale_policy: Literal["drop", "reweight"] = "drop"
    is_cap: float = 2.0  # reweight: truncation cap of the per-token importance weight
    capacity: int | None = None  # groups buffered + in flight; None = (max_ahead + 1) * B
    ttl_s: float | None = None
    rollout_chunk: int | None = None  # prompts per worker call; None = ceil(B / workers)
    take_timeout_s: float = 600.0
    segment_bytes: int = 64 << 20
    partial_fraction: float = 1.0  # a step proceeds once this share of its B groups is ready (1 = all)
    continuous: bool = False  # workers whose engine can: one call across weight versions, groups out as they end
    max_worker_restarts: int = 3
    max_learner_restarts: int = 3


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopSpec:
    """The loop's view of a run: the same spec drives the synchronous and the overlapped loop."""

    steps: int  # total steps of the run (a resumed run starts later, ends here)
    prompts_per_step: int  # B
    group_size: int  # G
    mode: Literal["sync", "one_step_off", "async"] = "sync"
    truncation_penalty: float | None = 0.0  # reward of a response cut at max_tokens (None: graded as is)
    max_tokens: int = 0  # rollout.max_tokens: estimators that shape rewards by length read it
    kl_coef: float = 0.0
    kl_placement: Literal["reward", "loss"] = "loss"  # "loss" is the learner's business
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    log_every: int = 1  # sinks get every log_every-th step and the last one
    max_generated_tokens: int | None = None  # stop after the step whose running total reaches this
    max_wall_seconds: float | None = None  # stop after the step at which the loop's seconds reach this
    critic_warmup_steps: int = 0  # steps that train only the critic (read only when there is a critic)
    logprob_mismatch_bound: float | None = None  # stop when a step's logprob_mismatch_max exceeds this
    verifier_retries: int = 0  # re-score a timed-out / crashed sample with a fresh grader up to N times
    queue: QueueSpec = field(default_factory=QueueSpec)

    @property
    def max_ahead(self) -> int:
        """Batches rollout may run ahead of the learner: the mode's only difference."""
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.queue.max_staleness)

    @property
    def staleness_bound(self) -> int:
        return self.max_ahead

    @property
    def min_groups(self) -> int | None:
        """Partial rollout: the fewest groups a step proceeds with; None = the whole batch."""
        if self.queue.partial_fraction >= 1:
            return None
        return max(1, math.ceil(self.queue.partial_fraction * self.prompts_per_step))

    @property
    def capacity(self) -> int:
        return self.queue.capacity or (self.max_ahead + 1) * self.prompts_per_step

    def logs(self, step: int, spent: bool) -> bool:
        """Whether the sinks get ``step``: every ``log_every``-th, the last, and the one that spent the budget."""
        return step % self.log_every == 0 or step == self.steps - 1 or spent

    def spent(self, generated_total: float, seconds: float = 0.0) -> bool:
        """Whether a budget is spent: the generated tokens or the loop's wall-clock seconds so far."""
        return ((self.max_generated_tokens is not None and generated_total >= self.max_generated_tokens)
                or (self.max_wall_seconds is not None and seconds >= self.max_wall_seconds))

    @classmethod
    def from_config(cls, config: "RunConfig") -> "LoopSpec":
        a, s = config.algo, config.staleness
        queue = QueueSpec(max_staleness=s.max_staleness, stale_policy=s.stale_policy, is_cap=s.is_cap,
                          capacity=s.queue_capacity, ttl_s=s.queue_ttl_s, rollout_chunk=s.rollout_chunk,
                          take_timeout_s=s.take_timeout_s, segment_bytes=s.queue_segment_bytes,
                          partial_fraction=s.partial_fraction, continuous=s.continuous_rollout,
                          max_worker_restarts=config.cluster.max_restarts,
                          max_learner_restarts=config.cluster.max_restarts)
        return cls(steps=config.train.steps, prompts_per_step=a.prompts_per_step, group_size=a.group_size,
                   mode=config.mode, truncation_penalty=config.rollout.truncation_penalty,
                   max_tokens=config.rollout.max_tokens, kl_coef=a.kl.coef, kl_placement=a.kl.placement,
                   kl_estimator=a.kl.estimator, log_every=config.train.log_every,
                   max_generated_tokens=config.train.max_generated_tokens,
                   max_wall_seconds=config.train.max_wall_seconds, critic_warmup_steps=a.critic.warmup_steps,
                   verifier_retries=config.faults.verifier_retries, queue=queue,
                   logprob_mismatch_bound=config.train.logprob_mismatch_bound)


def overlapped(config: "RunConfig") -> bool:
    """Whether a run goes through the overlapped driver (its rollout workers feed a queue) or the plain loop."""
    return config.mode != "sync" or config.cluster.backend == "ray"


def check_loop_options(config: "RunConfig", estimator: "AdvantageEstimator") -> None:
    """Refuse, before any model work, a loop option that cannot work the same way in this run's mode.

    Every other loop option (token budget, seeds, stop conditions, metrics,
    faults, live alerts, heartbeat phases, critic warm-up, verifier retries)
    behaves the same in every mode and placement.
    """
    rounds = estimator.max_sample_rounds
    if rounds > 1 and overlapped(config):
        raise ConfigError(
            f"algo.name={config.algo.name} refills filtered groups (up to {rounds} sampling rounds per step), which "
            f"mode={config.mode} with cluster.backend={config.cluster.backend} cannot do: a refill needs prompts "
            "beyond the step's batch, and the trajectory queue admits a prompt only while its batch index is within "
            "staleness.max_staleness of the learner, so the learner would wait for groups no worker may generate",
            "set algo.options.max_sample_rounds=1 (groups without signal are dropped, counted in "
            "ds_dropped_groups, and the step trains on the rest), or train with mode=sync cluster.backend=local")
    if config.staleness.queue_ttl_s is not None and config.mode == "sync":
        raise ConfigError("staleness.queue_ttl_s drops queued groups by age, but mode=sync trains every batch as "
                          "soon as it is generated (no queue in the local placement), so the setting would change "
                          "what is trained only under cluster.backend=ray",
                          "unset staleness.queue_ttl_s, or set mode=one_step_off or mode=async")


def ignored_options(config: "RunConfig") -> list[str]:
    """Options the user set that this mode and placement do not use (the run warns about each)."""
    notes = []
    workers = type(config.cluster).model_fields["num_rollout_workers"].default
    # by value, not by model_fields_set: a resumed run's stored config sets every field; one worker is what
    # mode=sync runs anyway (configs/quickstart.yaml sets it for its overlapped modes)
    if not overlapped(config) and config.cluster.num_rollout_workers not in (workers, 1):
        notes.append(f"cluster.num_rollout_workers={config.cluster.num_rollout_workers} is ignored: mode=sync on "
                     "cluster.backend=local generates with one engine in this process (the overlapped modes and "
                     "the Ray placement use the workers)")
    return notes
