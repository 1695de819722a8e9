"""Advantage estimators: group-relative (GRPO, Dr.GRPO, RLOO), batch-whitened (REINFORCE++) and GAE (PPO).

What this is: pure tensor functions from rewards (and values) to advantages,
plus the reward-side pieces of DAPO (informative groups, overlong penalty).
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
    """Generalised advantage estimation over the policy's tokens.

    ``rewards``, ``values``, ``mask`` are ``[N, T]``; ``mask`` marks the
    policy's tokens (the steps). delta_t = r_t + gamma * V_{t'} - V_t and
    A_t = delta_t + gamma * lam * A_{t'}, where t' is the NEXT MASKED position
    after t, and V_{t'} and A_{t'} count as 0 past the last one (the episode
    ends there). Positions outside ``mask`` are not steps: prompt and padding,
    and in a multi-turn episode the environment's tokens between two policy
    turns, carry no reward, no value and no discount (their rewards and values
    are never read), so the recursion runs over the policy-token subsequence
    as if the environment's tokens were not there. For a contiguous response
    this is plain per-token GAE. Returns ``(advantages [N, T], returns [N, T])``
    with returns = A + V; both are 0 outside ``mask``. Computed in fp32 without
    gradient (targets, not outputs).

    >>> m = torch.tensor([[1.0, 0.0, 0.0, 1.0]])  # a policy token, two environment tokens, a policy token
    >>> adv, _ = gae(torch.tensor([[0.0, 9.0, 9.0, 1.0]]), torch.zeros(1, 4), m, gamma=0.5, lam=1.0)
    >>> adv.tolist()
    [[0.5, 0.0, 0.0, 1.0]]
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
            prev_adv = next_adv
            next_adv = delta + gamma * lam * next_adv
            adv[:, t] = next_adv
            # A masked position t becomes "next" for the policy token before it; an unmasked one (padding,
            # an environment token) is skipped, so "next" stays the next policy token's (0 past the last).
            # torch.where (not a multiply) so NaN outside the mask cannot leak in.
            next_value = torch.where(m[:, t], v[:, t], next_value)
            next_adv = torch.where(m[:, t], next_adv, prev_adv)
        adv = torch.where(m, adv, zero)
        returns = torch.where(m, adv + v, zero)
    return adv, returns


def rloo_advantages(rewards: Tensor, valid: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """Leave-one-out advantages A_i = r_i - mean_{j != i} r_j over the valid samples of each group.

    ``rewards`` and ``valid`` are ``[B, G]`` as in ``grpo_advantages``. The
    baseline of sample i never contains r_i, so A is an unbiased policy-gradient
    weight; with n valid samples it equals n / (n - 1) * (r_i - mean). Groups
    with fewer than two valid samples or all-equal rewards get exactly 0, and so
    do invalid samples.

    >>> rloo_advantages(torch.tensor([[1.0, 0.0, 0.0]]))[0].tolist()
    [[1.0, -0.5, -0.5]]
    """
    centered, stats = grpo_advantages(rewards, valid, normalize_std=False, eps=0.0)  # [B, G]
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    n = valid.sum(dim=-1, keepdim=True).to(centered.dtype)  # [B, 1]
    return centered * n / (n - 1.0).clamp(min=1.0), stats


def whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (biased std), 0 elsewhere; fp32.

    All-equal masked values carry no signal and give exactly 0 (decided from
    max == min, because the rounded mean of equal values can differ from them
    by an ulp, which divided by a ~0 std would be noise of order 1).
    """
    m = mask.bool()
    x = values.to(_compute_dtype(values))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    if not bool(m.any()) or bool(x[m].max() == x[m].min()):
        return torch.zeros_like(x)
    count = m.sum().to(x.dtype)
    mean = torch.where(m, x, zero).sum() / count
    var = torch.where(m, (x - mean) ** 2, zero).sum() / count
    return torch.where(m, (x - mean) / (var.sqrt() + eps), zero)


def outcome_token_rewards(rewards: Tensor, mask: Tensor, token_kl: Tensor | None = None,
                          kl_coef: float = 0.0, turn_rewards: Tensor | None = None) -> Tensor:
    """Per-token rewards: the sequence reward on its last masked token, minus ``kl_coef * token_kl`` on every one.

    ``rewards`` is ``[N]``, ``mask`` and ``token_kl`` ``[N, T]``. The mask
    marks the policy's tokens, so in a multi-turn episode the reward lands on
    the policy's last token (never on an environment token) and no
    environment token carries a KL term. ``turn_rewards`` ``[N, T]`` are an
    episode's per-turn rewards at the policy tokens that earned them, already
    counted in ``rewards`` (the episode return): they stay where they are and
    the last token gets the rest, so the row still sums to its return. This is
    the reward that PPO's GAE and REINFORCE++'s returns consume; invalid rows
    are the caller's to mask (pass them with an all-zero mask row).

    >>> m = torch.tensor([[1.0, 1.0, 0.0, 1.0]])  # the turn reward -0.5 was earned by token 1
    >>> outcome_token_rewards(torch.tensor([0.5]), m, turn_rewards=torch.tensor([[0.0, -0.5, 0.0, 0.0]])).tolist()
    [[0.0, -0.5, 0.0, 1.0]]
    """
    m = mask.bool()  # [N, T]
    dtype = _compute_dtype(rewards)
    zero = torch.zeros((), dtype=dtype, device=rewards.device)
    out = torch.zeros(m.shape, dtype=dtype, device=rewards.device)  # [N, T]
    has = m.any(dim=-1)  # [N]
    last = (m.to(torch.int64) * torch.arange(m.shape[1], device=m.device)).argmax(dim=-1)  # [N]
    rows = torch.arange(m.shape[0], device=m.device)
    final = rewards.to(dtype)
    if turn_rewards is not None:
        turns = torch.where(m, turn_rewards.to(dtype), zero)  # [N, T]
        final = final - turns.sum(dim=-1)
        out = out + turns
    out[rows[has], last[has]] += final[has]
    if token_kl is not None and kl_coef:
        out = out - kl_coef * torch.where(m, token_kl.to(dtype), zero)
    return out


def reinforce_pp_advantages(rewards: Tensor, mask: Tensor, valid: Tensor | None = None,
                            token_kl: Tensor | None = None, kl_coef: float = 0.0,
                            eps: float = 1e-8, turn_rewards: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE++: undiscounted token returns with the KL penalty in the reward, whitened over the batch.

    ``rewards`` ``[N]`` (one per sequence), ``mask`` ``[N, T]`` response tokens,
    ``valid`` ``[N]`` bool (invalid rows get 0 and stay out of the statistics),
    ``token_kl`` ``[N, T]`` per-token KL(pi_old || ref) estimates, ``turn_rewards``
    ``[N, T]`` an episode's per-turn rewards (inside ``rewards``; see
    ``outcome_token_rewards``). The return at
    token t is sum_{t' >= t} (reward_t' - kl_coef * kl_t') over the masked
    (policy) tokens t' (an episode's environment tokens add nothing), so a
    turn reward counts for the tokens before it only; advantages
    are the returns normalised by the mean and std over every valid token of
    the batch (a global baseline instead of a critic or a group), 0 elsewhere.
    """
    if valid is None:
        valid = torch.ones(rewards.shape, dtype=torch.bool, device=rewards.device)
    m = mask.bool() & valid.view(-1, 1)  # [N, T]
    zero = torch.zeros((), dtype=_compute_dtype(rewards), device=rewards.device)
    safe = torch.where(valid, rewards.to(zero.dtype), zero)  # invalid rewards may be NaN
    token_r = outcome_token_rewards(safe, m, token_kl, kl_coef, turn_rewards)  # [N, T]
    returns = torch.flip(torch.cumsum(torch.flip(token_r, [1]), dim=1), [1])  # [N, T]
    adv = whiten(returns, m, eps)
    picked = returns[m]
    stats = {"return_mean": float(picked.mean()) if picked.numel() else 0.0,
             "return_std": float(picked.std(unbiased=False)) if picked.numel() else 0.0}
    return adv, stats


def informative_groups(rewards: Tensor, valid: Tensor | None = None) -> Tensor:
    """``[B]`` bool: groups whose valid rewards are not all equal (DAPO dynamic sampling keeps only these).

    A group with fewer than two valid samples carries no group-relative signal
    either and counts as not informative.
    """
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    r = rewards.to(_compute_dtype(rewards))
    inf = torch.full((), float("inf"), dtype=r.dtype, device=r.device)
    r_max = torch.where(valid, r, -inf).amax(dim=-1)  # [B]
    r_min = torch.where(valid, r, inf).amin(dim=-1)  # [B]
    return (valid.sum(dim=-1) >= 2) & (r_max > r_min)


def overlong_penalty(lengths: Tensor, max_tokens: int, buffer: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment, added to the reward: 0 up to ``max_tokens - buffer`` tokens,
    then falling linearly to ``-factor`` at ``max_tokens`` (and ``-factor`` beyond).

    ``lengths`` is any shape of response lengths; returns fp32 of the same shape.

    >>> overlong_penalty(torch.tensor([6, 8, 10]), max_tokens=10, buffer=4).tolist()
    [0.0, -0.5, -1.0]
    """
    if buffer <= 0 or buffer > max_tokens:
        raise ValueError(f"overlong buffer must be in 1..max_tokens={max_tokens}, got {buffer}")
    excess = lengths.to(torch.float32) - float(max_tokens - buffer)
    return -factor * (excess / float(buffer)).clamp(min=0.0, max=1.0)
