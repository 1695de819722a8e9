"""Policy-gradient losses: PPO clip, GSPO, KL-in-loss, entropy, token aggregation, truncated
importance weights, and the critic's clipped value loss.

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
    is_weights: Tensor | None = None,
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
    if is_weights is not None:
        per_token = per_token * is_weights.detach().float()
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


def gspo_loss(
    logp: Tensor,
    behavior_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO: one importance ratio and one clip decision per sequence.

    s_i = exp(mean over the response tokens of (logp - behavior_logp)), the
    length-normalised sequence likelihood ratio, and
    loss = mean_i -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)
    over sequences with at least one response token. ``advantages`` is
    ``[N, T]`` with the sequence's advantage on its tokens (the masked mean is
    taken). ``is_weights`` ``[N, T]`` (truncated importance weights) enter as
    their per-sequence mean. Inputs are ``[N, T]``; ratios in fp32.

    Metrics: ``clip_fraction`` (share of sequences clipped), ``ratio_mean``,
    ``ratio_max`` (sequence ratios), ``approx_kl_behavior`` (token k3) and ``loss``.
    """
    m = mask.bool()  # [N, T]
    mf = m.float()
    lengths = mf.sum(-1)  # [N]
    has = lengths > 0  # [N]
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    log_ratio = torch.where(m, logp.float() - behavior_logp.float(), zero)  # [N, T]
    seq_log_ratio = log_ratio.sum(-1) / lengths.clamp(min=1.0)  # [N]
    ratio = torch.exp(seq_log_ratio)  # [N]
    adv = torch.where(m, advantages.float(), zero).sum(-1) / lengths.clamp(min=1.0)  # [N]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_seq = -torch.minimum(unclipped, clipped)  # [N]
    if is_weights is not None:
        w = torch.where(m, is_weights.detach().float(), zero).sum(-1) / lengths.clamp(min=1.0)
        per_seq = per_seq * w
    loss = torch.where(has, per_seq, zero).sum() / has.sum().clamp(min=1)
    with torch.no_grad():
        num = int(has.sum())
        kl_lag = kl_estimate(behavior_logp, logp, "k3")
        metrics = {
            "clip_fraction": float(((clipped < unclipped) & has).sum()) / max(num, 1),
            "ratio_mean": float(ratio[has].mean()) if num else 0.0,
            "ratio_max": float(ratio[has].max()) if num else 0.0,
            "approx_kl_behavior": float(aggregate(kl_lag, m, "token-mean")),
            "loss": float(loss),
        }
    return loss, metrics


def truncated_is_weights(old_logp: Tensor, behavior_logp: Tensor, mask: Tensor,
                         cap: float) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance weights w_t = min(pi_old(y_t) / mu(y_t), cap) for off-policy correction.

    ``old_logp`` are the learner's log-probs before the update, ``behavior_logp``
    the sampler's (``[N, T]``). The learner's PPO ratio is then taken against
    pi_old and each token's loss is scaled by w (no gradient). In a synchronous
    run pi_old and mu hold the same weights, so w measures sampler/learner
    numeric mismatch; with stale samples it corrects the lag.

    Metrics (masked tokens): ``tis_weight_mean``, ``tis_truncated_frac`` (share
    of tokens at the cap), ``is_ratio_max`` (the untruncated max).
    """
    if cap <= 0:
        raise ValueError(f"importance-sampling cap must be > 0, got {cap}")
    m = mask.bool()
    with torch.no_grad():
        ratio = torch.exp(old_logp.float() - behavior_logp.float())  # [N, T]
        weights = torch.where(m, ratio.clamp(max=cap), torch.zeros((), dtype=ratio.dtype))  # [N, T]
        num = int(m.sum())
        metrics = {
            "tis_weight_mean": float(weights.sum()) / max(num, 1),
            "tis_truncated_frac": float(((ratio > cap) & m).sum()) / max(num, 1),
            "is_ratio_max": float(ratio[m].max()) if num else 0.0,
        }
    return weights, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip: float | None) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss 0.5 * max((V - R)^2, (V_clip - R)^2), token mean over ``mask``.

    V_clip = V_old + clamp(V - V_old, -clip, clip) keeps the critic from moving
    far from the values the advantages were computed with; ``clip=None`` gives
    the plain squared error. All inputs ``[N, T]``. Metrics: ``value_loss``,
    ``value_clip_fraction`` (tokens where the clipped term is the larger one).
    """
    v = values.float()
    r = returns.float()
    err = (v - r) ** 2
    if clip is None:
        per_token = err
        clipped_frac = torch.zeros(())
    else:
        v_clip = old_values.float() + torch.clamp(v - old_values.float(), -clip, clip)
        err_clip = (v_clip - r) ** 2
        per_token = torch.maximum(err, err_clip)
        clipped_frac = ((err_clip > err) & mask.bool()).sum() / mask.bool().sum().clamp(min=1)
    loss = 0.5 * aggregate(per_token, mask, "token-mean")
    return loss, {"value_loss": float(loss.detach()), "value_clip_fraction": float(clipped_frac)}


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var(R - V) / Var(R) over masked tokens: 1 = perfect critic, 0 = no better than a constant.

    NaN when the returns have zero variance (explained variance is undefined
    then; it is reported, not hidden).
    """
    m = mask.bool()
    r = returns.float()[m]
    v = values.float()[m]
    var_r = r.var(unbiased=False)
    return float(1.0 - (r - v).var(unbiased=False) / var_r) if float(var_r) > 0 else float("nan")
