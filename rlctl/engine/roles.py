"""The built roles of a run, frozen, and the point a run (re)starts from.

What this is: ``Roles``, what the placement layer (rlctl.placement) hands the
loops once every role is built where it lives (in this process, or behind a
handle to a Ray actor): task, tokenizer, rollout, learner, reward, estimator,
critic, data cursor. No field is ever reassigned: a driver that needs other
objects (a dry run's metered roles) builds another ``Roles`` with
``dataclasses.replace``. ``ResumePoint`` is the explicit start of a loop: the
completed steps and the trajectory queue's cursor of the overlapped driver.

What this is not: building roles (rlctl.placement) or running them (rlctl.engine.loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from rlctl.contracts.roles import AdvantageEstimator, CriticBackend, LearnerBackend, RewardFunction, RolloutBackend
from rlctl.contracts.types import SamplingConfig, TaskData
from rlctl.engine.batching import PromptCursor

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.config.models import RunConfig
    from rlctl.engine.reward_pool import RewardPool


@dataclass(frozen=True, slots=True, kw_only=True)
class Roles:
    """Every role of one run, built where it lives; see the module docstring.

    ``rollout`` is a rollout backend in this process (the synchronous local
    loop) or a RolloutFleet over several workers (threads or Ray actors) for
    the overlapped driver. ``reward_pool`` grades in parallel worker processes
    or actors when ``reward.workers`` > 1.
    """

    config: "RunConfig"
    task: TaskData
    policy_dir: Path
    tokenizer: Any
    tokenizer_hash: str
    rollout: RolloutBackend
    learner: LearnerBackend
    reward: RewardFunction
    estimator: AdvantageEstimator
    cursor: PromptCursor
    sampling: SamplingConfig
    critic: CriticBackend | None = None  # the value model, when the estimator needs one
    reward_factory: Callable[[], RewardFunction] | None = None  # a fresh grader, for retries after a timeout/crash
    reward_pool: "RewardPool | None" = None


@dataclass(frozen=True, slots=True)
class ResumePoint:
    """Where a loop starts: ``step`` completed steps, and the overlapped driver's queue cursor (None: a fresh queue).

    >>> ResumePoint(0)
    ResumePoint(step=0, queue_cursor=None)
    """

    step: int
    queue_cursor: Mapping[str, Any] | None = None


START = ResumePoint(0)
