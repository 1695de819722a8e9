"""Estimators beyond GRPO (Dr.GRPO, RLOO, REINFORCE++, GSPO, DAPO, PPO) and truncated IS: hand-computed values
plus property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.algo import (
    explained_variance,
    grpo_advantages,
    gspo_loss,
    informative_groups,
    outcome_token_rewards,
    overlong_penalty,
    ppo_clip_loss,
    reinforce_pp_advantages,
    rloo_advantages,
    truncated_is_weights,
    value_loss,
    whiten,
)

FAST = settings(max_examples=60, deadline=None)
groups = st.integers(2, 6).flatmap(
    lambda g: st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0, 1.1, -0.5]), min_size=g, max_size=g),
                       min_size=1, max_size=4))


def _close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0), (actual, expected)


# ---------------------------------------------------------------- RLOO


def test_rloo_hand_computed():
    # r = [1, 0, 0, 1]: baseline of sample 0 = (0 + 0 + 1) / 3 = 1/3 -> A_0 = 2/3
    adv, _ = rloo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    _close(adv, [[2 / 3, -2 / 3, -2 / 3, 2 / 3]])


def test_rloo_invalid_sample_is_left_out_of_every_baseline():
    adv, _ = rloo_advantages(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]),
                             torch.tensor([[True, False, True, True]]))
    _close(adv, [[1.0, 0.0, -0.5, -0.5]])


@FAST
@given(groups)
def test_rloo_property_baseline_excludes_the_sample_itself(rows):
    rewards = torch.tensor(rows, dtype=torch.float64)
    adv, _ = rloo_advantages(rewards)
    g = rewards.shape[1]
    for b in range(rewards.shape[0]):
        for i in range(g):
            others = torch.cat([rewards[b, :i], rewards[b, i + 1:]])
            _close(adv[b, i], rewards[b, i] - others.mean(), tol=1e-9)
            # changing r_i moves A_i one-for-one (its own baseline does not contain it)
            bumped = rewards.clone()
            bumped[b, i] += 0.75
            if bool((bumped[b] != bumped[b, 0]).any()):
                _close(rloo_advantages(bumped)[0][b, i] - adv[b, i], 0.75, tol=1e-9)


# ---------------------------------------------------------------- Dr.GRPO


@FAST
@given(groups, st.floats(0.1, 10.0))
def test_dr_grpo_is_grpo_without_the_std_division(rows, scale):
    rewards = torch.tensor(rows, dtype=torch.float64)
    dr, _ = grpo_advantages(rewards, normalize_std=False)
    full, _ = grpo_advantages(rewards, normalize_std=True, eps=0.0)
    std = rewards.std(dim=-1, keepdim=True)
    _close(dr, torch.where(std > 0, full * std, torch.zeros(())), tol=1e-9)
    # Dr.GRPO advantages scale with the rewards (GRPO's do not)
    _close(grpo_advantages(rewards * scale, normalize_std=False)[0], dr * scale, tol=1e-9)


def test_dr_grpo_length_normalisation_is_a_constant():
    # seq-mean-token-sum-norm divides every sequence by the same max length: a 1-token and a 3-token
    # sequence with equal advantage contribute 1/4 and 3/4 of the sum, not 1/2 each.
    from rlctl.algo import aggregate

    per_token = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    _close(aggregate(per_token, mask, "seq-mean-token-sum-norm", norm_len=3), (1 + 3) / (2 * 3))
    _close(aggregate(per_token, mask, "seq-mean-token-mean"), 1.0)


# ---------------------------------------------------------------- REINFORCE++


def test_outcome_token_rewards_put_reward_on_last_token_and_kl_everywhere():
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1]], dtype=torch.float32)
    kl = torch.tensor([[9.0, 0.1, 0.2, 9.0], [9.0, 9.0, 0.3, 0.4]])
    out = outcome_token_rewards(torch.tensor([1.0, 2.0]), mask, kl, kl_coef=0.5)
    _close(out, [[0.0, -0.05, 1.0 - 0.1, 0.0], [0.0, 0.0, -0.15, 2.0 - 0.2]])


def test_reinforce_pp_hand_computed():
    # No KL: every token's return is its sequence reward. Tokens: seq0 has 2 tokens (r=1), seq1 has 1 (r=0).
    # Token returns [1, 1, 0]: mean 2/3, biased std sqrt(2/9) -> A = (1 - 2/3)/std, (0 - 2/3)/std
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv, stats = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask)
    std = math.sqrt(2 / 9)
    _close(adv, [[(1 / 3) / std, (1 / 3) / std], [(-2 / 3) / std, 0.0]], tol=1e-5)
    _close(stats["return_mean"], 2 / 3)


def test_reinforce_pp_kl_enters_as_reward_to_go():
    # One sequence of 3 tokens, reward 1, kl 0.1 per token, coef 1: returns [0.7, 0.8, 0.9]
    mask = torch.ones(1, 3)
    kl = torch.full((1, 3), 0.1)
    adv, stats = reinforce_pp_advantages(torch.tensor([1.0]), mask, token_kl=kl, kl_coef=1.0)
    _close(stats["return_mean"], 0.8)
    returns = torch.tensor([0.7, 0.8, 0.9])
    _close(adv[0], (returns - 0.8) / returns.std(unbiased=False), tol=1e-4)


@FAST
@given(st.lists(st.floats(-2, 2), min_size=2, max_size=8), st.integers(1, 5))
def test_reinforce_pp_property_whitened_over_valid_tokens(rewards, width):
    n = len(rewards)
    mask = torch.ones(n, width)
    valid = torch.tensor([i % 3 != 2 for i in range(n)])
    r = torch.tensor(rewards)
    r[~valid] = float("nan")
    adv, _ = reinforce_pp_advantages(r, mask, valid)
    assert not torch.isnan(adv).any()
    assert bool((adv[~valid] == 0).all())
    picked = adv[valid]
    assert abs(float(picked.mean())) < 1e-4


# ---------------------------------------------------------------- DAPO


def test_informative_groups_drop_all_equal_and_single_valid():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [0.0, 1.0, float("nan")], [1.0, 5.0, 0.0]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False], [True, False, False]])
    assert informative_groups(rewards, valid).tolist() == [False, True, True, False]


def test_overlong_penalty_hand_computed():
    _close(overlong_penalty(torch.tensor([4, 6, 7, 8, 10, 12]), max_tokens=10, buffer=4, factor=0.5),
           [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), max_tokens=4, buffer=0)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_and_clip_hand_computed():
    # seq 0: log-ratios [0.1, 0.3] -> s = exp(0.2); seq 1: [-0.2] -> s = exp(-0.2); eps 0.1/0.1
    behav = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.3], [-0.2, 0.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0], [-2.0, 0.0]])
    loss, m = gspo_loss(logp, behav, adv, mask, 0.1, 0.1)
    s0, s1 = math.exp(0.2), math.exp(-0.2)
    # seq 0: A>0, s0 > 1.1 -> clipped at 1.1 (no grad); seq 1: A<0, s1 < 0.9 -> -min(s1*-2, 0.9*-2) = 0.9*2
    _close(loss, (-1.1 + 1.8) / 2)
    assert m["clip_fraction"] == 1.0
    _close(m["ratio_max"], s0)
    _close(m["ratio_mean"], (s0 + s1) / 2)
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_gspo_gradient_is_length_normalised():
    # Unclipped: d loss / d logp_t = -A * s / |y| / N for every token of the sequence
    behav = torch.zeros(1, 4)
    logp = torch.zeros(1, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    loss, _ = gspo_loss(logp, behav, torch.full((1, 4), 2.0), mask, 0.2, 0.2)
    loss.backward()
    _close(logp.grad, [[-0.5, -0.5, -0.5, -0.5]])


@FAST
@given(st.lists(st.floats(-0.5, 0.5), min_size=1, max_size=6))
def test_gspo_equals_token_ppo_when_every_sequence_has_one_token(log_ratios):
    n = len(log_ratios)
    logp = torch.tensor(log_ratios).view(n, 1)
    behav = torch.zeros(n, 1)
    adv = torch.linspace(-1, 1, n).view(n, 1)
    mask = torch.ones(n, 1)
    a, _ = gspo_loss(logp, behav, adv, mask, 0.2, 0.28)
    b, _ = ppo_clip_loss(logp, behav, adv, mask, 0.2, 0.28, "token-mean")
    _close(a, b, tol=1e-6)


# ---------------------------------------------------------------- truncated IS


def test_truncated_is_weights_hand_computed():
    old = torch.log(torch.tensor([[0.5, 0.9, 0.2]]))
    behav = torch.log(torch.tensor([[0.5, 0.3, 0.4]]))
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w, m = truncated_is_weights(old, behav, mask, cap=2.0)
    _close(w, [[1.0, 2.0, 0.5]])  # ratios 1, 3 (capped at 2), 0.5
    _close(m["tis_weight_mean"], 3.5 / 3)
    _close(m["tis_truncated_frac"], 1 / 3)
    _close(m["is_ratio_max"], 3.0, tol=1e-5)
    with pytest.raises(ValueError, match="cap"):
        truncated_is_weights(old, behav, mask, cap=0.0)


def test_ppo_loss_scales_by_is_weights():
    logp = torch.zeros(1, 2)
    adv = torch.ones(1, 2)
    mask = torch.ones(1, 2)
    plain, _ = ppo_clip_loss(logp, logp, adv, mask, 0.2, 0.2, "token-mean")
    weighted, _ = ppo_clip_loss(logp, logp, adv, mask, 0.2, 0.2, "token-mean", is_weights=torch.tensor([[2.0, 0.0]]))
    _close(plain, -1.0)
    _close(weighted, -1.0)  # (2 * -1 + 0 * -1) / 2


# ---------------------------------------------------------------- critic


def test_value_loss_clipped_hand_computed():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0]])
    # token 0: V=1 unclipped err 1; clipped V = 0 + 0.5 -> err 2.25 (larger, used); token 1: err 1 both
    loss, m = value_loss(values, old, returns, mask, clip=0.5)
    _close(loss, 0.5 * (2.25 + 1.0) / 2)
    _close(m["value_clip_fraction"], 0.5)
    plain, _ = value_loss(values, old, returns, mask, clip=None)
    _close(plain, 0.5 * (1.0 + 1.0) / 2)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask) == pytest.approx(0.0)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), mask))


def test_whiten_masked():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    out = whiten(x, torch.tensor([[1.0, 1.0, 0.0]]))
    _close(out, [[-1.0, 1.0, 0.0]], tol=1e-6)


def test_whiten_all_equal_is_exactly_zero():
    x = torch.full((3, 1), 0.05739260442269645)
    assert torch.equal(whiten(x, torch.ones(3, 1)), torch.zeros(3, 1))
    assert torch.equal(whiten(x, torch.zeros(3, 1)), torch.zeros(3, 1))
