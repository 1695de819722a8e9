"""Logit processing (temperature, top-k, top-p) and the log-probs it implies.

What this is: the single definition of the sampling distribution. The rollout
sampler draws from ``process_logits`` and the learner recomputes
``token_logprobs`` with the same settings, so behaviour log-probs and
recomputed log-probs describe the same distribution (the PPO ratio pi/mu is
only meaningful then).

What this is not: a sampler (no RNG, no generation loop, no stop tokens) and
not a place for repetition penalties or other engine-specific processors.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _check(temperature: float, top_k: int, top_p: float) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {top_p}")


def _top_k(logits: Tensor, top_k: int) -> Tensor:
    # Ties with the k-th value are all kept, so a few more than k may survive.
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: Tensor, top_p: float) -> Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [..., V]
    probs = torch.softmax(sorted_logits, dim=-1)  # [..., V]
    mass_before = torch.cumsum(probs, dim=-1) - probs  # [..., V]
    # Drop a token once the tokens ranked above it already reach top_p; this
    # keeps the smallest prefix with mass >= top_p. The top token always stays.
    drop_sorted = mass_before >= top_p  # [..., V]
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)  # [..., V]
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """Apply temperature, then top-k, then top-p to ``logits [..., V]``.

    Removed entries become -inf; the result is fp32. ``top_k=0`` and
    ``top_p=1`` switch those filters off. Top-p keeps the smallest set of
    highest-probability tokens whose mass (after temperature and top-k) is
    >= ``top_p``, and always keeps the top token.

    ``temperature == 0`` means greedy decoding: the logits come back unchanged
    (not even cast) and the caller takes the argmax; top-k/top-p do not change
    the argmax so they are not applied.
    """
    _check(temperature, top_k, top_p)
    if temperature == 0:
        return logits
    out = logits.float() / temperature  # [..., V]
    vocab_size = out.shape[-1]
    if 0 < top_k < vocab_size:
        out = _top_k(out, top_k)
    if top_p < 1.0:
        out = _top_p(out, top_p)
    return out


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
) -> Tensor:
    """Log-prob of each token under the processed distribution: ``[N, T, V]``, ``[N, T]`` -> ``[N, T]`` fp32.

    Equal to ``log_softmax(process_logits(...)).gather(tokens)``. A token that
    the filters removed gets -inf (left visible: it means sampler and learner
    disagree about the kept set). With ``temperature == 0`` the log-probs are
    those of the raw logits (temperature 1); greedy rollouts have no useful
    behaviour distribution, so RL sampling should use temperature > 0.

    Fast path (``top_k == 0`` and ``top_p == 1``): logp = x[token] -
    logsumexp(x) with x = logits / T in fp32, which holds at most one fp32
    ``[N, T, V]`` copy besides the input (none for fp32 input at T = 1).
    """
    _check(temperature, top_k, top_p)
    index = tokens.long().unsqueeze(-1)  # [N, T, 1]
    if top_k == 0 and top_p >= 1.0:
        x = _scaled_fp32(logits, temperature or 1.0)  # [N, T, V]
        picked = x.gather(-1, index).squeeze(-1)  # [N, T]
        return picked - torch.logsumexp(x, dim=-1)
    processed = process_logits(logits, temperature, top_k, top_p).float()  # [N, T, V]
    return torch.log_softmax(processed, dim=-1).gather(-1, index).squeeze(-1)


def _scaled_fp32(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` in fp32 with at most one new ``[..., V]`` tensor."""
    if logits.dtype == torch.float32:
        return logits if temperature == 1.0 else logits / temperature
    x = logits.float()  # fresh copy, safe to scale in place (its backward saves nothing)
    return x if temperature == 1.0 else x.div_(temperature)
