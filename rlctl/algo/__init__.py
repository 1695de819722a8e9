"""Pure tensor functions for RL post-training: advantages, KL estimators, losses, sampling.

What this is: stateless functions over tensors (GRPO and GAE advantages,
k1/k2/k3 KL estimates, PPO clip and KL losses, token aggregation, and the
logit processing shared by the sampler and the learner). Sensitive reductions
run in fp32 and NaN is never hidden.

What this is not: a learner, a sampler or a trainer. Nothing here touches
models, optimizers, configs, plugins or I/O; the engine and the learner
plugins compose these functions.
"""

from rlctl.algo.advantages import gae, grpo_advantages
from rlctl.algo.kl import exact_categorical_kl, kl_estimate
from rlctl.algo.losses import aggregate, entropy_from_logits, kl_penalty_loss, ppo_clip_loss
from rlctl.algo.sampling import process_logits, token_logprobs

__all__ = [
    "grpo_advantages",
    "gae",
    "kl_estimate",
    "exact_categorical_kl",
    "aggregate",
    "ppo_clip_loss",
    "kl_penalty_loss",
    "entropy_from_logits",
    "process_logits",
    "token_logprobs",
]
