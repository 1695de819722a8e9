"""Advantage estimators: group-relative (GRPO) and GAE (PPO).

What this is: pure tensor functions from rewards (and values) to advantages.
They run in fp32 (or wider, if given wider) because reward normalisation is a
sensitive reduction: bf16 means and stds would bias the advantages.

What this is not: reward computation, KL-in-reward shaping, or anything that
knows about models, batches or configs. The caller decides which samples are
valid (a grader timeout or error is not a zero score: the sample is left
out) and passes a mask.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(x: Tensor) -> torch.dtype:
    # fp32 at least; keep fp64 if the caller already has it.
    return torch.promote_types(x.dtype, torch.float32)


def grpo_advantages(
    rewards: Tensor,
    valid: Tensor | None = None,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages A_i = (r_i - mean(group)) / (std(group) + eps).

    ``rewards`` is ``[B, G]``: B prompts, G samples each. ``valid`` (bool
    ``[B, G]``, default all True) marks samples whose reward is usable; invalid
    ones (reward errors, timeouts) are left out of the group mean and std and
    get advantage 0. Their reward value is never read, so it may be NaN.

    The std is the unbiased sample std (divides by n - 1), as ``torch.std`` and
    TRL use. With ``normalize_std=False`` the advantage is just r_i - mean
    (Dr.GRPO). A group whose valid rewards are all equal, or that has fewer than
    two valid samples, carries no signal: its advantages are exactly 0 (no NaN,
    no eps-sized noise). A NaN reward on a *valid* sample propagates on purpose.

    Returns ``(advantages [B, G], stats)`` where stats has ``frac_zero_std``
    (fraction of groups with zero std or < 2 valid samples) and
    ``reward_std_mean`` (mean std over groups with >= 2 valid samples; 0 if none).

    >>> adv, _ = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), normalize_std=False)
    >>> adv.tolist()
    [[0.5, -0.5, -0.5, 0.5]]
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got shape {tuple(rewards.shape)}")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    if valid.shape != rewards.shape or valid.dtype != torch.bool:
        raise ValueError("valid must be a bool tensor with the same shape as rewards")
    r = rewards.to(_compute_dtype(rewards))  # [B, G]
    zero = torch.zeros((), dtype=r.dtype, device=r.device)
    r_valid = torch.where(valid, r, zero)  # [B, G]; invalid rewards may be NaN
    n = valid.sum(dim=-1, keepdim=True).to(r.dtype)  # [B, 1]
    mean = r_valid.sum(dim=-1, keepdim=True) / n.clamp(min=1.0)  # [B, 1]
    centered = torch.where(valid, r - mean, zero)  # [B, G]
    var = (centered * centered).sum(dim=-1, keepdim=True) / (n - 1.0).clamp(min=1.0)
    std = var.sqrt()  # [B, 1]

    # Equal rewards can still give a tiny nonzero centred value from rounding of
    # the mean; decide "no signal" from max == min over valid entries instead.
    inf = torch.full((), float("inf"), dtype=r.dtype, device=r.device)
    r_max = torch.where(valid, r, -inf).amax(dim=-1, keepdim=True)  # [B, 1]
    r_min = torch.where(valid, r, inf).amin(dim=-1, keepdim=True)  # [B, 1]
    multi = n >= 2  # [B, 1]
    no_signal = ~multi | (r_max == r_min)  # [B, 1]

    adv = centered / (std + eps) if normalize_std else centered
    adv = torch.where(no_signal | ~valid, zero, adv)  # [B, G]

    num_multi = int(multi.sum())
    stats = {
        "frac_zero_std": float(no_signal.to(r.dtype).mean()) if r.shape[0] else 0.0,
        "reward_std_mean": float(std[multi].sum() / num_multi) if num_multi else 0.0,
    }
    return adv, stats


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over token positions.

    ``rewards``, ``values``, ``mask`` are ``[N, T]``; ``mask`` marks response
    tokens. delta_t = r_t + gamma * V_{t+1} - V_t and
    A_t = delta_t + gamma * lam * A_{t+1}, where V_{t+1} and A_{t+1} count as 0
    past the last valid token (the episode ends there). Returns
    ``(advantages [N, T], returns [N, T])`` with returns = A + V; both are 0 at
    masked positions. Computed in fp32 without gradient (targets, not outputs).
    """
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError("rewards, values and mask must all be [N, T] with equal shapes")
    dtype = _compute_dtype(rewards)
    with torch.no_grad():
        r = rewards.to(dtype)  # [N, T]
        v = values.to(dtype)  # [N, T]
        m = mask.bool()  # [N, T]
        zero = torch.zeros((), dtype=dtype, device=r.device)
        adv = torch.zeros_like(r)  # [N, T]
        next_adv = torch.zeros_like(r[:, 0])  # [N]
        next_value = torch.zeros_like(r[:, 0])  # [N]
        for t in reversed(range(r.shape[1])):
            delta = r[:, t] + gamma * next_value - v[:, t]  # [N]
            next_adv = delta + gamma * lam * next_adv
            adv[:, t] = next_adv
            # Position t becomes "next" for t - 1; padding there ends the episode.
            # torch.where (not a multiply) so NaN in padding cannot leak in.
            next_value = torch.where(m[:, t], v[:, t], zero)
            next_adv = torch.where(m[:, t], next_adv, zero)
        adv = torch.where(m, adv, zero)
        returns = torch.where(m, adv + v, zero)
    return adv, returns
