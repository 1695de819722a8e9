"""The torch learner's update paths: PPO epochs x mini-batches x gradient accumulation, NaN/Inf skip,
bf16 with fp32 master weights and fp32 AdamW state, and where the KL term goes.

The rollout batch is 16 sequences (4 prompts x 4), larger than one micro-batch
where a test needs accumulation, so every path runs for real.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlctl.contracts.types import LearnerContext
from tests.helpers import rollout_batch


@pytest.fixture(scope="module")
def session(tiny_config, plugins, _rlctl_home):
    from tests.helpers import build_roles

    s = build_roles(tiny_config, plugins, cache_root=_rlctl_home / "cache")
    yield s
    s.rollout.close()


@pytest.fixture(scope="module")
def batch(session):
    advantages = [(-1.0) ** i * (1 + i % 3) for i in range(16)]  # mixed signs and sizes
    return rollout_batch(session, advantages=advantages)[1]


def learner(session, lr: float = 1e-3, dtype: str = "float32", share_prompt_prefill: bool = True, **algo):
    from rlctl.kit import TorchLearner, TorchLearnerOptions

    cfg = session.config
    kl = algo.pop("kl", None)
    a = cfg.algo.model_copy(update=algo)
    if kl is not None:
        a = a.model_copy(update={"kl": a.kl.model_copy(update=kl)})
    ctx = LearnerContext(model_dir=str(session.policy_dir), algo=a,
                         optim=cfg.train.optim.model_copy(update={"lr": lr, "grad_clip": 1e6}), seed=0,
                         max_response_tokens=cfg.rollout.max_tokens, deterministic=True)
    return TorchLearner(ctx, TorchLearnerOptions(dtype=dtype, share_prompt_prefill=share_prompt_prefill))


def grads(lrn) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None}


def params(lrn) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in lrn.model.named_parameters()}


def test_gradient_accumulation_equals_the_whole_batch_gradient(session, batch):
    assert batch.num_sequences == 16
    whole = learner(session, micro_batch_size=16)
    accumulated = learner(session, micro_batch_size=3)  # 6 micro-batches, the last one short
    whole.train_step(batch)
    accumulated.train_step(batch)
    g1, g2 = grads(whole), grads(accumulated)
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("loss_agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_holds_for_every_loss_aggregation(session, batch, loss_agg):
    whole = learner(session, micro_batch_size=16, loss_agg=loss_agg)
    accumulated = learner(session, micro_batch_size=5, loss_agg=loss_agg)
    whole.train_step(batch)
    accumulated.train_step(batch)
    g1, g2 = grads(whole), grads(accumulated)
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)


def test_epochs_times_mini_batches_optimizer_steps_and_the_ratio_moves_away_from_one(session, batch):
    one = learner(session, lr=1e-2, micro_batch_size=4)
    stats_one = one.train_step(batch)
    assert stats_one["ratio_max"] == pytest.approx(1.0, abs=1e-4)  # one update: the ratio is taken before it
    assert stats_one["clip_fraction"] == 0.0

    many = learner(session, lr=1e-2, micro_batch_size=4, ppo_epochs=3, num_mini_batches=2)
    stats = many.train_step(batch)
    steps = {int(s["step"]) for s in many.optimizer.state.values()}
    assert steps == {6}, "3 epochs x 2 mini-batches = 6 optimizer steps"
    assert many.scheduler.last_epoch == 6 and many.policy_version == 1
    assert abs(stats["ratio_max"] - 1.0) > 1e-3, "later epochs see a policy that moved: the ratio leaves 1"


def test_a_non_finite_gradient_skips_the_update_and_keeps_the_policy_version(session, batch):
    from dataclasses import replace

    lrn = learner(session, micro_batch_size=4)
    lrn.train_step(batch)  # real optimizer state to compare
    before_params, before_opt = params(lrn), copy.deepcopy(lrn.optimizer.state_dict())
    before_sched, version = copy.deepcopy(lrn.scheduler.state_dict()), lrn.policy_version
    poisoned = replace(batch, advantages=batch.advantages * float("nan"))
    stats = lrn.train_step(poisoned)
    assert stats["nan_inf_skipped_steps"] == 1.0 and lrn.nan_skips == 1
    assert lrn.policy_version == version, "no update was applied, so there is no new policy"
    assert lrn.export_weights().version == version
    for name, value in params(lrn).items():
        assert torch.equal(value, before_params[name]), name
    after_opt = lrn.optimizer.state_dict()
    for key, state in before_opt["state"].items():
        for field, tensor in state.items():
            assert torch.equal(after_opt["state"][key][field], tensor), (key, field)
    assert lrn.scheduler.state_dict() == before_sched
    inf = replace(batch, advantages=batch.advantages.masked_fill(batch.action_mask > 0, float("inf")))
    assert lrn.train_step(inf)["nan_inf_skipped_steps"] == 2.0 and lrn.policy_version == version


def test_bf16_trains_with_fp32_master_weights_and_fp32_adam_state(session, batch):
    lrn = learner(session, lr=1e-2, dtype="bfloat16", micro_batch_size=8)
    assert {p.dtype for p in lrn.model.parameters()} == {torch.bfloat16}
    lrn.train_step(batch)
    trained = [p for group in lrn.optimizer.param_groups for p in group["params"]]
    assert trained and {p.dtype for p in trained} == {torch.float32}
    moments = {t.dtype for s in lrn.optimizer.state.values() for k, t in s.items() if k in ("exp_avg", "exp_avg_sq")}
    assert moments == {torch.float32}
    for param, master in zip(lrn.model.parameters(), lrn.master):
        assert torch.equal(param.detach(), master.detach().to(torch.bfloat16))
    # the checkpoint keeps the fp32 master, so a resume continues the same fp32 trajectory
    state = lrn.checkpoint_state()
    assert {t.dtype for t in state.weights.values() if t.is_floating_point()} == {torch.float32}
    other = learner(session, lr=1e-2, dtype="bfloat16", micro_batch_size=8)
    other.load_checkpoint_state(state)
    for a, b in zip(other.master, lrn.master):
        assert torch.equal(a, b)
    assert "policy master weights" in lrn.resident_tensors()


def test_kl_in_the_reward_stays_out_of_the_loss(session, batch):
    plain = learner(session, micro_batch_size=16)
    in_reward = learner(session, micro_batch_size=16, kl={"coef": 0.5, "placement": "reward"})
    in_loss = learner(session, micro_batch_size=16, kl={"coef": 0.5, "placement": "loss"})
    stats = in_reward.train_step(batch)
    in_loss.train_step(batch)
    plain.train_step(batch)
    assert "kl_ref" in stats  # measured and logged either way
    g0, g_reward, g_loss = grads(plain), grads(in_reward), grads(in_loss)
    for name in g0:
        torch.testing.assert_close(g_reward[name], g0[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(g_loss[name], g0[name], msg=name)
    # before the first update the policy equals the reference: the k3 KL's gradient is zero, so the loss
    # placement only shows after the policy moved
    in_loss.train_step(batch)
    in_reward.train_step(batch)
    assert any(not torch.equal(grads(in_loss)[n], grads(in_reward)[n]) for n in g0)


def test_kl_shaped_rewards_subtracts_the_summed_response_kl_per_sequence():
    from rlctl.algo.kl import kl_estimate, kl_shaped_rewards

    rewards = torch.tensor([[1.0, 0.0], [0.5, 0.5]])  # [B=2, G=2]
    behavior = torch.tensor([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0], [0.0, -3.0, -1.0], [0.0, 0.0, 0.0]])  # [4, T]
    ref = torch.tensor([[9.0, -1.5, -1.0], [9.0, -0.5, 7.0], [9.0, -2.0, -1.0], [9.0, 0.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 1.0, 1.0], [0.0, 0.0, 0.0]])  # prompt, padding: 0
    shaped = kl_shaped_rewards(rewards, behavior, ref, mask, coef=0.1, kind="k1")
    kl = [(-1.0 + 1.5) + (-2.0 + 1.0), 0.0, (-3.0 + 2.0) + 0.0, 0.0]
    expected = rewards - 0.1 * torch.tensor(kl).view(2, 2)
    torch.testing.assert_close(shaped, expected)
    k3 = kl_shaped_rewards(rewards, behavior, ref, mask, coef=1.0, kind="k3")
    assert torch.all(k3 <= rewards + 1e-7), "k3 is non-negative: shaping can only lower a reward"
    torch.testing.assert_close(k3, rewards - (kl_estimate(behavior, ref, "k3") * mask).sum(-1).view(2, 2))


@pytest.mark.parametrize("algo", [
    {"micro_batch_size": 16},
    {"micro_batch_size": 5, "ppo_epochs": 2},  # rows permuted, forwarded in 4 pieces, then a second epoch
    {"micro_batch_size": 4, "num_mini_batches": 2},  # the second mini-batch is forwarded after an update
    {"micro_batch_size": 8, "tis_cap": 2.0},  # pi_old computed anyway: reused
], ids=["one-micro", "micros-epochs", "mini-batches", "tis"])
def test_train_step_with_logprobs_returns_the_pre_update_pass_and_the_same_update(session, batch, algo):
    """The overlapped loop's D_lag reads these instead of a separate logprobs pass: same values, same update."""
    plain, capturing = learner(session, **algo), learner(session, **algo)
    on = batch.action_mask > 0
    want = plain.logprobs(batch) * on  # [N, T]: the pass the loop used to make before train_step, trained tokens
    stats = plain.train_step(batch)
    got_stats, got = capturing.train_step_with_logprobs(batch)
    assert got.shape == want.shape and got.device.type == "cpu"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the token counts (rlctl profile) differ by design: plain's extra logprobs pass above is counted in its step
    counts = ("learner_real_tokens", "learner_computed_tokens", "learner_flop_tokens", "learner_padding_waste")
    drop = lambda s: {k: v for k, v in s.items() if k not in counts}  # noqa: E731
    assert drop(got_stats) == drop(stats) and capturing.policy_version == plain.policy_version == 1
    p1, p2 = params(plain), params(capturing)
    for name in p1:
        torch.testing.assert_close(p2[name], p1[name], rtol=0, atol=0, msg=name)


def test_the_shared_prompt_prefill_gives_the_plain_forwards_logprobs_entropies_and_gradients(session, batch):
    """Each distinct prompt forwarded once, its KV cache reused for its G responses: the same numbers as one
    forward per row, under whichever transformers is installed (the cache's argument and output field are
    ``past_key_values`` in 5.17 and ``cache`` in 5.24: rlctl.models.compat)."""
    from rlctl.kit.prefill import prefix_shared_logprobs as _prefix_shared_logprobs

    shared = learner(session, micro_batch_size=16)
    plain = learner(session, micro_batch_size=16, share_prompt_prefill=False)
    on = batch.action_mask > 0
    with torch.no_grad():
        got = _prefix_shared_logprobs(shared.model, batch, with_entropy=True)
        want = plain._logprobs(plain.model, batch, True)
    assert got is not None  # 4 prompts x 4 samples: the shared path ran
    for g, w in zip(got, want):
        torch.testing.assert_close(g * on, w * on, rtol=1e-5, atol=1e-5)
    shared.train_step(batch)
    plain.train_step(batch)
    g1, g2 = grads(plain), grads(shared)
    assert g1.keys() == g2.keys() and g1
    for name in g1:
        torch.testing.assert_close(g2[name], g1[name], rtol=1e-4, atol=1e-6, msg=name)
