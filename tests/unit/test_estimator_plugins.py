"""The built-in estimators, resolved by name through the plugin registry like a third party's."""

from __future__ import annotations

import pytest
import torch

from rlctl import AdvantageInputs, PluginError
from rlctl.algo import gae, whiten
from rlctl.config.models import AlgoConfig, RunConfig
from rlctl.contracts.errors import ConfigError
from rlctl.placement.build import build_estimator, policy_loss
from rlctl.hooks.manager import load_plugins

PLUGINS = load_plugins()
MASK = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]], dtype=torch.float32)  # N = 4 rows, B=2, G=2
REWARDS = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
VALID = torch.ones(2, 2, dtype=torch.bool)


def _est(name: str, **algo):
    cfg = RunConfig(algo=AlgoConfig(name=name, group_size=2, prompts_per_step=2, **algo))
    return build_estimator(cfg, PLUGINS), cfg


def _close(a, b, tol=1e-5):
    assert torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol), (a, b)


def test_every_builtin_is_registered_by_the_algos_plugin():
    comps = {n: PLUGINS.get("advantage_estimator", n).plugin for n in PLUGINS.names("advantage_estimator")}
    assert comps == {n: "algos" for n in ("dapo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "rloo")}


def test_unknown_estimator_names_the_close_match():
    with pytest.raises(PluginError, match="did you mean 'rloo'"):
        _est("rlo")


def test_bad_estimator_options_are_a_config_error():
    with pytest.raises(ConfigError, match="algo.options"):
        _est("dapo", options={"clip_hgh": 0.3})


@pytest.mark.parametrize(("name", "expected"), [
    # group 0 rewards [1, 0]: GRPO mean .5, std sqrt(.5) -> +-0.7071; group 1 all equal -> 0
    ("grpo", [0.70710, -0.70710, 0.0, 0.0]),
    ("dr_grpo", [0.5, -0.5, 0.0, 0.0]),
    ("rloo", [1.0, -1.0, 0.0, 0.0]),
    ("gspo", [0.70710, -0.70710, 0.0, 0.0]),
    ("dapo", [0.70710, -0.70710, 0.0, 0.0]),
])
def test_outcome_estimators_broadcast_the_sequence_advantage(name, expected):
    est, _ = _est(name)
    adv, _ = est.advantages(AdvantageInputs(rewards=REWARDS, valid=VALID, action_mask=MASK))
    _close(adv, torch.tensor(expected).view(4, 1) * MASK, tol=1e-4)


def test_reinforce_pp_whitens_over_the_batch():
    est, _ = _est("reinforce_pp")
    adv, _ = est.advantages(AdvantageInputs(rewards=REWARDS, valid=VALID, action_mask=MASK))
    returns = torch.tensor([1.0, 0.0, 1.0, 1.0]).view(4, 1) * MASK
    _close(adv, whiten(returns, MASK))


def test_ppo_is_whitened_gae_over_the_critic_values():
    est, cfg = _est("ppo", critic={"gamma": 0.9, "lam": 0.8})
    values = torch.tensor([[0, 0.5, 0.4], [0, 0.2, 0], [0, 0.9, 0.9], [0, 0.1, 0.3]])
    inputs = AdvantageInputs(rewards=REWARDS, valid=VALID, action_mask=MASK, values=values)
    adv, _ = est.advantages(inputs)
    token_r = torch.tensor([[0, 0, 1.0], [0, 0.0, 0], [0, 0, 1.0], [0, 0, 1.0]])
    ref_adv, ref_ret = gae(token_r, values, MASK, 0.9, 0.8)
    _close(adv, whiten(ref_adv, MASK))
    _close(est.value_targets(inputs), ref_ret)
    # hand check of row 0: delta_2 = 1 - 0.4 = 0.6; delta_1 = 0 + 0.9 * 0.4 - 0.5 = -0.14;
    # A_1 = -0.14 + 0.72 * 0.6 = 0.292; returns = A + V = [0.792, 1.0]
    _close(ref_ret[0, 1:], [0.792, 1.0])
    with pytest.raises(ValueError, match="critic"):
        est.advantages(AdvantageInputs(rewards=REWARDS, valid=VALID, action_mask=MASK))


def test_policy_loss_resolution():
    cases = {
        "grpo": ("token", 0.2, 0.2, "token-mean"),
        "dr_grpo": ("token", 0.2, 0.2, "seq-mean-token-sum-norm"),
        "gspo": ("sequence", 3e-4, 4e-4, "token-mean"),
        "dapo": ("token", 0.2, 0.28, "token-mean"),
    }
    for name, (kind, low, high, agg) in cases.items():
        est, cfg = _est(name)
        spec = policy_loss(cfg, est)
        assert (spec.kind, spec.clip_low, spec.clip_high, spec.agg, spec.tis_cap) == (kind, low, high, agg, None)
    est, cfg = _est("dr_grpo", loss_agg="token-mean", tis_cap=2.0)
    assert (policy_loss(cfg, est).agg, policy_loss(cfg, est).tis_cap) == ("token-mean", 2.0)


@pytest.mark.parametrize("name", ["gspo", "dapo"])
def test_a_token_clip_is_refused_by_estimators_with_their_own_clip(name):
    """algo.clip_eps / clip_eps_high would be ignored by gspo and dapo: a config error names the key they read."""
    with pytest.raises(ConfigError, match=rf"algo.clip_eps=0.3 is not used by {name}.*algo.options.clip_low") as err:
        _est(name, clip_eps=0.3)
    assert "algo.options.clip_low" in err.value.hint
    with pytest.raises(ConfigError, match=rf"algo.clip_eps_high=0.28 is not used by {name}") as err:
        _est(name, clip_eps_high=0.28)
    assert "algo.options.clip_high" in err.value.hint
    est, cfg = _est(name, clip_eps=0.2, options={"clip_low": 0.1, "clip_high": 0.15})  # the default is no conflict
    assert (policy_loss(cfg, est).clip_low, policy_loss(cfg, est).clip_high) == (0.1, 0.15)
    for other in ("grpo", "ppo"):  # the token-clip estimators read it
        est, cfg = _est(other, clip_eps=0.3, clip_eps_high=0.35)
        assert (policy_loss(cfg, est).clip_low, policy_loss(cfg, est).clip_high) == (0.3, 0.35)


def test_dapo_filters_and_shapes():
    est, _ = _est("dapo", options={"overlong_buffer": 4, "overlong_penalty": 0.5})
    assert est.keep_groups(REWARDS, VALID).tolist() == [True, False]
    shaped = est.shape_rewards(REWARDS, torch.tensor([[8, 12], [2, 10]]), max_tokens=12)
    _close(shaped, [[1.0, -0.5], [1.0, 1.0 - 0.25]])
    off, _ = _est("dapo", options={"dynamic_sampling": False})
    assert off.keep_groups(REWARDS, VALID).tolist() == [True, True]
    grpo, _ = _est("grpo")
    assert grpo.keep_groups(REWARDS, VALID).tolist() == [True, True]


def test_group_size_one_only_for_estimators_without_a_group_baseline():
    for name in ("ppo", "reinforce_pp"):
        build_estimator(RunConfig(algo=AlgoConfig(name=name, group_size=1, prompts_per_step=2)), PLUGINS)
    with pytest.raises(ConfigError, match="group baseline"):
        build_estimator(RunConfig(algo=AlgoConfig(name="rloo", group_size=1, prompts_per_step=2)), PLUGINS)


def test_a_third_party_estimator_is_selected_by_name():
    from types import SimpleNamespace

    from rlctl import hookimpl
    from rlctl_algos.estimators import RLOO

    class SignOnly(RLOO):
        """A third party's estimator: the sign of the leave-one-out advantage."""

        def advantages(self, inputs):
            adv, stats = super().advantages(inputs)
            return adv.sign(), stats

    plugin = SimpleNamespace(register_advantage_estimators=hookimpl(
        lambda register: register("sign_rloo", lambda options, algo: SignOnly(algo, options))))
    plugins = load_plugins(extra={"sign": plugin})
    cfg = RunConfig(algo=AlgoConfig(name="sign_rloo", group_size=2, prompts_per_step=2))
    est = build_estimator(cfg, plugins)
    adv, _ = est.advantages(AdvantageInputs(rewards=REWARDS, valid=VALID, action_mask=MASK))
    _close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]).view(4, 1) * MASK)
    assert plugins.get("advantage_estimator", "sign_rloo").plugin == "sign"


def test_an_object_that_is_not_an_estimator_is_refused():
    from types import SimpleNamespace

    from rlctl import hookimpl

    plugin = SimpleNamespace(register_advantage_estimators=hookimpl(
        lambda register: register("broken", lambda options, algo: object())))
    cfg = RunConfig(algo=AlgoConfig(name="broken", group_size=2, prompts_per_step=2))
    with pytest.raises(PluginError, match="AdvantageEstimator"):
        build_estimator(cfg, load_plugins(extra={"broken": plugin}))


@pytest.mark.parametrize("learner", ["fsdp2", "deepspeed"])
def test_a_critic_estimator_on_a_learner_without_a_critic_stops_before_any_model_loads(learner, tmp_path):
    """PPO needs a critic backend named like train.learner; only torch has one: one error, nothing built."""
    from rlctl.config.load import load_config
    from rlctl.placement.build import build_common
    from tests.conftest import TINY_OVERRIDES

    config = load_config(None, [*TINY_OVERRIDES, "algo.name=ppo", f"train.learner={learner}"])
    with pytest.raises(ConfigError, match=rf"algo.name=ppo needs a critic, and train.learner={learner} has no "
                                          r"critic backend") as err:
        build_common(config, load_plugins(), tmp_path / "cache")
    assert "train.learner=torch" in err.value.hint and not (tmp_path / "cache").exists()
