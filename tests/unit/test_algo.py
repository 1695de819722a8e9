"""Unit tests for rlctl.algo: hand-computed values plus property tests."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.algo import (
    aggregate,
    entropy_from_logits,
    exact_categorical_kl,
    gae,
    grpo_advantages,
    kl_estimate,
    kl_penalty_loss,
    ppo_clip_loss,
    process_logits,
    token_logprobs,
)

SQRT_THIRD = math.sqrt(1.0 / 3.0)  # unbiased std of [1, 0, 0, 1] and of [1, 0, 1]
FAST = settings(max_examples=60, deadline=None)


def _close(actual, expected, tol=1e-5):
    assert torch.allclose(torch.as_tensor(actual, dtype=torch.float64),
                          torch.as_tensor(expected, dtype=torch.float64), atol=tol, rtol=0), (actual, expected)


# ---------------------------------------------------------------- GRPO


def test_grpo_hand_computed_normalised():
    # mean 0.5, unbiased std sqrt(1/3): A = +-0.5 / sqrt(1/3) = +-sqrt(3)/2 = +-0.8660254
    adv, _ = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    _close(adv, [[0.8660254, -0.8660254, -0.8660254, 0.8660254]], tol=3e-6)


def test_grpo_hand_computed_unnormalised():
    adv, _ = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0]]), normalize_std=False)
    assert adv.tolist() == [[0.5, -0.5, -0.5, 0.5]]


def test_grpo_zero_variance_group_is_exactly_zero():
    rewards = torch.tensor([[0.1, 0.1, 0.1], [7.0, 7.0, 7.0]])
    for normalize in (True, False):
        adv, stats = grpo_advantages(rewards, normalize_std=normalize)
        assert adv.tolist() == [[0.0] * 3, [0.0] * 3]
        assert stats["frac_zero_std"] == 1.0
        assert stats["reward_std_mean"] == 0.0


def test_grpo_invalid_samples_excluded():
    # valid [1, 0, 1]: mean 2/3, centred [1/3, -2/3, 1/3], unbiased var 1/3
    # A = [sqrt(1/3), -2 sqrt(1/3), sqrt(1/3)] = [0.57735, -1.1547, 0.57735]; invalid -> 0
    rewards = torch.tensor([[1.0, 0.0, float("nan"), 1.0]])
    valid = torch.tensor([[True, True, False, True]])
    adv, _ = grpo_advantages(rewards, valid)
    _close(adv, [[0.5773503, -1.1547005, 0.0, 0.5773503]], tol=3e-6)
    assert not adv.isnan().any()


def test_grpo_stats_and_small_groups():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.5, 9.0, 9.0, 9.0]])
    valid = torch.tensor([[True] * 4, [True] * 4, [True, False, False, False]])
    adv, stats = grpo_advantages(rewards, valid)
    assert adv[1:].abs().sum() == 0  # zero std, and < 2 valid samples
    _close(stats["frac_zero_std"], 2 / 3)
    _close(stats["reward_std_mean"], (SQRT_THIRD + 0.0) / 2)  # over groups with >= 2 valid


def test_grpo_nan_on_valid_sample_is_not_hidden():
    adv, _ = grpo_advantages(torch.tensor([[1.0, float("nan"), 0.0]]))
    assert adv.isnan().any()


_groups = st.integers(1, 4).flatmap(lambda b: st.integers(2, 8).flatmap(lambda g: st.tuples(
    st.lists(st.lists(st.integers(-5, 5), min_size=g, max_size=g), min_size=b, max_size=b),
    st.lists(st.lists(st.booleans(), min_size=g, max_size=g), min_size=b, max_size=b),
)))


@FAST
@given(_groups, st.booleans())
def test_grpo_property_advantages_sum_to_zero(data, normalize):
    rewards, valid = torch.tensor(data[0], dtype=torch.float32), torch.tensor(data[1])
    adv, _ = grpo_advantages(rewards, valid, normalize_std=normalize)
    assert torch.isfinite(adv).all()
    assert (adv[~valid] == 0).all()
    _close(adv.sum(dim=-1), torch.zeros(rewards.shape[0]), tol=1e-4)


@FAST
@given(_groups, st.floats(0.1, 10.0), st.floats(-100.0, 100.0))
def test_grpo_property_scale_and_shift_invariance(data, scale, shift):
    rewards, valid = torch.tensor(data[0], dtype=torch.float64), torch.tensor(data[1])
    adv, _ = grpo_advantages(rewards, valid)
    adv_scaled, _ = grpo_advantages(rewards * scale + shift, valid)
    _close(adv_scaled, adv, tol=1e-4)


# ---------------------------------------------------------------- GAE


def test_gae_gamma1_lam1_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t; returns all 1
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                   torch.ones(1, 3), gamma=1.0, lam=1.0)
    _close(adv, [[0.5, 0.4, 0.3]])
    _close(ret, [[1.0, 1.0, 1.0]])


def test_gae_discounted():
    # delta2 = 1 - 0.7 = 0.3;              A2 = 0.3
    # delta1 = 0.9 * 0.7 - 0.6 = 0.03;     A1 = 0.03 + 0.855 * 0.3 = 0.2865
    # delta0 = 0.9 * 0.6 - 0.5 = 0.04;     A0 = 0.04 + 0.855 * 0.2865 = 0.2849575
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                   torch.ones(1, 3), gamma=0.9, lam=0.95)
    _close(adv, [[0.2849575, 0.2865, 0.3]])
    _close(ret, [[0.7849575, 0.8865, 1.0]])


def test_gae_masked_last_token_bootstraps_zero():
    # padding value 99 / NaN must not leak: A1 = 1 - 0.6 = 0.4, A0 = 0.6 - 0.5 + 0.4 = 0.5
    adv, ret = gae(torch.tensor([[0.0, 1.0, float("nan")]]), torch.tensor([[0.5, 0.6, 99.0]]),
                   torch.tensor([[1, 1, 0]]), gamma=1.0, lam=1.0)
    _close(adv, [[0.5, 0.4, 0.0]])
    _close(ret, [[1.0, 1.0, 0.0]])


# ---------------------------------------------------------------- aggregate


PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0, 100.0], [5.0, 6.0, float("nan"), 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_aggregate_modes_hand_computed():
    # seq 0: tokens 1,2,3 (sum 6, mean 2); seq 1: tokens 5,6 (sum 11, mean 5.5)
    _close(aggregate(PER_TOKEN, MASK, "token-mean"), 17 / 5)  # 3.4
    _close(aggregate(PER_TOKEN, MASK, "seq-mean-token-mean"), (2 + 5.5) / 2)  # 3.75
    _close(aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm", norm_len=4), (6 / 4 + 11 / 4) / 2)  # 2.125


def test_aggregate_empty_mask_is_zero_with_grad():
    x = torch.randn(2, 3, requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out = aggregate(x, torch.zeros(2, 3), mode, norm_len=3)
        assert out.item() == 0.0 and out.requires_grad
        (grad,) = torch.autograd.grad(out, x)
        assert (grad == 0).all()


def test_aggregate_empty_sequence_skipped_in_seq_mean():
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]])
    _close(aggregate(PER_TOKEN, mask, "seq-mean-token-mean"), 2.0)


def test_aggregate_rejects_bad_input():
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(PER_TOKEN, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown aggregation"):
        aggregate(PER_TOKEN, MASK, "mean")  # type: ignore[arg-type]


# ---------------------------------------------------------------- PPO clip


def test_ppo_ratio_one_gives_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    adv = torch.tensor([[1.0, -2.0, 4.0]])
    loss, m = ppo_clip_loss(logp, logp.clone(), adv, torch.ones(1, 3), 0.2, 0.2, "token-mean")
    _close(loss, -1.0)  # -(1 - 2 + 4) / 3
    assert m["clip_fraction"] == 0.0 and m["ratio_mean"] == 1.0 and m["ratio_max"] == 1.0
    assert m["approx_kl_behavior"] == 0.0 and m["loss"] == pytest.approx(-1.0)


def test_ppo_clipped_tokens_hand_computed_and_no_grad():
    # token 0: ratio 1.5, A=+1 -> min(1.5, 1.2) = 1.2 -> loss -1.2 (clipped)
    # token 1: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 -> loss 0.8 (clipped)
    behavior = torch.tensor([[-1.0, -1.0, -1.0]])
    logp = (behavior + torch.log(torch.tensor([[1.5, 0.5, 1.0]])))
    logp.requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, m = ppo_clip_loss(logp, behavior, adv, mask, 0.2, 0.2, "token-mean")
    _close(loss, (-1.2 + 0.8) / 2)
    assert m["clip_fraction"] == 1.0
    _close(m["ratio_mean"], 1.0)
    _close(m["ratio_max"], 1.5)
    (grad,) = torch.autograd.grad(loss, logp)
    assert (grad == 0).all()


def test_ppo_unclipped_side_keeps_gradient():
    # ratio 0.5 with A=+1: min(0.5, 0.8) = 0.5 is the unclipped term -> not clipped
    behavior = torch.zeros(1, 2)
    logp = torch.log(torch.tensor([[0.5, 1.0]])).requires_grad_(True)
    loss, m = ppo_clip_loss(logp, behavior, torch.ones(1, 2), torch.ones(1, 2), 0.2, 0.2, "token-mean")
    _close(loss, -(0.5 + 1.0) / 2)
    assert m["clip_fraction"] == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    _close(grad, [[-0.25, -0.5]])  # d(-r/2)/dlogp = -r/2


def test_ppo_asymmetric_clip_high():
    # ratio 1.25, A=+1: clipped at 1.2 with clip_high 0.2, free with clip_high 0.28
    behavior = torch.zeros(1, 1)
    logp = torch.log(torch.tensor([[1.25]]))
    one = torch.ones(1, 1)
    loss_sym, m_sym = ppo_clip_loss(logp, behavior, one, one, 0.2, 0.2, "token-mean")
    loss_asym, m_asym = ppo_clip_loss(logp, behavior, one, one, 0.2, 0.28, "token-mean")
    _close(loss_sym, -1.2)
    _close(loss_asym, -1.25)
    assert (m_sym["clip_fraction"], m_asym["clip_fraction"]) == (1.0, 0.0)
    # the low side still clips at 1 - clip_low = 0.8
    loss_low, _ = ppo_clip_loss(torch.log(torch.tensor([[0.5]])), behavior, -one, one, 0.2, 0.28, "token-mean")
    _close(loss_low, 0.8)


def test_ppo_approx_kl_behavior_is_k3_of_mu_vs_pi():
    # ratio pi/mu = 2: k3 = (r - 1) - log r = 1 - ln 2
    _, m = ppo_clip_loss(torch.log(torch.tensor([[2.0]])), torch.zeros(1, 1), torch.ones(1, 1),
                         torch.ones(1, 1), 0.2, 0.2, "token-mean")
    _close(m["approx_kl_behavior"], 1 - math.log(2))


# ---------------------------------------------------------------- KL


P = torch.tensor([0.5, 0.3, 0.2])
Q = torch.tensor([0.2, 0.5, 0.3])
# KL(p||q) = 0.5 ln 2.5 + 0.3 ln 0.6 + 0.2 ln(2/3) = 0.4581454 - 0.1532477 - 0.0810930
KL_PQ = 0.2238047


def test_exact_categorical_kl_hand_computed():
    _close(exact_categorical_kl(P.log(), Q.log()), KL_PQ, tol=1e-6)
    _close(exact_categorical_kl(P.log(), P.log()), 0.0, tol=1e-7)


def test_kl_estimators_monte_carlo():
    gen = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(P, 200_000, replacement=True, generator=gen)  # [S]
    logp, ref_logp = P.log()[tokens], Q.log()[tokens]
    for kind in ("k1", "k3"):
        k = kl_estimate(logp, ref_logp, kind).double()
        stderr = k.std().item() / math.sqrt(k.numel())
        assert abs(k.mean().item() - KL_PQ) < 4 * stderr, kind
    k1 = kl_estimate(logp, ref_logp, "k1")
    assert (k1 < 0).any()  # k1 is unbiased but negative on some tokens
    k2 = kl_estimate(logp, ref_logp, "k2")
    assert torch.isfinite(k2).all() and (k2 >= 0).all()
    assert abs(k2.mean().item() - KL_PQ) < 0.1  # biased, but the same order


def test_kl_hand_values_and_dtype():
    logp = torch.tensor([math.log(0.5)], dtype=torch.bfloat16)
    ref = torch.tensor([0.0], dtype=torch.bfloat16)
    assert kl_estimate(logp, ref, "k1").dtype == torch.float32
    x = float(logp.float())  # log 0.5 as rounded by bf16
    _close(kl_estimate(logp, ref, "k1"), [x])
    _close(kl_estimate(logp, ref, "k2"), [x * x / 2])
    _close(kl_estimate(logp, ref, "k3"), [math.exp(-x) - 1 + x])
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


_logps = st.floats(-30.0, 30.0, allow_nan=False, width=32)


@FAST
@given(st.lists(st.tuples(_logps, _logps), min_size=1, max_size=64))
def test_k3_and_k2_nonnegative_property(pairs):
    logp = torch.tensor([a for a, _ in pairs])
    ref = torch.tensor([b for _, b in pairs])
    for kind in ("k2", "k3"):
        k = kl_estimate(logp, ref, kind)
        assert torch.isfinite(k).all() and (k >= 0).all(), kind


def test_kl_penalty_loss():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    for kind in ("k1", "k2", "k3"):
        loss, mean_kl = kl_penalty_loss(logp, logp.detach().clone(), torch.ones(1, 2), kind, "token-mean")
        assert loss.item() == 0.0 and mean_kl == 0.0
    # k1 with x = [1, 3] on the first token only -> 1
    loss, mean_kl = kl_penalty_loss(logp, torch.tensor([[-2.0, -5.0]]), torch.tensor([[1, 0]]), "k1", "token-mean")
    _close(loss, 1.0)
    assert mean_kl == pytest.approx(1.0)


# ---------------------------------------------------------------- entropy


def test_entropy_hand_computed_and_masked_vocab():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, float("-inf"), float("-inf")]]], requires_grad=True)
    ent = entropy_from_logits(logits)
    _close(ent, [[math.log(4), math.log(2)]])
    (grad,) = torch.autograd.grad(ent.sum(), logits)
    assert torch.isfinite(grad).all()


# ---------------------------------------------------------------- sampling


def test_top_k_one_keeps_only_argmax():
    logits = torch.randn(3, 5, 10, generator=torch.Generator().manual_seed(1))
    out = process_logits(logits, 1.0, 1, 1.0)
    assert (torch.isfinite(out).sum(-1) == 1).all()
    assert torch.equal(out.argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("top_p, kept", [(0.4, {0.5}), (0.7, {0.5, 0.3}), (0.85, {0.5, 0.3, 0.15}),
                                         (0.97, {0.5, 0.3, 0.15, 0.05}), (1.0, {0.5, 0.3, 0.15, 0.05})])
def test_top_p_keeps_smallest_set_reaching_mass(top_p, kept):
    # Shuffled so the kept set must be scattered back to the right positions.
    # (p = 0.8 is an exact boundary, 0.5 + 0.3 == 0.8, so it is not pinned here.)
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    out = process_logits(probs.log(), 1.0, 0, top_p)
    assert {round(p, 2) for p, keep in zip(probs.tolist(), torch.isfinite(out).tolist()) if keep} == kept


def test_temperature_matches_scaled_log_softmax():
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 7, (2, 3), generator=torch.Generator().manual_seed(3))
    expected = torch.log_softmax(logits / 0.7, dim=-1)
    _close(torch.log_softmax(process_logits(logits, 0.7, 0, 1.0), dim=-1), expected)
    _close(token_logprobs(logits, tokens, 0.7, 0, 1.0), expected.gather(-1, tokens[..., None]).squeeze(-1))


def test_temperature_zero_is_greedy_passthrough():
    logits = torch.randn(2, 5)
    assert process_logits(logits, 0.0, 3, 0.5) is logits
    with pytest.raises(ValueError, match="top_p"):
        process_logits(logits, 1.0, 0, 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_token_logprobs_fast_path_equals_general_path(dtype, temperature):
    vocab = 11
    logits = torch.randn(2, 4, vocab, generator=torch.Generator().manual_seed(4)).to(dtype).requires_grad_(True)
    tokens = torch.randint(0, vocab, (2, 4), generator=torch.Generator().manual_seed(5))
    fast = token_logprobs(logits, tokens, temperature, 0, 1.0)
    general = token_logprobs(logits, tokens, temperature, vocab, 1.0)  # top_k = V: a no-op filter
    assert fast.dtype == general.dtype == torch.float32
    _close(fast, general)
    (g_fast,) = torch.autograd.grad(fast.sum(), logits)
    (g_general,) = torch.autograd.grad(general.sum(), logits)
    _close(g_fast.float(), g_general.float(), tol=1e-2 if dtype == torch.bfloat16 else 1e-6)


def test_token_logprobs_fast_path_does_not_modify_input():
    logits = torch.randn(1, 2, 5).to(torch.bfloat16)
    before = logits.clone()
    token_logprobs(logits, torch.zeros(1, 2, dtype=torch.long), 0.5, 0, 1.0)
    assert torch.equal(logits, before)


def test_processed_distribution_renormalises():
    vocab = 9
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(6))
    logits = row.expand(1, vocab, vocab)  # one position per vocab entry  [1, V, V]
    tokens = torch.arange(vocab)[None]  # [1, V]
    lp = token_logprobs(logits, tokens, 0.8, 5, 0.9)
    kept = torch.isfinite(process_logits(row, 0.8, 5, 0.9))
    assert torch.equal(torch.isfinite(lp[0]), kept)
    _close(lp.exp().sum(), 1.0)
    assert 1 <= int(kept.sum()) <= 5
