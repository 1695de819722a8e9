"""One training step, whatever the mode: the groups a driver selected -> update -> published weights -> metrics.

What this is: ``train_on``. Both loops call it -- the synchronous loop with
the groups it just generated and scored (rlctl.engine.loop), the overlapped
learner loop with the groups it took from the queue (rlctl.engine.overlap) --
so estimation, the critic, the update, D_lag, publishing and the step's
metrics are written once. In order:

1. batch the kept groups (right-padded prompt + response tokens);
2. importance reweighting of the groups the driver marks as beyond the
   staleness bound (decoupled PPO: truncated importance weights against the
   learner's own log-probs, which also replace the behaviour log-probs the
   clip is taken against);
3. advantages (KL-in-reward, the critic's values, the estimator);
4. the critic's update, then the policy's (not during the critic's warm-up),
   capturing log pi before the update (CapturingLearner, else one
   ``logprobs`` pass) for D_lag;
5. publish the new weights to the rollout role;
6. the step's metrics, the same names in every mode (rlctl.engine.metrics).

A step whose groups all lacked signal (a filtering estimator dropped them
all) updates nothing and publishes nothing: the weights, the optimizer's
momentum and the critic stay as they were.

What this is not: how groups arrive (the drivers) or the tensor maths (rlctl.algo).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Sequence

from rlctl.contracts.roles import CapturingLearner
from rlctl.engine.batching import build_batch, turn_rewards
from rlctl.engine.estimation import estimate
from rlctl.engine.groups import Selection
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.metrics import DRIVER_METRICS, overlap_metrics, step_metrics
from rlctl.engine.roles import Roles
from rlctl.engine.spec import LoopSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class StepInput:
    """What a driver hands the step: its selected groups and what it cost to get them."""

    selection: Selection
    times: Mapping[str, float]  # T_r (waiting for / generating rollouts) and T_v (scoring) seconds
    verify_latencies: Sequence[float] = ()
    reweighted: frozenset[int] = frozenset()  # indices of kept groups beyond the staleness bound (reweight them)
    staleness: Sequence[int] | None = None  # dv per kept group; None: learner version - each sample's version
    rollout_latencies: Sequence[float] = ()  # seconds per generated group
    driver: Mapping[str, float] = field(default_factory=dict)  # the driver's own metrics (DRIVER_METRICS)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    metrics: dict[str, float]
    updated: bool  # a batch was trained (critic or policy) and the weights were published
    version: int  # the learner's policy version after the step
    samples: tuple[Any, ...] = ()  # the step's scored samples, most telling first (rlctl.engine.samples)


def train_on(inputs: StepInput, roles: Roles, spec: LoopSpec, *, step: int,
             heartbeat: Heartbeat = NO_HEARTBEAT) -> StepOutcome:
    """Train step ``step`` on the driver's selected groups; see the module docstring."""
    import torch

    sel, beat = inputs.selection, heartbeat.phase
    version = roles.learner.policy_version  # the policy the batch is trained against
    if not sel.kept:
        metrics = _metrics(inputs, spec, scored=sel.no_signal, learner_stats={}, adv_stats={},
                           signal=torch.zeros(len(sel.no_signal)), dlag=[], version=version, trained_version=version,
                           times={"T_l": 0.0, "T_s": 0.0})
        return StepOutcome(metrics=metrics, updated=False, version=version, samples=_samples(sel, spec.group_size))
    t0 = time.perf_counter()
    stats, advantages, dlag = _update(inputs, roles, spec, step, beat)
    t1 = time.perf_counter()
    with beat("publish", "learner"):
        update = roles.learner.export_weights()  # carries the new policy_version
    with beat("publish", "rollout"):
        roles.rollout.update_weights(update)
    t2 = time.perf_counter()
    metrics = _metrics(inputs, spec, scored=sel.kept, learner_stats=stats["learner"], adv_stats=stats["advantages"],
                       signal=advantages.abs().sum(-1), dlag=dlag, version=update.version, trained_version=version,
                       times={"T_l": t1 - t0, "T_s": t2 - t1})
    return StepOutcome(metrics=metrics, updated=True, version=update.version, samples=_samples(sel, spec.group_size))


def _samples(sel: Selection, group_size: int) -> tuple[Any, ...]:
    """The step's samples as the run's sample log keeps them, most telling first: the first trained group, the
    first group dropped for a sample that could not be scored (a failed tool, a grader error), then the rest
    of the trained groups and the groups without signal."""
    g = group_size
    return (*sel.kept[:g], *sel.unscored[:g], *sel.kept[g:], *sel.no_signal)


def _update(inputs: StepInput, roles: Roles, spec: LoopSpec, step: int,
            beat: Any) -> tuple[dict[str, dict[str, float]], Any, list[float]]:
    """Batch, reweight, estimate, train critic and policy; (stats, advantages [N, T], D_lag per sample)."""

    from rlctl.algo.importance import lag_divergence

    sel, learner = inputs.selection, roles.learner
    batch = build_batch(sel.kept, [0.0] * len(sel.kept), roles.tokenizer.pad_token_id, roles.sampling)
    mu, mask = batch.behavior_logprobs, batch.action_mask  # [N, T]: as generated (reweighting replaces some)
    trains_policy = roles.critic is None or step >= spec.critic_warmup_steps  # the critic's warm-up leaves it as is
    capture = trains_policy and isinstance(learner, CapturingLearner)
    prox = None  # log pi_learner of the trained tokens before this update, [N, T]
    if inputs.reweighted or not capture:
        with beat("train", "learner"):
            prox = learner.logprobs(batch).float()
    batch, weight = _reweighted(batch, prox, inputs.reweighted, spec)
    est = estimate(estimator=roles.estimator, batch=batch, rewards=sel.rewards, valid=sel.valid,
                   kl_coef=spec.kl_coef if spec.kl_placement == "reward" else 0.0, kl_estimator=spec.kl_estimator,
                   ref_logprobs=learner.ref_logprobs, values=roles.critic.values if roles.critic is not None else None,
                   turn_rewards=turn_rewards(sel.kept, batch.action_mask.shape[1]))
    advantages = est.advantages.float() * weight  # [N, T]
    batch = replace(batch, advantages=advantages)
    learner_stats: dict[str, float] = {}
    if roles.critic is not None:  # the critic regresses onto returns of the values the advantages used
        with beat("train", "critic"):
            learner_stats.update(roles.critic.train_step(batch, est.returns, est.values))
    if trains_policy:
        with beat("train", "learner"):
            if prox is None:
                assert isinstance(learner, CapturingLearner)
                trained, before = learner.train_step_with_logprobs(batch)
                learner_stats.update(trained)
                prox = before.float()
            else:
                learner_stats.update(learner.train_step(batch))
    dlag = lag_divergence(prox, mu, mask).tolist() if prox is not None else []  # [N]: mean |log pi - log mu|
    return {"learner": learner_stats, "advantages": est.stats}, advantages, dlag


def _reweighted(batch: Any, prox: Any, groups: frozenset[int], spec: LoopSpec) -> tuple[Any, Any]:
    """Groups beyond the staleness bound: truncated importance weights, and the clip anchored at the learner."""
    import torch

    from rlctl.algo.importance import truncated_is_weights

    weight = torch.ones_like(batch.action_mask)  # [N, T]
    if not groups:
        return batch, weight
    g = spec.group_size
    rows = [i for group in sorted(groups) for i in range(group * g, (group + 1) * g)]
    w = truncated_is_weights(prox, batch.behavior_logprobs, batch.action_mask, spec.queue.is_cap)
    weight[rows] = w[rows]
    behavior = batch.behavior_logprobs.clone()
    behavior[rows] = prox[rows]  # decoupled PPO: the clip is taken against the learner's own policy
    return replace(batch, behavior_logprobs=behavior), weight


def _metrics(inputs: StepInput, spec: LoopSpec, *, scored: Sequence[Any], learner_stats: Mapping[str, float],
             adv_stats: Mapping[str, float], signal: Any, dlag: Sequence[float], version: int, trained_version: int,
             times: Mapping[str, float]) -> dict[str, float]:
    sel, g = inputs.selection, spec.group_size
    staleness = ([trained_version - t.policy_version for t in scored] if inputs.staleness is None
                 else [dv for dv in inputs.staleness for _ in range(g)])
    out = step_metrics(scored=scored, learner_stats=learner_stats, adv_stats=adv_stats, advantages=signal,
                       verify_latencies=inputs.verify_latencies, learner_version=version,
                       times={"T_r": inputs.times.get("T_r", 0.0), "T_v": inputs.times.get("T_v", 0.0), **times},
                       trained_version=trained_version, dropped=sel.unscored, group_size=g)
    out.update(overlap_metrics(staleness=staleness, dlag=dlag, latencies=inputs.rollout_latencies,
                               bound=spec.staleness_bound))
    out.update({name: 0.0 for name in DRIVER_METRICS})
    out["groups_trained"] = float(len(sel.kept) // g)
    out["ds_dropped_groups"] = float(len(sel.no_signal) // g)
    out["reweighted_groups"] = float(len(inputs.reweighted))
    out.update({k: float(v) for k, v in inputs.driver.items()})
    out["effective_tokens_per_s"] = out["generated_tokens_per_s"] * out["esr"]
    return out
