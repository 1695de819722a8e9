"""Scoring: turn trajectories into scored trajectories with the mixed reward.

What this is: calls the configured ``MixedReward`` on each trajectory, applies
the truncation rule (responses cut at max_tokens get ``truncation_penalty``
instead of their graded reward), and records components, grader version and
errors on the trajectory. An error is kept as ``reward_error``: the sample is
excluded from the advantage, never scored as a silent zero. An episode whose
tool call failed for good (rlctl.engine.episodes.episode_failure; the driver
already retried it) is not graded: ``reward_error`` "tool_timeout: ..." etc.

What this is not: a reward function (plugins/rlctl_rewards) or a sandbox.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Mapping, Sequence

from rlctl.contracts.roles import BatchRewardFunction, RewardFunction
from rlctl.contracts.types import RewardResult, TerminalReason, Trajectory
from rlctl.engine.episodes import episode_failure

if TYPE_CHECKING:
    from rlctl.engine.reward_pool import RewardPool


def score_all(trajectories: Sequence[Trajectory], references: Mapping[str, str], reward: RewardFunction,
              truncation_penalty: float | None,
              pool: "RewardPool | None" = None) -> tuple[list[Trajectory], list[float]]:
    """Scored copies of ``trajectories`` (same order) and each scoring latency in seconds.

    With ``pool`` the samples are graded in parallel worker processes (same
    results, same order); without it, in this process, through ``score_batch``
    when the reward has one (the mixed reward does) and one by one otherwise.
    """
    flagged = {id(t): why for t in trajectories if t.turns and (why := episode_failure(t)) is not None}
    todo = [t for t in trajectories if t.terminal_reason is not TerminalReason.ABORT and id(t) not in flagged]
    graded = None
    if pool is not None:
        graded = iter(pool.score(todo, [references[t.prompt_id] for t in todo]))
    elif isinstance(reward, BatchRewardFunction):  # the mixed reward: batch-capable components get one call
        graded = iter(reward.score_batch(todo, [references[t.prompt_id] for t in todo]))
    scored, latencies = [], []
    for traj in trajectories:
        started = time.perf_counter()
        if traj.terminal_reason is TerminalReason.ABORT:
            scored.append(traj.updated(reward_error="aborted", scored_at=time.time()))
            latencies.append(0.0)
            continue
        if id(traj) in flagged:  # a tool call failed for good: unscored (its group is dropped), never a 0
            scored.append(traj.updated(reward_error=flagged[id(traj)], scored_at=time.time()))
            latencies.append(0.0)
            continue
        if graded is not None:
            result = next(graded)
            scored.append(_apply(traj, result, truncation_penalty))
            latencies.append(result.latency_s)
        else:
            scored.append(_score_one(traj, references[traj.prompt_id], reward, truncation_penalty))
            latencies.append(time.perf_counter() - started)
    return scored, latencies


def _score_one(traj: Trajectory, reference: str, reward: RewardFunction, truncation_penalty: float | None) -> Trajectory:
    return _apply(traj, reward.score(traj, reference), truncation_penalty)


def _apply(traj: Trajectory, result: "RewardResult", truncation_penalty: float | None) -> Trajectory:
    total = result.total
    if traj.terminal_reason is TerminalReason.LENGTH and truncation_penalty is not None:
        total = truncation_penalty
    return traj.updated(
        reward=None if result.error_code else total, reward_components=dict(result.components),
        reward_error=result.error_code, grader_version=result.grader_version, scored_at=time.time(),
    )


def retryable(error: str | None) -> bool:
    """Timeouts and grader crashes are infrastructure failures worth a retry; a verdict (invalid_reward) is not."""
    return error is not None and (error.startswith("timeout") or error.startswith("grader_error"))


def rescore_failed(scored: Sequence[Trajectory], references: Mapping[str, str], fresh: Callable[[], RewardFunction],
                   retries: int, truncation_penalty: float | None) -> tuple[list[Trajectory], dict[str, float]]:
    """Re-score samples whose grader timed out or crashed, each attempt with a fresh grader, up to ``retries``.

    Returns the updated list (same order) and counters: ``verifier_fail_frac``
    (share of samples whose first attempt failed), ``verifier_retries`` (grader
    calls spent on retries) and ``verifier_recovered`` (samples a retry scored).
    A sample still failing keeps its error: the caller drops its whole group.
    """
    out = list(scored)
    failed = [i for i, t in enumerate(out) if retryable(t.reward_error)]
    stats = {"verifier_fail_frac": len(failed) / len(out) if out else 0.0, "verifier_retries": 0.0,
             "verifier_recovered": 0.0}
    for _ in range(retries):
        if not failed:
            break
        grader = fresh()
        still = []
        for i in failed:
            stats["verifier_retries"] += 1
            out[i] = _score_one(out[i], references[out[i].prompt_id], grader, truncation_penalty)
            if retryable(out[i].reward_error):
                still.append(i)
            else:
                stats["verifier_recovered"] += 1
        failed = still
    return out, stats
