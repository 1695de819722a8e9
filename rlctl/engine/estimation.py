"""One batch's advantages, whatever the estimator: KL-in-reward, the critic's values, the estimator, the targets.

What this is: ``estimate``, which the training step (rlctl.engine.step) calls
between batching and the update: the KL penalty into the reward when it goes
there, the critic's values when the estimator needs them, the estimator's
per-token advantages and the critic's regression targets.

What this is not: the estimators (plugins registered through
``register_advantage_estimators``) or their tensor maths (rlctl.algo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from rlctl.contracts.batch import AdvantageInputs, TrainBatch
from rlctl.contracts.roles import AdvantageEstimator


@dataclass
class Estimate:
    """Per-token advantages for the learner, plus the critic's inputs when there is one."""

    advantages: Any  # [N, T]
    stats: dict[str, float]
    values: Any | None = None  # [N, T] critic values before the update
    returns: Any | None = None  # [N, T] critic targets


def estimate(*, estimator: AdvantageEstimator, batch: TrainBatch, rewards: Any, valid: Any, kl_coef: float,
             kl_estimator: str, ref_logprobs: Callable[[TrainBatch], Any],
             values: Callable[[TrainBatch], Any] | None, turn_rewards: Any = None) -> Estimate:
    """Advantages of one batch: the KL penalty into the reward when ``kl_coef`` > 0, then the estimator.

    ``kl_coef`` is the coefficient of KL-in-the-reward (0 when the KL goes into
    the loss, the learner's business); ``ref_logprobs`` the learner's reference
    log-probs; ``values`` the critic's (required when the estimator needs one).
    An estimator that takes per-token rewards gets the per-token KL; the others
    get the sequence sum subtracted from the reward. ``rewards`` are episode
    returns; ``turn_rewards`` ([N, T] or None, rlctl.engine.batching.turn_rewards)
    the per-turn parts inside them, for estimators that work per token.
    """
    import torch

    from rlctl.algo.kl import kl_estimate, kl_shaped_rewards

    token_kl = None
    stats: dict[str, float] = {}
    if kl_coef > 0:
        ref = ref_logprobs(batch)  # [N, T]
        if estimator.kl_in_token_rewards:
            on = batch.action_mask > 0  # the policy's tokens: an episode's environment tokens get no KL term
            token_kl = torch.where(on, kl_estimate(batch.behavior_logprobs, ref, kl_estimator), 0.0)  # [N, T]
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
                             kl_coef=kl_coef if token_kl is not None else 0.0, values=v, turn_rewards=turn_rewards)
    adv, adv_stats = estimator.advantages(inputs)
    stats.update({k: float(x) for k, x in adv_stats.items()})
    targets = estimator.value_targets(inputs) if estimator.needs_critic else None
    return Estimate(advantages=adv, stats=stats, values=v, returns=targets)
