"""Truncated importance weights for off-policy (stale) samples.

What this is: pure tensor functions for decoupled PPO on stale data. A sample
drawn from an old policy mu is trained with the PPO ratio taken against the
learner's own pre-update policy pi_prox (so the clip bounds the step, not the
staleness), and its advantage is scaled by w = min(pi_prox / mu, cap) per token
(the truncated importance weight that corrects the sampling distribution;
truncation bounds the variance).

What this is not: the decision which samples are stale (rlctl.engine.queue).
"""

from __future__ import annotations

import torch
from torch import Tensor


def truncated_is_weights(prox_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor, cap: float) -> Tensor:
    """Per-token min(exp(log pi_prox - log mu), cap), 0 outside ``mask``; all [N, T].

    >>> w = truncated_is_weights(torch.tensor([[0.0, -1.0]]), torch.tensor([[-1.0, 0.0]]), torch.ones(1, 2), 2.0)
    >>> [round(x, 4) for x in w[0].tolist()]
    [2.0, 0.3679]
    """
    ratio = torch.exp((prox_logprobs - behavior_logprobs).clamp(max=30.0))
    return torch.clamp(ratio, max=cap) * (mask > 0)


def lag_divergence(learner_logprobs: Tensor, behavior_logprobs: Tensor, mask: Tensor) -> Tensor:
    """D_lag per sample: mean over trained tokens of |log pi_learner - log mu|, [N]."""
    on = (mask > 0).float()
    return ((learner_logprobs - behavior_logprobs).abs() * on).sum(-1) / on.sum(-1).clamp(min=1.0)
