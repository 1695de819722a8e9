"""Episodes train only the policy's tokens: every estimator, both KL placements, padded, prefill-shared and packed.

An episode's response interleaves policy turns and environment turns, so its
action mask has zeros in the middle. Hand-built episode batches (no engine:
Trajectory-like rows with turns laid out by hand, the tiny test policy) pin:

(a) the loss's gradient w.r.t. the logits that predict an environment token
    (or a prompt or padding token) is exactly 0, and replacing the behaviour
    log-probs and advantages on environment tokens by garbage changes neither
    the advantages, nor the gradient, nor any metric -- for all seven
    estimators and both KL placements;
(b) loss, KL, entropy, GAE values hand-computed on a 2-turn episode;
(c) an episode trains exactly its policy tokens: its loss and gradient equal
    those of the same policy tokens gathered into a dense response (each still
    conditioned on the whole context, environment tokens included);
(d) packed (train.micro_batch_tokens) and padded learners agree on episodes
    within 1e-6 relative, with and without prefill sharing;
and that the critic regresses only on policy tokens (padded and packed, which
agree) and DAPO's overlong
penalty measures an episode by its longest policy turn.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings, strategies as st

from rlctl.algo import aggregate, entropy_from_logits, gae, kl_penalty_loss, ppo_clip_loss, token_logprobs
from rlctl.contracts.batch import AdvantageInputs
from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory, Turn, Writer
from rlctl.engine.batching import build_batch, sampled_lengths
from rlctl.engine.estimation import estimate
from tests.unit.test_packed_micro_batches import (
    CRITIC_METRICS, ESTIMATORS, compare, compare_critics, make, make_critic,
)

P, E = Writer.POLICY, Writer.ENV
# (writer, length) spans of the G = 4 episodes of each of two prompts: interior environment turns, a plain
# single-turn sample (``None``: turns == ()), an episode that ends on an environment turn, and a second group
# whose episodes all open with the same environment observation (the prefill-shared prefix then includes it)
LAYOUTS = [
    [[(P, 3), (E, 4), (P, 2)], [(P, 2), (E, 3), (P, 3), (E, 2), (P, 1)], None, [(P, 1), (E, 1), (P, 4), (E, 2)]],
    [[(E, 2), (P, 3), (E, 2), (P, 2)], [(E, 2), (P, 1), (E, 5), (P, 3)], [(E, 2), (P, 6)], [(E, 2), (P, 2), (E, 1), (P, 1)]],
]
REWARDS = torch.tensor([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])


@pytest.fixture(scope="module")
def session(tiny_config, plugins, _rlctl_home):
    from tests.helpers import build_roles

    s = build_roles(tiny_config, plugins, cache_root=_rlctl_home / "cache")
    yield s
    s.rollout.close()


def episodes(session, seed: int = 0) -> list[Trajectory]:
    """The LAYOUTS as Trajectories of the session's first two train prompts (token ids drawn at random)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = session.tokenizer.vocab_size if hasattr(session.tokenizer, "vocab_size") else len(session.tokenizer)
    out = []
    for g, layouts in enumerate(LAYOUTS):
        record = session.task.train[g]
        prompt = tuple(session.tokenizer(record.text)["input_ids"])
        opening = tuple(int(x) for x in torch.randint(3, vocab, (2,), generator=gen))  # shared by group 1
        for i, layout in enumerate(layouts):
            spans = layout or [(P, 5)]
            tokens, mask, turns = [], [], []
            for k, (writer, length) in enumerate(spans):
                start = len(tokens)
                if g == 1 and k == 0:
                    tokens += opening
                else:
                    tokens += [int(x) for x in torch.randint(3, vocab, (length,), generator=gen)]
                mask += [int(writer is P)] * length
                turns.append(Turn(start=start, end=len(tokens), writer=writer,
                                  policy_version=0 if writer is P else None,
                                  tool="calculator" if writer is E else None, tool_status="ok" if writer is E else None))
            out.append(Trajectory.create(
                id=f"{record.id}/{i}", prompt_id=record.id, group_index=i, dataset_version=session.task.version,
                policy_version=0, tokenizer_hash="tok", prompt_tokens=prompt, response_tokens=tuple(tokens),
                response_text="", action_mask=tuple(mask), behavior_logprobs=(0.0,) * len(tokens),
                sampling_config=session.sampling, terminal_reason=TerminalReason.EOS, rollout_started_at=0.0,
                reward=float(REWARDS[g, i]), turns=tuple(turns) if layout else ()))
    return out


EPISODES: list[Trajectory] = []  # the batch fixture's rows


@pytest.fixture(scope="module")
def batch(session, plugins):
    """The episodes' TrainBatch with behaviour log-probs near the policy's own (so some ratios clip)."""
    EPISODES[:] = episodes(session)
    b = build_batch(EPISODES, [0.0] * 8, session.tokenizer.pad_token_id, session.sampling)
    logp = make(session, plugins, fp64=False).logprobs(b)
    noise = 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    on = b.action_mask > 0
    assert bool((on.sum(-1) > 0).all()) and bool(((b.attention_mask > 0) & ~on).any())
    return replace(b, behavior_logprobs=torch.where(on, logp + noise, 0.0))


def environment_positions(b) -> torch.Tensor:
    """[N, T] bool: the environment's tokens of ``b``'s rows (after the prompt, not the policy's)."""
    out = torch.zeros(b.action_mask.shape, dtype=torch.bool)
    for i, t in enumerate(EPISODES):
        p = len(t.prompt_tokens)
        for j, m in enumerate(t.action_mask):
            out[i, p + j] = m == 0
    return out


def garbage(b, on_env: torch.Tensor, what: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(b.action_mask.shape, generator=g)
    if what == "behavior":
        return replace(b, behavior_logprobs=torch.where(on_env, -20.0 * noise.abs(), b.behavior_logprobs))
    return replace(b, advantages=torch.where(on_env, 10.0 * noise, b.advantages))


def config(session, name: str, kl: str):
    cfg = session.config.model_copy(deep=True)
    cfg.algo = cfg.algo.model_copy(update={"name": name})
    cfg.algo.kl = cfg.algo.kl.model_copy(update={"coef": 0.3, "placement": kl})
    return cfg


def advantages(session, plugins, name: str, kl: str, b, learner):
    """The engine's estimation step (rlctl.engine.estimation) for ``b``: KL-in-reward, the critic, the estimator."""
    from rlctl.placement.build import build_critic, build_estimator

    cfg = config(session, name, kl)
    estimator = build_estimator(cfg, plugins)
    critic = build_critic(cfg, plugins, session.policy_dir) if estimator.needs_critic else None
    est = estimate(estimator=estimator, batch=b, rewards=REWARDS, valid=torch.ones(2, 4, dtype=torch.bool),
                   kl_coef=0.3 if kl == "reward" else 0.0, kl_estimator=cfg.algo.kl.estimator,
                   ref_logprobs=learner.ref_logprobs, values=critic.values if critic is not None else None)
    return est


class LogitGrads:
    """The gradients of the loss w.r.t. the policy's logits of every forward with grad (the LM head's output)."""

    def __init__(self, model) -> None:
        self.outputs: list[torch.Tensor] = []
        self.handle = model.get_output_embeddings().register_forward_hook(self._keep)

    def _keep(self, module, inputs, output) -> None:
        if output.requires_grad:
            output.retain_grad()
            self.outputs.append(output)


def frozen(session, plugins, name: str, kl: str, share: bool = False, tokens: int | None = None, **algo):
    """A float64 learner with lr 0 (each train step leaves the weights as they were, so gradients compare)."""
    lrn = make(session, plugins, name, kl=kl, share=share, tokens=tokens, size=8, **algo)
    for group in lrn.optimizer.param_groups:
        group["lr"] = 0.0
    lrn.scheduler.base_lrs = [0.0 for _ in lrn.scheduler.base_lrs]
    return lrn


def grads_of(lrn, b) -> tuple[dict, dict[str, torch.Tensor]]:
    """One train step's stats and gradients; the mini-batch order reseeded, so that two calls sum alike."""
    lrn.generator.manual_seed(0)
    stats = lrn.train_step(b)
    return stats, {n: p.grad.clone() for n, p in lrn.model.named_parameters() if p.grad is not None}


METRICS = ("loss", "clip_fraction", "ratio_mean", "ratio_max", "approx_kl_behavior", "kl_ref", "entropy",
           "logprob_mismatch_mean", "logprob_mismatch_max", "grad_norm", "tis_weight_mean")


# -- (a) gradient checks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("kl", ["loss", "reward"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_environment_tokens_get_exactly_zero_gradient_and_their_values_change_nothing(session, plugins, batch,
                                                                                      name, kl):
    env = environment_positions(batch)
    assert int(env.sum()) == 28
    lrn = frozen(session, plugins, name, kl)
    on = batch.action_mask > 0
    batch = replace(batch, behavior_logprobs=torch.where(on, lrn.logprobs(batch).float(), 0.0))  # ratios ~1: no clip
    est = advantages(session, plugins, name, kl, batch, lrn)
    assert float(est.advantages[batch.action_mask == 0].abs().max()) == 0.0
    assert float(est.advantages[batch.action_mask > 0].abs().max()) > 0.0
    # garbage behaviour log-probs on the environment's tokens: the advantages (KL-in-reward included) do not move
    noisy = garbage(batch, env, "behavior", seed=2)
    est_noisy = advantages(session, plugins, name, kl, noisy, lrn)
    assert torch.equal(est_noisy.advantages, est.advantages)
    if est.returns is not None:
        assert torch.equal(est_noisy.returns, est.returns) and float(est.returns[batch.action_mask == 0].abs().max()) == 0

    trained = replace(batch, advantages=est.advantages.float())
    hook = LogitGrads(lrn.model)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0))  # the mini-batch's row order
    stats, grads = grads_of(lrn, trained)
    hook.handle.remove()
    (logits,) = hook.outputs  # one micro-batch, one mini-batch, one epoch: one forward with grad, rows in ``order``
    predicts_policy = torch.nn.functional.pad(batch.action_mask[order, 1:] > 0, (0, 1))  # logits at t predict t + 1
    assert float(logits.grad[~predicts_policy].abs().max()) == 0.0  # environment, prompt and padding: exactly 0
    assert float(logits.grad[predicts_policy].abs().amax(-1).min()) > 0.0  # and every policy token is trained

    # garbage advantages and behaviour log-probs on the environment's tokens: the same gradient, bit for bit
    noisy = garbage(garbage(trained, env, "behavior", seed=3), env, "advantages", seed=4)
    stats_noisy, grads_noisy = grads_of(lrn, noisy)
    assert grads.keys() == grads_noisy.keys() and grads
    assert all(torch.equal(grads[k], grads_noisy[k]) for k in grads)
    for key in METRICS:
        if key in stats:
            assert stats[key] == stats_noisy[key], key


@pytest.mark.parametrize("path", ["prefill-shared", "packed", "packed-shared"])
@pytest.mark.parametrize("name", ["grpo", "gspo", "dr_grpo"])
def test_environment_token_values_change_nothing_on_the_shared_and_packed_forwards(session, plugins, batch, name,
                                                                                   path):
    share, tokens = {"prefill-shared": (True, None), "packed": (False, 60), "packed-shared": (True, 10_000)}[path]
    lrn = frozen(session, plugins, name, "loss", share=share, tokens=tokens)
    trained = replace(batch, advantages=torch.where(batch.action_mask > 0, torch.linspace(-1, 1, 8)[:, None], 0.0))
    env = environment_positions(batch)
    stats, grads = grads_of(lrn, trained)
    stats_noisy, grads_noisy = grads_of(lrn, garbage(garbage(trained, env, "behavior", 5), env, "advantages", 6))
    assert all(torch.equal(grads[k], grads_noisy[k]) for k in grads)
    assert all(stats[k] == stats_noisy[k] for k in METRICS if k in stats)


# -- (b) hand-computed values ---------------------------------------------------------------------------------------

# one row: 2 prompt tokens, a 2-token policy turn, 2 environment tokens, a 1-token policy turn, 1 padding
MASK = torch.tensor([[0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
NAN = float("nan")


def test_loss_kl_and_aggregations_by_hand_on_a_two_turn_episode():
    p = torch.tensor([[NAN, NAN, 0.75, 0.25, 0.1, 0.1, 0.8, NAN]])
    mu = torch.tensor([[0.0, 0.0, 0.5, 0.5, 1e-9, 0.9, 0.4, 0.0]])  # environment entries: anything
    ref = torch.tensor([[0.3, 0.3, 0.5, 0.5, 0.2, 0.2, 0.5, 0.3]])
    adv = torch.tensor([[NAN, 5.0, 1.0, 1.0, 99.0, -99.0, -2.0, NAN]])
    logp = p.log()
    # ratios 1.5, 0.5, 2 with advantages 1, 1, -2 and clip (0.2, 0.28):
    #   -min(1.5, 1.28) = -1.28 (clipped), -min(0.5, 0.8) = -0.5, -min(-4, -2.56) = 4
    loss, info = ppo_clip_loss(logp, mu.log(), adv, MASK, 0.2, 0.28, "token-mean")
    assert float(loss) == pytest.approx((-1.28 - 0.5 + 4.0) / 3, abs=1e-6)
    assert info["clip_fraction"] == pytest.approx(1 / 3) and info["ratio_max"] == pytest.approx(2.0)
    assert info["ratio_mean"] == pytest.approx((1.5 + 0.5 + 2.0) / 3)
    loss, _ = ppo_clip_loss(logp, mu.log(), adv, MASK, 0.2, 0.28, "seq-mean-token-sum-norm", norm_len=10)
    assert float(loss) == pytest.approx((-1.28 - 0.5 + 4.0) / 10, abs=1e-6)  # the token sum over a constant
    loss, _ = ppo_clip_loss(logp, mu.log(), adv, MASK, 0.2, 0.28, "seq-mean-token-mean")
    assert float(loss) == pytest.approx((-1.28 - 0.5 + 4.0) / 3, abs=1e-6)
    k3 = [1 / 1.5 - 1 + math.log(1.5), 2 - 1 + math.log(0.5), 1 / 1.6 - 1 + math.log(1.6)]  # x = log p - log ref
    kl, mean_kl = kl_penalty_loss(logp, ref.log(), MASK, "k3", "token-mean")
    assert float(kl) == pytest.approx(sum(k3) / 3, abs=1e-6) and mean_kl == pytest.approx(sum(k3) / 3, abs=1e-6)
    kl1, _ = kl_penalty_loss(logp, ref.log(), MASK, "k1", "token-mean")
    assert float(kl1) == pytest.approx(math.log(1.5 * 0.5 * 1.6) / 3, abs=1e-6)
    from rlctl.algo.kl import kl_shaped_rewards

    shaped = kl_shaped_rewards(torch.tensor([[1.0]]), mu.log(), ref.log(), MASK, 0.5, "k1")
    assert float(shaped) == pytest.approx(1.0 - 0.5 * math.log(1.0 * 1.0 * 0.8), abs=1e-6)  # mu/ref on 2, 3, 6


def test_gae_runs_over_the_policy_tokens_and_skips_the_environment_turn():
    values = torch.tensor([[5.0, 5.0, 0.2, 0.4, 7.0, 7.0, 0.6, 5.0]])  # environment and padding values unread
    rewards = torch.tensor([[3.0, 3.0, 0.0, 0.0, 3.0, 3.0, 1.0, 3.0]])  # so are their rewards
    adv, returns = gae(rewards, values, MASK, gamma=0.9, lam=0.5)
    # t=6: 1 - 0.6 = 0.4; t=3: 0.9 * 0.6 - 0.4 + 0.45 * 0.4 = 0.32; t=2: 0.9 * 0.4 - 0.2 + 0.45 * 0.32 = 0.304
    want = torch.tensor([[0.0, 0.0, 0.304, 0.32, 0.0, 0.0, 0.4, 0.0]])
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(returns, torch.where(MASK > 0, want + values, 0.0), rtol=0, atol=1e-6)
    # the same policy tokens as one contiguous response give the same numbers
    dense_adv, _ = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.2, 0.4, 0.6]]), torch.ones(1, 3), 0.9, 0.5)
    torch.testing.assert_close(dense_adv[0], adv[0, [2, 3, 6]], rtol=0, atol=1e-6)


def test_the_learners_loss_kl_and_entropy_on_an_episode_are_those_of_its_policy_tokens(session, plugins, batch):
    """The torch learner's step metrics on the episode batch, recomputed by hand from one plain forward: the
    loss, KL and entropy are token means over the policy's tokens only."""
    lrn = frozen(session, plugins, "grpo", "loss")
    adv = torch.where(batch.action_mask > 0, torch.linspace(-1, 1, 8, dtype=torch.float64)[:, None], 0.0)
    stats = lrn.train_step(replace(batch, advantages=adv.float()))
    on = batch.action_mask > 0
    with torch.no_grad():
        ids, att = batch.input_ids, batch.attention_mask
        logits = lrn.model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits
        logits = logits.double()[:, :-1]
        logp = torch.nn.functional.pad(torch.log_softmax(logits / session.sampling.temperature, -1).gather(
            -1, ids[:, 1:, None]).squeeze(-1), (1, 0))
        ent = torch.nn.functional.pad(entropy_from_logits(logits / session.sampling.temperature), (1, 0))
    ratio = (logp - batch.behavior_logprobs.double())[on].exp()
    a = adv[on]
    clip = lrn.loss.clip_low, lrn.loss.clip_high
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip[0], 1 + clip[1]) * a).mean()
    assert stats["loss"] == pytest.approx(float(loss), rel=1e-6)
    assert stats["entropy"] == pytest.approx(float(ent[on].mean()), rel=1e-6)
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-9)  # lr 0: the policy is its reference
    delta = (logp - batch.behavior_logprobs.double())[on].abs()
    assert stats["logprob_mismatch_max"] == pytest.approx(float(delta.max()), rel=1e-6)
    assert stats["ratio_max"] == pytest.approx(float(ratio.max()), rel=1e-6)


# -- (c) an episode trains exactly its policy tokens ---------------------------------------------------------------

@pytest.mark.parametrize("share", [False, True], ids=["plain", "prefill-shared"])
@pytest.mark.parametrize("name,agg", [("grpo", None), ("dr_grpo", None), ("gspo", None),
                                      ("grpo", "seq-mean-token-mean")])
def test_an_episode_trains_its_policy_tokens_as_a_dense_response_would(session, plugins, batch, name, agg, share):
    """Loss and gradient of the learner on the episode batch equal those of a reference that forwards each whole
    row once (environment tokens are context), gathers the policy tokens' log-probs into a dense [N, L] response
    and applies the loss (and KL-in-loss) with an all-ones mask over them."""
    from rlctl.algo import gspo_loss

    lrn = frozen(session, plugins, name, "loss", share=share, loss_agg=agg)
    ref_model = make(session, plugins, name, kl="loss").model  # the same weights, float64
    adv = torch.where(batch.action_mask > 0, torch.linspace(-1, 1, 8)[:, None], 0.0)
    trained = replace(batch, advantages=adv)
    stats, grads = grads_of(lrn, trained)

    ids, att, on = batch.input_ids, batch.attention_mask, batch.action_mask > 0
    s = batch.sampling
    logits = ref_model(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(-1) - 1).clamp(min=0)).logits
    logp = torch.nn.functional.pad(token_logprobs(logits[:, :-1], ids[:, 1:], s.temperature, s.top_k, s.top_p),
                                   (1, 0))
    lengths = on.sum(-1)
    width = int(lengths.max())
    dense_mask = (torch.arange(width)[None] < lengths[:, None]).float()  # [N, L]

    def dense(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((x.shape[0], width), dtype=x.dtype)
        out[dense_mask > 0] = x[on]  # row-major order keeps each row's tokens in order
        return out

    ref_lp = lrn.ref_logprobs(batch).to(logp.dtype)
    spec = lrn.loss
    if spec.kind == "sequence":
        loss, info = gspo_loss(dense(logp), dense(batch.behavior_logprobs), dense(adv), dense_mask, spec.clip_low,
                               spec.clip_high)
    else:
        loss, info = ppo_clip_loss(dense(logp), dense(batch.behavior_logprobs), dense(adv), dense_mask,
                                   spec.clip_low, spec.clip_high, spec.agg, norm_len=lrn.norm_len)
    kl, kl_value = kl_penalty_loss(dense(logp), dense(ref_lp), dense_mask, "k3", spec.agg, norm_len=lrn.norm_len)
    (loss + 0.3 * kl).backward()
    assert stats["loss"] == pytest.approx(info["loss"], rel=1e-6, abs=1e-9)
    assert stats["kl_ref"] == pytest.approx(kl_value, abs=1e-9)
    for n, p in ref_model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[n], p.grad, rtol=1e-6, atol=1e-9 + 1e-6 * float(p.grad.abs().max()))


# -- (d) packed and padded learners agree on episodes ---------------------------------------------------------------

@pytest.mark.parametrize("share", [False, True], ids=["packed", "packed-shared-prompts"])
@pytest.mark.parametrize("name", ESTIMATORS)
def test_packed_and_padded_learners_agree_on_episodes(session, plugins, batch, name, share):
    adv = torch.where(batch.action_mask > 0, torch.linspace(-1, 1, 8)[:, None], 0.0)
    episodes_batch = replace(batch, advantages=adv)
    metrics = ("loss", "clip_fraction", "ratio_mean", "ratio_max", "approx_kl_behavior", "kl_ref", "entropy",
               "logprob_mismatch_mean", "logprob_mismatch_max", "grad_norm")
    compare(make(session, plugins, name, tokens=10_000, kl="loss", share=share),
            make(session, plugins, name, kl="loss"), episodes_batch, metrics)
    compare(make(session, plugins, name, tokens=40, kl="loss", share=share),
            make(session, plugins, name, size=3, kl="loss"), episodes_batch, ("grad_norm",))


def test_prefill_sharing_gives_the_plain_forwards_log_probs_on_episodes(session, plugins, batch):
    from rlctl.kit.prefill import prefix_shared_logprobs

    lrn = make(session, plugins)
    with torch.no_grad():
        plain, plain_ent = lrn._logprobs(lrn.model, batch, with_entropy=True)
        shared, shared_ent = prefix_shared_logprobs(lrn.model, batch, with_entropy=True)
    on = batch.action_mask > 0
    torch.testing.assert_close(shared[on], plain[on], rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(shared_ent[on], plain_ent[on], rtol=1e-9, atol=1e-9)


# -- the critic and DAPO's length ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens", [None, 40], ids=["padded", "packed"])
def test_the_critic_regresses_only_on_policy_tokens(session, plugins, batch, tokens):
    from rlctl.placement.build import build_critic

    cfg = config(session, "ppo", "reward")
    cfg.train = cfg.train.model_copy(update={"micro_batch_tokens": tokens})
    critics = [build_critic(cfg, plugins, session.policy_dir) for _ in range(2)]
    values = critics[0].values(batch)
    assert float(values[batch.action_mask == 0].abs().max()) == 0.0
    env = environment_positions(batch)
    returns = torch.where(batch.action_mask > 0, torch.linspace(0, 1, 8)[:, None], 0.0)
    noisy = torch.where(env, 100.0, returns)
    old_noisy = torch.where(env, -100.0, values)
    a = critics[0].train_step(batch, returns, values)
    b = critics[1].train_step(batch, noisy, old_noisy)
    assert a == b
    sa, sb = critics[0].model.state_dict(), critics[1].model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_packed_and_padded_critics_agree_on_episodes(session, plugins, batch):
    """Values, value loss, clipping and gradients of a packed critic on the episodes (several micro-batches)
    equal the padded critic's within 1e-6 relative (float64)."""
    packed = make_critic(session, plugins, tokens=40)
    assert len(list(packed._micro(batch))) > 2
    compare_critics(packed, make_critic(session, plugins, size=3), batch, ("critic_grad_norm", "value_mean"))
    one = make_critic(session, plugins, tokens=10_000)
    compare_critics(one, make_critic(session, plugins), batch, CRITIC_METRICS)


def test_dapo_overlong_penalty_measures_an_episode_by_its_longest_policy_turn(session, plugins):
    from rlctl.placement.build import build_estimator

    eps = episodes(session)
    assert sampled_lengths(eps) == [3, 3, 5, 4, 3, 3, 6, 2]  # the single-turn sample: its whole response
    assert [t.num_response_tokens for t in eps[:2]] == [9, 11]  # what a whole-response length would have punished
    cfg = session.config.model_copy(deep=True)
    cfg.algo = cfg.algo.model_copy(update={"name": "dapo", "options": {"overlong_buffer": 2, "overlong_penalty": 1.0}})
    dapo = build_estimator(cfg, plugins)
    shaped = dapo.shape_rewards(torch.zeros(2, 4), torch.tensor(sampled_lengths(eps)).view(2, 4), max_tokens=6)
    assert shaped.tolist() == [[0.0, 0.0, -0.5, 0.0], [0.0, 0.0, -1.0, 0.0]]  # tool episodes are not punished


# -- the whole training step ------------------------------------------------------------------------------------

def test_a_training_step_on_episode_groups_measures_and_trains_only_policy_tokens(session, plugins):
    """``train_on`` (the step every mode runs) on the episode groups, one of them reweighted as beyond the
    staleness bound: it trains and publishes, and D_lag -- |log pi_learner - log mu| averaged over the trained
    tokens -- is ~0 when mu is the learner's own log-probs; it would be ~|log pi| if the environment's tokens
    (behaviour log-prob 0.0) were counted. Runs last in this module: it moves the session's learner."""
    from rlctl.engine.groups import select_groups
    from rlctl.engine.spec import LoopSpec
    from rlctl.engine.step import StepInput, train_on

    eps = episodes(session)
    b = build_batch(eps, [0.0] * 8, session.tokenizer.pad_token_id, session.sampling)
    logp = session.learner.logprobs(b)
    eps = [t.updated(behavior_logprobs=tuple(float(x) if m else 0.0 for x, m in zip(
        logp[i, len(t.prompt_tokens):len(t.prompt_tokens) + t.num_response_tokens].tolist(), t.action_mask)))
        for i, t in enumerate(eps)]
    spec = LoopSpec.from_config(session.config)
    sel = select_groups(eps, session.estimator, 4, spec.max_tokens)
    assert len(sel.kept) == 8
    version = session.learner.policy_version
    outcome = train_on(StepInput(selection=sel, times={"T_r": 1.0, "T_v": 0.0}, reweighted=frozenset({1}),
                                 staleness=[0, 3]), session, spec, step=0)
    m = outcome.metrics
    assert outcome.updated and outcome.version == version + 1 and m["groups_trained"] == 2.0
    assert m["reweighted_groups"] == 1.0 and math.isfinite(m["loss"]) and math.isfinite(m["entropy"])
    assert m["dlag_p99"] < 1e-4 and m["logprob_mismatch_max"] < 1e-4
    assert outcome.samples[:4] == tuple(eps[:4])


# -- per-turn rewards: the episode return, and where GAE puts them ----------------------------------------------

def _with_turn_rewards(t: Trajectory, rewards: dict[int, float]) -> Trajectory:
    """``t`` with ``rewards[k]`` on its k-th turn."""
    return t.updated(turns=tuple(replace(u, reward=rewards.get(k)) for k, u in enumerate(t.turns)))


def test_outcome_estimators_learn_from_the_episode_return_counted_once(session, plugins):
    """An episode's return is the grader's reward plus its turn rewards (never inside the grader's total): the
    [B, G] rewards every outcome estimator sees. GRPO's advantages follow the returns, not the grader alone."""
    from rlctl.engine.batching import episode_return, group_rewards
    from rlctl.engine.groups import select_groups
    from rlctl.placement.build import build_estimator

    eps = episodes(session)
    eps[0] = _with_turn_rewards(eps[0], {0: -0.25})  # P E P: the first policy turn earned -0.25
    eps[1] = _with_turn_rewards(eps[1], {0: 0.5, 2: -1.0})
    assert [episode_return(t) for t in eps[:4]] == [0.75, -0.5, 1.0, 0.0]
    assert episode_return(eps[0].updated(reward=None)) is None  # unscored stays unscored
    rewards, valid = group_rewards(eps, 4)
    assert rewards[0].tolist() == [0.75, -0.5, 1.0, 0.0] and rewards[1].tolist() == REWARDS[1].tolist()
    cfg = session.config.model_copy(deep=True)
    cfg.algo = cfg.algo.model_copy(update={"name": "rloo"})
    sel = select_groups(eps, build_estimator(cfg, plugins), 4, 6)
    adv, _ = build_estimator(cfg, plugins).advantages(AdvantageInputs(
        rewards=sel.rewards, valid=sel.valid, action_mask=torch.ones(8, 1)))
    # RLOO by hand on the returns of group 0: r_i - mean of the other three
    want = [0.75 - (-0.5 + 1.0 + 0.0) / 3, -0.5 - (0.75 + 1.0) / 3, 1.0 - (0.75 - 0.5) / 3, 0.0 - 1.25 / 3]
    torch.testing.assert_close(adv[:4, 0], torch.tensor(want), rtol=0, atol=1e-6)


def test_turn_rewards_sit_on_the_last_policy_token_before_their_environment_turn(session):
    from rlctl.engine.batching import turn_rewards

    eps = episodes(session)
    assert turn_rewards(eps, 30) is None  # no turn rewards: nothing changes for the estimators
    eps[0] = _with_turn_rewards(eps[0], {0: -0.25, 1: 0.125})  # P(3) E(4) P(2): on the policy turn / the env turn
    eps[5] = _with_turn_rewards(eps[5], {0: 2.0, 1: 0.5})  # E(2) P(1) E(5) P(3): before any policy token / P(1)
    out = turn_rewards(eps, 30)
    p0, p5 = len(eps[0].prompt_tokens), len(eps[5].prompt_tokens)
    assert out[0, p0 + 2] == -0.25 + 0.125 and int((out[0] != 0).sum()) == 1  # both on token 2, the end of P(3)
    assert out[5, p5 + 2] == 2.0 + 0.5 and int((out[5] != 0).sum()) == 1  # the first policy token, then P(1)'s
    assert float(out.abs().sum()) == pytest.approx(0.125 + 2.5) and int((out != 0).sum()) == 2


def test_gae_puts_a_turn_reward_on_its_turn_and_the_rest_of_the_return_at_the_end():
    """MASK's episode: a 2-token policy turn that earned -0.5 (the environment answered it), a 2-token
    environment turn, a 1-token policy turn; the grader gave 1.0, so the return is 0.5."""
    from rlctl.algo import outcome_token_rewards

    turn = torch.tensor([[0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 0.0, 0.0]])
    token_r = outcome_token_rewards(torch.tensor([0.5]), MASK, turn_rewards=turn)
    assert token_r.tolist() == [[0.0, 0.0, 0.0, -0.5, 0.0, 0.0, 1.0, 0.0]] and float(token_r.sum()) == 0.5
    values = torch.tensor([[5.0, 5.0, 0.2, 0.4, 7.0, 7.0, 0.6, 5.0]])
    adv, returns = gae(token_r, values, MASK, gamma=0.9, lam=0.5)
    # t=6: 1 - 0.6 = 0.4; t=3: -0.5 + 0.9 * 0.6 - 0.4 = -0.36, + 0.45 * 0.4 -> -0.18;
    # t=2: 0.9 * 0.4 - 0.2 = 0.16, + 0.45 * -0.18 -> 0.079
    want = torch.tensor([[0.0, 0.0, 0.079, -0.18, 0.0, 0.0, 0.4, 0.0]])
    torch.testing.assert_close(adv, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(returns, torch.where(MASK > 0, want + values, 0.0), rtol=0, atol=1e-6)
    # the PPO estimator does the same from AdvantageInputs (the return as the reward, the turn rewards apart)
    from types import SimpleNamespace

    from rlctl_algos.estimators import PPO

    ppo = PPO(SimpleNamespace(critic=SimpleNamespace(gamma=0.9, lam=0.5)))
    inputs = AdvantageInputs(rewards=torch.tensor([[0.5]]), valid=torch.ones(1, 1, dtype=torch.bool),
                             action_mask=MASK, values=values, turn_rewards=turn)
    torch.testing.assert_close(ppo.value_targets(inputs), returns, rtol=0, atol=1e-6)
    # REINFORCE++: the turn reward is in the returns of the tokens before it only (t=6 sees 1.0, t=2,3 see 0.5)
    from rlctl.algo import reinforce_pp_advantages

    _, stats = reinforce_pp_advantages(torch.tensor([0.5, 0.5]), MASK.repeat(2, 1),
                                       turn_rewards=torch.cat([turn, torch.zeros_like(turn)]))
    assert stats["return_mean"] == pytest.approx((0.5 + 0.5 + 1.0 + 3 * 0.5) / 6)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.floats(-2, 2, width=32), st.booleans()), min_size=1, max_size=12),
       st.floats(-3, 3, width=32))
def test_token_rewards_always_sum_to_the_return_and_stay_on_policy_tokens(cells, ret):
    """Whatever the layout, a row's token rewards sum to its return: nothing counted twice, nothing lost."""
    from rlctl.algo import outcome_token_rewards

    mask = torch.tensor([[float(m) for m, _, _ in cells]])
    turn = torch.tensor([[r if m and has else 0.0 for m, r, has in cells]])
    out = outcome_token_rewards(torch.tensor([ret]), mask, turn_rewards=turn)
    if mask.any():
        assert float(out.sum()) == pytest.approx(ret, abs=1e-5)
    assert float(out[mask == 0].abs().sum()) == 0.0


def test_a_training_step_hands_the_turn_rewards_to_a_per_token_estimator(session, plugins):
    """``train_on`` with REINFORCE++: one episode earned 1.0 on its first policy turn (3 tokens) and nothing
    else in the batch was rewarded, so the return is 1.0 on those 3 of the 39 policy tokens and 0 after them;
    without the turn rewards the 1.0 would sit on the episode's last token and count for all 5 of its tokens."""
    from dataclasses import replace as with_fields

    from rlctl.engine.groups import select_groups
    from rlctl.engine.spec import LoopSpec
    from rlctl.engine.step import StepInput, train_on
    from rlctl.placement.build import build_estimator

    cfg = config(session, "reinforce_pp", "loss")
    estimator = build_estimator(cfg, plugins)
    eps = [t.updated(reward=0.0) for t in episodes(session)]
    eps[0] = _with_turn_rewards(eps[0], {0: 1.0})
    assert sum(t.num_policy_tokens for t in eps) == 39
    spec = LoopSpec.from_config(cfg)
    sel = select_groups(eps, estimator, 4, spec.max_tokens)
    outcome = train_on(StepInput(selection=sel, times={"T_r": 1.0, "T_v": 0.0}),
                       with_fields(session, estimator=estimator), spec, step=0)
    assert outcome.metrics["return_mean"] == pytest.approx(3 / 39, abs=1e-6)
    assert outcome.metrics["episode_turn_reward"] == pytest.approx(1 / 8)
