"""One step's samples and advantages, whatever the estimator: the part of the loop between rollout and update.

What this is: ``sample_groups`` (generate, score, shape rewards, and for
estimators that filter groups -- DAPO's dynamic sampling -- drop the groups
without signal and sample more prompts until the batch is full again) and
``estimate`` (KL-in-reward, the critic's values, the estimator's per-token
advantages and the critic's targets).

What this is not: the estimators (plugins registered through
``register_advantage_estimators``) or their tensor maths (rlctl.algo).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from rlctl.contracts.batch import AdvantageInputs, TrainBatch
from rlctl.contracts.roles import AdvantageEstimator, RewardFunction, RolloutBackend
from rlctl.contracts.types import PromptRecord, RolloutRequest, Trajectory
from rlctl.contracts.errors import RoleError
from rlctl.engine.batching import drop_unscored_groups, group_rewards
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.scoring import rescore_failed, score_all

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.engine.reward_pool import RewardPool


@dataclass
class SampledGroups:
    """The groups a step trains on (G adjacent samples each) and what it cost to get them."""

    scored: list[Trajectory]  # kept groups, grouped
    rewards: Any  # [B, G] shaped rewards of the kept groups
    valid: Any  # [B, G] bool
    verify_latencies: list[float]
    num_generated_tokens: int  # every generated response token, dropped groups included
    times: dict[str, float]  # T_r (rollout) and T_v (scoring) seconds, summed over rounds
    metrics: dict[str, float] = field(default_factory=dict)
    unscored: list[Trajectory] = field(default_factory=list)  # groups dropped because a grader failed, whole
    seen: list[Trajectory] = field(default_factory=list)  # when ``scored`` is empty: the last round's groups
    # (no signal, so nothing to train on; the step's reward metrics are taken from them)


def sample_groups(*, prompts: Callable[[int], Sequence[PromptRecord]],
                  make_request: Callable[[PromptRecord], RolloutRequest], rollout: RolloutBackend,
                  reward: RewardFunction, answers: Mapping[str, str], estimator: AdvantageEstimator,
                  num_prompts: int, group_size: int, max_tokens: int,
                  truncation_penalty: float | None, fresh_reward: Callable[[], RewardFunction] | None = None,
                  verifier_retries: int = 0, pool: "RewardPool | None" = None,
                  token_budget: float | None = None, heartbeat: Heartbeat = NO_HEARTBEAT) -> SampledGroups:
    """Sample ``num_prompts`` groups; an estimator that filters groups gets refills, up to its round limit.

    Metrics: ``generated_tokens`` (all rounds), and with filtering
    ``ds_dropped_groups`` (groups without signal dropped), ``ds_refill_prompts``
    (prompts sampled beyond the first round), ``ds_sample_rounds`` and
    ``ds_short_groups`` (groups still missing after the last round). When no
    round found a group with signal, ``scored`` is empty: the step has nothing
    to learn from and the caller skips the update.
    ``token_budget`` (the run's generated-token budget still left): no refill
    round starts once this step's rounds have generated that many tokens, so a
    budget-capped run overshoots by less than one round (never by several
    rounds of refills).
    A sample whose grader timed out or crashed is re-scored with a fresh
    grader up to ``verifier_retries`` times; a group still holding one is
    dropped whole (``unscored``: never scored 0, never trained as a partial group).
    ``heartbeat`` is told of every rollout call (``generate``) and grading (``score``).
    """
    import time

    import torch

    rounds = max(1, estimator.max_sample_rounds)
    kept: list[Trajectory] = []
    rewards: list[Any] = []
    valid: list[Any] = []
    latencies: list[float] = []
    generated = dropped = refill = 0
    last: tuple[list[Trajectory], Any, Any] | None = None
    done_rounds = 0
    times = {"T_r": 0.0, "T_v": 0.0}
    unscored: list[Trajectory] = []
    verify_stats: dict[str, float] = {}
    for round_index in range(rounds):
        need = num_prompts - len(rewards)
        if need <= 0 or (round_index and token_budget is not None and generated >= token_budget):
            break
        done_rounds += 1
        if round_index:
            refill += need
        t0 = time.perf_counter()
        with heartbeat.phase("generate", "rollout"):
            trajectories = rollout.generate([make_request(p) for p in prompts(need)])
        t1 = time.perf_counter()
        generated += sum(t.num_response_tokens for t in trajectories)
        with heartbeat.phase("score", "reward"):
            scored, lat = score_all(trajectories, answers, reward, truncation_penalty, pool=pool)
            retry_reward = fresh_reward or (lambda: reward)
            scored, stats = rescore_failed(scored, answers, retry_reward, verifier_retries, truncation_penalty)
        scored, lost = drop_unscored_groups(scored, group_size)
        unscored += lost
        for k, v in stats.items():
            verify_stats[k] = verify_stats.get(k, 0.0) + v
        times["T_r"] += t1 - t0
        times["T_v"] += time.perf_counter() - t1
        latencies += lat
        if not scored:
            continue
        r, v = group_rewards(scored, group_size)  # [b, G]
        lengths = torch.tensor([t.num_response_tokens for t in scored]).view_as(r)
        r = estimator.shape_rewards(r, lengths, max_tokens)
        keep = estimator.keep_groups(r, v)  # [b]
        last = (scored, r, v)
        for g in range(r.shape[0]):
            if bool(keep[g]):
                kept += scored[g * group_size:(g + 1) * group_size]
                rewards.append(r[g])
                valid.append(v[g])
            else:
                dropped += 1
    if not rewards and last is None:
        raise unscorable_batch(unscored, verifier_retries)
    seen: list[Trajectory] = []
    if not rewards:  # no group with signal in any round: an empty batch (the loop skips the update), never a
        seen = last[0]  # batch of all-equal groups (zero advantages, but the optimizer's momentum would still move)
        r_all = torch.zeros(0, group_size)
        v_all = torch.zeros(0, group_size, dtype=torch.bool)
    else:
        r_all, v_all = torch.stack(rewards), torch.stack(valid)
    metrics = {"generated_tokens": float(generated),  # dropped groups count: they cost generation time
               "generated_tokens_per_s": generated / times["T_r"] if times["T_r"] > 0 else 0.0}
    if rounds > 1:
        metrics.update(ds_dropped_groups=float(dropped), ds_refill_prompts=float(refill),
                       ds_sample_rounds=float(done_rounds), ds_short_groups=float(max(0, num_prompts - len(rewards))))
    if done_rounds > 1 and "verifier_fail_frac" in verify_stats:
        verify_stats["verifier_fail_frac"] /= done_rounds
    metrics.update(verify_stats)
    return SampledGroups(scored=kept, rewards=r_all, valid=v_all, verify_latencies=latencies,
                         num_generated_tokens=generated, times=times, metrics=metrics, unscored=unscored, seen=seen)


def unscorable_batch(unscored: Sequence[Trajectory], verifier_retries: int) -> RoleError:
    """The error that stops a run when every group of a step was dropped for a sample the grader could not score.

    One message for the synchronous and the overlapped loop, naming the most
    common error codes.
    """
    codes: dict[str, int] = {}
    for t in unscored:
        if t.reward_error is not None:
            codes[t.reward_error] = codes.get(t.reward_error, 0) + 1
    shown = ", ".join(f"{n} x {code}" for code, n in sorted(codes.items(), key=lambda kv: -kv[1])[:3])
    return RoleError(f"every group had a sample the grader could not score after {verifier_retries} retries "
                     f"with a fresh grader ({shown}; none scored 0)", "see `rlctl runbook show verifier-timeouts`")


@dataclass
class Estimate:
    """Per-token advantages for the learner, plus the critic's inputs when there is one."""

    advantages: Any  # [N, T]
    stats: dict[str, float]
    values: Any | None = None  # [N, T] critic values before the update
    returns: Any | None = None  # [N, T] critic targets


def estimate(*, estimator: AdvantageEstimator, batch: TrainBatch, rewards: Any, valid: Any, kl_coef: float,
             kl_estimator: str, ref_logprobs: Callable[[TrainBatch], Any],
             values: Callable[[TrainBatch], Any] | None) -> Estimate:
    """Advantages of one batch: the KL penalty into the reward when ``kl_coef`` > 0, then the estimator.

    ``kl_coef`` is the coefficient of KL-in-the-reward (0 when the KL goes into
    the loss, the learner's business); ``ref_logprobs`` the learner's reference
    log-probs; ``values`` the critic's (required when the estimator needs one).
    An estimator that takes per-token rewards gets the per-token KL; the others
    get the sequence sum subtracted from the reward.
    """
    from rlctl.algo.kl import kl_estimate, kl_shaped_rewards

    token_kl = None
    stats: dict[str, float] = {}
    if kl_coef > 0:
        ref = ref_logprobs(batch)  # [N, T]
        if estimator.kl_in_token_rewards:
            token_kl = kl_estimate(batch.behavior_logprobs, ref, kl_estimator) * batch.action_mask  # [N, T]
            stats["kl_ref_reward"] = float(token_kl.sum() / batch.action_mask.sum().clamp(min=1))
        else:
            rewards = kl_shaped_rewards(rewards, batch.behavior_logprobs, ref, batch.action_mask, kl_coef,
                                        kl_estimator)
    v = None
    if estimator.needs_critic:
        if values is None:
            raise ValueError("this estimator needs a critic but none was built")
        v = values(batch)  # [N, T]
    inputs = AdvantageInputs(rewards=rewards, valid=valid, action_mask=batch.action_mask, token_kl=token_kl,
                             kl_coef=kl_coef if token_kl is not None else 0.0, values=v)
    adv, adv_stats = estimator.advantages(inputs)
    stats.update({k: float(x) for k, x in adv_stats.items()})
    targets = estimator.value_targets(inputs) if estimator.needs_critic else None
    return Estimate(advantages=adv, stats=stats, values=v, returns=targets)
