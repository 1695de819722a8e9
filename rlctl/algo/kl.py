"""Per-token KL estimators (Schulman's k1, k2, k3) and KL-in-reward shaping.

What this is: pure functions turning per-token log-probabilities of the
sampled tokens into per-token estimates of KL(pi || ref), where the tokens were
sampled from pi. Also an exact categorical KL used to check the estimators.

What this is not: a loss (see losses.py), or a choice of which two policies to
compare. The same estimator serves policy -> reference (drift) and
learner -> behaviour (lag); those are different quantities and the caller
names which one it logs.
"""

from __future__ import annotations

from typing import Callable, Literal

import torch
from torch import Tensor

KLKind = Literal["k1", "k2", "k3"]


def _k1(x: Tensor) -> Tensor:
    # Unbiased, high variance, can be negative per token.
    return x


def _k2(x: Tensor) -> Tensor:
    # Biased, low variance, >= 0; its gradient is the one of KL to first order.
    return 0.5 * x * x


def _k3(x: Tensor) -> Tensor:
    # Unbiased and >= 0. expm1 keeps precision for small x, and because
    # expm1(-x) >= -x holds after rounding, the sum never goes below 0.
    return torch.expm1(-x) + x


_ESTIMATORS: dict[str, Callable[[Tensor], Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: KLKind) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled under pi.

    With x = logp - ref_logp (so the ratio ref/pi is e^(-x)):
    k1 = x, k2 = x^2 / 2, k3 = e^(-x) - 1 + x. Same shape as the inputs
    (e.g. ``[N, T]``), always fp32 (or fp64 if given fp64). Padding positions
    are not special here: mask them in the aggregation. -inf log-probs give
    inf or NaN, which is left visible on purpose.

    >>> kl_estimate(torch.tensor([0.0]), torch.tensor([0.0]), "k3").tolist()
    [0.0]
    """
    try:
        estimator = _ESTIMATORS[kind]
    except KeyError:
        raise ValueError(
            f"unknown KL estimator {kind!r}; choose one of {sorted(_ESTIMATORS)}"
        ) from None
    dtype = torch.promote_types(logp.dtype, torch.float32)
    x = logp.to(dtype) - ref_logp.to(dtype)
    return estimator(x)


def exact_categorical_kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """Exact KL(p || q) between categoricals given by logits ``[..., V]`` -> ``[...]``.

    Entries where p is 0 contribute 0 (the 0 * log 0 convention). Meant for
    tests and diagnostics, fp32.
    """
    log_p = torch.log_softmax(p_logits.float(), dim=-1)  # [..., V]
    log_q = torch.log_softmax(q_logits.float(), dim=-1)  # [..., V]
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def kl_shaped_rewards(rewards: Tensor, behavior_logp: Tensor, ref_logp: Tensor, action_mask: Tensor, coef: float,
                      kind: KLKind) -> Tensor:
    """Sequence rewards minus ``coef`` x the summed per-token KL(behaviour || reference) of each response.

    KL in the reward (rather than in the loss) penalises drift before the group
    baseline is taken, so it moves advantages, not the gradient directly.
    ``rewards`` is [B, G]; the log-probs and mask are [B*G, T] in the same order.
    Prompt, padding and an episode's environment tokens (mask 0) contribute
    nothing, whatever log-probs they hold (``torch.where``, not a product, so
    an inf there cannot turn into NaN).
    """
    per_token = kl_estimate(behavior_logp, ref_logp, kind)  # [B*G, T]
    zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
    kl_seq = torch.where(action_mask > 0, per_token, zero).sum(-1)  # [B*G]
    return rewards - coef * kl_seq.view_as(rewards)
