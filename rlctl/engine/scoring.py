"""Scoring: turn trajectories into scored trajectories with the mixed reward.

What this is: calls the configured ``MixedReward`` on each trajectory, applies
the truncation rule (responses cut at max_tokens get ``truncation_penalty``
instead of their graded reward), and records components, grader version and
errors on the trajectory. An error is kept as ``reward_error``: the sample is
excluded from the advantage, never scored as a silent zero.

What this is not: a reward function (plugins/rlctl_rewards) or a sandbox.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping, Sequence

from rlctl.contracts.roles import RewardFunction
from rlctl.contracts.types import TerminalReason, Trajectory

if TYPE_CHECKING:
    from rlctl.engine.reward_pool import RewardPool


def score_all(trajectories: Sequence[Trajectory], references: Mapping[str, str], reward: RewardFunction,
              truncation_penalty: float | None,
              pool: "RewardPool | None" = None) -> tuple[list[Trajectory], list[float]]:
    """Scored copies of ``trajectories`` (same order) and each scoring latency in seconds.

    With ``pool`` the samples are graded in parallel worker processes (same
    results, same order); without it, one by one in this process.
    """
    todo = [t for t in trajectories if t.terminal_reason is not TerminalReason.ABORT]
    if pool is not None:
        graded = iter(pool.score(todo, [references[t.prompt_id] for t in todo]))
    scored, latencies = [], []
    for traj in trajectories:
        started = time.perf_counter()
        if traj.terminal_reason is TerminalReason.ABORT:
            scored.append(traj.updated(reward_error="aborted", scored_at=time.time()))
            latencies.append(0.0)
            continue
        result = next(graded) if pool is not None else reward.score(traj, references[traj.prompt_id])
        total = result.total
        if traj.terminal_reason is TerminalReason.LENGTH and truncation_penalty is not None:
            total = truncation_penalty
        scored.append(traj.updated(
            reward=None if result.error_code else total, reward_components=dict(result.components),
            reward_error=result.error_code, grader_version=result.grader_version, scored_at=time.time(),
        ))
        latencies.append(result.latency_s if pool is not None else time.perf_counter() - started)
    return scored, latencies
