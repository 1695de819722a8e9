"""Policy-gradient losses: PPO clip, KL-in-loss, entropy, token aggregation.

What this is: pure tensor functions over ``[N, T]`` per-token quantities with
a response mask (prompt and padding tokens never count). Ratios and log-ratios are
computed in fp32; NaN is never clamped away, only padding is kept out with
``torch.where``.

What this is not: a learner. No optimizer, no model call, no micro-batching,
no config parsing. Metrics come back as plain floats for the caller to log.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor

from rlctl.algo.kl import KLKind, kl_estimate

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _masked(per_token: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-token values with padding set to 0 (NaN there cannot leak), and the mask as float."""
    m = mask.bool()  # [N, T]
    values = torch.where(m, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    return values, m.to(per_token.dtype)


def _token_mean(values: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    # One weight per token: long sequences weigh more.
    return values.sum() / m.sum().clamp(min=1.0)


def _seq_mean_token_mean(values: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    # One weight per sequence; sequences without tokens are left out.
    lengths = m.sum(dim=-1)  # [N]
    seq_means = values.sum(dim=-1) / lengths.clamp(min=1.0)  # [N]
    has_tokens = (lengths > 0).to(values.dtype)  # [N]
    return (seq_means * has_tokens).sum() / has_tokens.sum().clamp(min=1.0)


def _seq_mean_token_sum_norm(values: Tensor, m: Tensor, norm_len: int | None) -> Tensor:
    # Dr.GRPO: a constant divisor removes the length bias of per-sequence means.
    if norm_len is None or norm_len <= 0:
        raise ValueError(
            "aggregation 'seq-mean-token-sum-norm' needs norm_len > 0 "
            f"(got {norm_len!r}); pass the max response length"
        )
    num_seqs = max(values.shape[0], 1)
    return values.sum() / (num_seqs * norm_len)


_AGGREGATORS: dict[str, Callable[[Tensor, Tensor, int | None], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def aggregate(per_token: Tensor, mask: Tensor, mode: AggMode, norm_len: int | None = None) -> Tensor:
    """Reduce ``per_token [N, T]`` over masked tokens to a scalar.

    - ``token-mean``: sum over masked tokens / number of masked tokens.
    - ``seq-mean-token-mean``: mean over sequences with >= 1 masked token of
      each sequence's token mean.
    - ``seq-mean-token-sum-norm``: each sequence's token sum / ``norm_len``
      (e.g. the max response length), averaged over all N sequences (Dr.GRPO).

    ``norm_len`` is read only by the last mode. An all-zero mask gives 0, still
    attached to the graph, never NaN.
    """
    try:
        aggregator = _AGGREGATORS[mode]
    except KeyError:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {sorted(_AGGREGATORS)}") from None
    if per_token.shape != mask.shape or per_token.dim() != 2:
        raise ValueError(
            f"per_token and mask must both be [N, T]; got {tuple(per_token.shape)} and {tuple(mask.shape)}"
        )
    values, m = _masked(per_token, mask)
    return aggregator(values, m, norm_len)


def ppo_clip_loss(
    logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    agg: AggMode,
    norm_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate against the behaviour policy mu (the distribution the tokens were sampled from).

    All inputs ``[N, T]``. r_t = exp(logp - behavior_logp) in fp32 and
    loss_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t), then
    ``aggregate(loss_t, mask, agg, norm_len)``. Clipped tokens get no gradient.

    Metrics (floats over masked tokens): ``clip_fraction`` (share of tokens
    where the clipped term is the smaller one, so the objective is flat),
    ``ratio_mean``, ``ratio_max``, ``approx_kl_behavior`` (k3 estimate of
    KL(mu || pi), the learner's lag behind the sampler) and ``loss``.
    """
    log_ratio = logp.float() - behavior_logp.float()  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    adv = advantages.float()  # [N, T]
    unclipped = ratio * adv  # [N, T]
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv  # [N, T]
    per_token = -torch.minimum(unclipped, clipped)  # [N, T]
    loss = aggregate(per_token, mask, agg, norm_len)

    with torch.no_grad():
        m = mask.bool()
        num_tokens = int(m.sum())
        is_clipped = (clipped < unclipped) & m
        # Tokens were sampled from mu, so k3 with pi/mu as the ratio estimates KL(mu || pi).
        kl_lag = kl_estimate(behavior_logp, logp, "k3")  # [N, T]
        metrics = {
            "clip_fraction": float(is_clipped.sum()) / max(num_tokens, 1),
            "ratio_mean": float(aggregate(ratio, m, "token-mean")),
            "ratio_max": float(ratio[m].max()) if num_tokens else 0.0,
            "approx_kl_behavior": float(aggregate(kl_lag, m, "token-mean")),
            "loss": float(loss),
        }
    return loss, metrics


def kl_penalty_loss(
    logp: Tensor,
    ref_logp: Tensor,
    mask: Tensor,
    kind: KLKind,
    agg: AggMode,
    norm_len: int | None = None,
) -> tuple[Tensor, float]:
    """KL(pi || ref) as a loss term (KL-in-loss); the caller scales by beta.

    Returns ``(loss, mean_kl)``: the aggregated per-token estimate (with grad)
    and its token-mean as a float for logging.
    """
    per_token = kl_estimate(logp, ref_logp, kind)  # [N, T]
    loss = aggregate(per_token, mask, agg, norm_len)
    with torch.no_grad():
        mean_kl = float(aggregate(per_token, mask, "token-mean"))
    return loss, mean_kl


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: ``[N, T, V]`` -> ``[N, T]``, fp32.

    Entries at -inf (masked by top-k/top-p) contribute exactly 0 and give no
    NaN in forward or backward. A row that is -inf everywhere has no
    distribution and yields NaN, which is left visible.
    """
    log_p = torch.log_softmax(logits.float(), dim=-1)  # [N, T, V]
    p = log_p.exp()  # [N, T, V]
    # Replace log p before the product, so the backward pass never sees 0 * -inf.
    safe_log_p = torch.where(p > 0, log_p, torch.zeros((), dtype=log_p.dtype, device=log_p.device))
    return -(p * safe_log_p).sum(dim=-1)
