"""Which scored groups a step trains on, whatever the mode: the part of the loop between scoring and the update.

What this is: ``select_groups`` (a group with a sample its grader could not
score is dropped whole; rewards are shaped by the estimator; an estimator that
filters groups -- DAPO's dynamic sampling -- drops the groups without signal)
and ``sample_groups``, the synchronous loop's way of getting a step's groups:
generate, score, select, and sample more prompts while a filtering estimator
left the batch short. The overlapped loop takes its groups from the queue and
selects them with the same ``select_groups``.

What this is not: the estimators (plugins registered through
``register_advantage_estimators``) or their tensor maths (rlctl.algo).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.contracts.roles import AdvantageEstimator, RewardFunction, RolloutBackend
from rlctl.contracts.types import PromptRecord, RolloutRequest, Trajectory
from rlctl.engine.batching import drop_unscored_groups, group_rewards, sampled_lengths
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.scoring import rescore_failed, score_all

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.engine.reward_pool import RewardPool


@dataclass
class Selection:
    """Scored groups split into what a step trains on and what it drops (G adjacent samples per group)."""

    kept: list[Trajectory]  # kept groups, grouped
    rewards: Any  # [B', G] shaped rewards of the kept groups
    valid: Any  # [B', G] bool
    unscored: list[Trajectory]  # groups with an unscored sample (grader, failed tool): dropped whole, never scored 0
    no_signal: list[Trajectory]  # groups the estimator filtered out (DAPO: all rewards equal)


def select_groups(scored: Sequence[Trajectory], estimator: AdvantageEstimator, group_size: int,
                  max_tokens: int) -> Selection:
    """Drop unscored groups whole, shape the rewards, keep the groups the estimator keeps."""
    import torch

    scorable, unscored = drop_unscored_groups(scored, group_size)
    if not scorable:
        return Selection(kept=[], rewards=torch.zeros(0, group_size), valid=torch.zeros(0, group_size,
                         dtype=torch.bool), unscored=unscored, no_signal=[])
    rewards, valid = group_rewards(scorable, group_size)  # [b, G]
    lengths = torch.tensor(sampled_lengths(scorable)).view_as(rewards)  # an episode: its longest policy turn
    rewards = estimator.shape_rewards(rewards, lengths, max_tokens)
    keep = estimator.keep_groups(rewards, valid)  # [b] bool
    kept_rows = [g for g in range(rewards.shape[0]) if bool(keep[g])]
    groups = [scorable[g * group_size:(g + 1) * group_size] for g in range(rewards.shape[0])]
    return Selection(kept=[t for g in kept_rows for t in groups[g]], rewards=rewards[kept_rows],
                     valid=valid[kept_rows], unscored=unscored,
                     no_signal=[t for g in range(len(groups)) if g not in kept_rows for t in groups[g]])


@dataclass
class SampledGroups:
    """The synchronous loop's groups for one step and what it cost to get them."""

    selection: Selection  # every round's kept groups together; the last round's dropped ones
    generated_tokens: int  # every generated response token, dropped groups included
    times: dict[str, float]  # T_r (rollout) and T_v (scoring) seconds, summed over rounds
    verify_latencies: list[float]
    metrics: dict[str, float] = field(default_factory=dict)
    unscored: list[Trajectory] = field(default_factory=list)  # every round's groups dropped for a grader failure
    no_signal: list[Trajectory] = field(default_factory=list)  # every round's groups without signal


@dataclass
class Sampler:
    """How the synchronous loop gets a step's groups: its roles and settings, fixed for the run."""

    prompts: Callable[[int], Sequence[PromptRecord]]
    make_request: Callable[[PromptRecord], RolloutRequest]
    rollout: RolloutBackend
    reward: RewardFunction
    answers: Mapping[str, str]
    estimator: AdvantageEstimator
    group_size: int
    max_tokens: int
    truncation_penalty: float | None
    fresh_reward: Callable[[], RewardFunction] | None = None
    verifier_retries: int = 0
    pool: "RewardPool | None" = None
    heartbeat: Heartbeat = NO_HEARTBEAT


def sample_groups(sampler: Sampler, num_prompts: int, token_budget: float | None = None) -> SampledGroups:
    """Sample ``num_prompts`` groups; an estimator that filters groups gets refills, up to its round limit.

    Metrics: ``ds_dropped_groups`` (groups without signal dropped),
    ``ds_refill_prompts`` (prompts sampled beyond the first round),
    ``ds_sample_rounds`` and ``ds_short_groups`` (groups still missing after
    the last round), and the grader's ``verifier_*`` counters. When no round
    found a group with signal, nothing is kept: the caller skips the update.
    ``token_budget`` (the run's generated-token budget still left): no refill
    round starts once this step's rounds generated that many tokens, so a
    budget-capped run overshoots by less than one round.
    A sample whose grader timed out or crashed is re-scored with a fresh
    grader up to ``verifier_retries`` times; a group still holding one is
    dropped whole (never scored 0, never trained as a partial group).
    """
    import torch

    s, g = sampler, sampler.group_size
    rounds = max(1, s.estimator.max_sample_rounds)
    kept: list[Trajectory] = []
    rewards: list[Any] = []
    valid: list[Any] = []
    out = SampledGroups(selection=Selection([], None, None, [], []), generated_tokens=0,
                        times={"T_r": 0.0, "T_v": 0.0}, verify_latencies=[])
    verify: dict[str, float] = {}
    done = refill = 0
    for round_index in range(rounds):
        need = num_prompts - len(kept) // g
        if need <= 0 or (round_index and token_budget is not None and out.generated_tokens >= token_budget):
            break
        done += 1
        refill += need if round_index else 0
        scored = _one_round(s, need, out, verify)
        selection = select_groups(scored, s.estimator, g, s.max_tokens)
        out.unscored += selection.unscored
        out.no_signal += selection.no_signal
        kept += selection.kept
        rewards.append(selection.rewards)
        valid.append(selection.valid)
    if not kept and not out.no_signal:
        raise unscorable_batch(out.unscored, s.verifier_retries)
    out.selection = Selection(kept=kept, rewards=torch.cat(rewards), valid=torch.cat(valid), unscored=out.unscored,
                              no_signal=out.no_signal)
    if done > 1 and "verifier_fail_frac" in verify:
        verify["verifier_fail_frac"] /= done
    out.metrics = {"ds_dropped_groups": float(len(out.no_signal) // g), "ds_refill_prompts": float(refill),
                   "ds_sample_rounds": float(done), "ds_short_groups": float(max(0, num_prompts - len(kept) // g)),
                   **verify}
    return out


def _one_round(s: Sampler, need: int, out: SampledGroups, verify: dict[str, float]) -> list[Trajectory]:
    """Generate ``need`` prompts' groups and score them (retrying failed graders); account into ``out``."""
    t0 = time.perf_counter()
    with s.heartbeat.phase("generate", "rollout"):
        trajectories = s.rollout.generate([s.make_request(p) for p in s.prompts(need)])
    t1 = time.perf_counter()
    out.generated_tokens += sum(t.num_policy_tokens for t in trajectories)
    with s.heartbeat.phase("score", "reward"):
        scored, latencies = score_all(trajectories, s.answers, s.reward, s.truncation_penalty, pool=s.pool)
        retry_reward = s.fresh_reward or (lambda: s.reward)
        scored, stats = rescore_failed(scored, s.answers, retry_reward, s.verifier_retries, s.truncation_penalty)
    for k, v in stats.items():
        verify[k] = verify.get(k, 0.0) + v
    out.times["T_r"] += t1 - t0
    out.times["T_v"] += time.perf_counter() - t1
    out.verify_latencies += latencies
    return scored


def request_encoder(roles: Any, group_size: int) -> Callable[[PromptRecord], RolloutRequest]:
    """Prompt -> rollout request for the G samples of a prompt, each prompt's tokens encoded once per run."""
    encoded: dict[str, tuple[int, ...]] = {}
    tokenizer, sampling, version = roles.tokenizer, roles.sampling, roles.task.version

    def request(p: PromptRecord) -> RolloutRequest:
        if p.id not in encoded:
            encoded[p.id] = tuple(tokenizer(p.text)["input_ids"])
        return RolloutRequest(prompt_id=p.id, prompt_tokens=encoded[p.id], group_size=group_size,
                              sampling=sampling, dataset_version=version)

    return request


def unscorable_batch(unscored: Sequence[Trajectory], verifier_retries: int) -> RoleError:
    """The error that stops a run when every group of a step was dropped for a sample that could not be scored.

    One message for every mode, counting the samples by cause (a tool call that failed for good, an engine
    abort, the grader) with the most common error codes of each, and pointing at the runbook of the first.
    """
    causes: dict[str, dict[str, int]] = {"tool": {}, "abort": {}, "grader": {}}
    for t in unscored:
        if t.reward_error is not None:
            cause = ("tool" if t.reward_error.startswith("tool_") else "abort" if t.reward_error == "aborted"
                     else "grader")
            causes[cause][t.reward_error] = causes[cause].get(t.reward_error, 0) + 1
    what = {"tool": f"whose tool call failed after {verifier_retries} retries",
            "abort": "the rollout engine aborted",
            "grader": f"the grader could not score after {verifier_retries} retries with a fresh grader"}
    parts = []
    for cause, codes in causes.items():
        if codes:
            shown = ", ".join(f"{n} x {code}" for code, n in sorted(codes.items(), key=lambda kv: -kv[1])[:3])
            parts.append(f"{sum(codes.values())} sample(s) {what[cause]} ({shown})")
    book = "tool-failures" if causes["tool"] else "verifier-timeouts"
    return RoleError(f"every group was dropped whole for samples that could not be scored: {'; '.join(parts)} "
                     "(none scored 0)", f"see `rlctl runbook show {book}`")
