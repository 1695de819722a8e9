"""Pure tensor functions for RL post-training: advantages, KL estimators, losses, sampling.

What this is: stateless functions over tensors (GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE
advantages, DAPO's group filter and overlong penalty, GSPO's sequence-level loss,
truncated importance weights, the critic's value loss,
k1/k2/k3 KL estimates, PPO clip and KL losses, token aggregation, and the
logit processing shared by the sampler and the learner). Sensitive reductions
run in fp32 and NaN is never hidden.

What this is not: a learner, a sampler or a trainer. Nothing here touches
models, optimizers, configs, plugins or I/O; the engine and the learner
plugins compose these functions.
"""

from rlctl.algo.advantages import (
    gae,
    grpo_advantages,
    informative_groups,
    outcome_token_rewards,
    overlong_penalty,
    reinforce_pp_advantages,
    rloo_advantages,
    whiten,
)
from rlctl.algo.kl import exact_categorical_kl, kl_estimate
from rlctl.algo.losses import (
    aggregate,
    entropy_from_logits,
    explained_variance,
    gspo_loss,
    kl_penalty_loss,
    ppo_clip_loss,
    truncated_is_weights,
    value_loss,
)
from rlctl.algo.sampling import process_logits, token_logprobs

__all__ = [
    "grpo_advantages",
    "gae",
    "rloo_advantages",
    "reinforce_pp_advantages",
    "outcome_token_rewards",
    "whiten",
    "informative_groups",
    "overlong_penalty",
    "gspo_loss",
    "truncated_is_weights",
    "value_loss",
    "explained_variance",
    "kl_estimate",
    "exact_categorical_kl",
    "aggregate",
    "ppo_clip_loss",
    "kl_penalty_loss",
    "entropy_from_logits",
    "process_logits",
    "token_logprobs",
]
