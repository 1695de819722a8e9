"""``train.stop_rules``: which rule fires when, and config errors that name the rule, the reason and the fix."""

from __future__ import annotations

import pytest

from rlctl.config.models import StopRule
from rlctl.lifecycle.stop_rules import StopRules


def _feed(rules, rows):
    sr = StopRules([StopRule(**r) for r in rules])
    for step, metrics in rows:
        stop = sr.observe(step, metrics)
        if stop is not None:
            return stop
    return None


def test_dev_drop_fires_on_n_consecutive_falls_and_skips_steps_without_an_eval():
    rows = [(1, {"eval_dev_pass_at_1": 0.5}), (2, {"reward_mean": 1.0}), (3, {"eval_dev_pass_at_1": 0.6}),
            (5, {"eval_dev_pass_at_1": 0.4}), (6, {"reward_mean": 1.0}), (7, {"eval_dev_pass_at_1": 0.3})]
    stop = _feed([{"rule": "dev_drop", "evals": 2}], rows)
    assert stop is not None and stop.step == 7 and stop.rule == "dev_drop"
    assert "0.6 -> 0.4 -> 0.3" in stop.message and "after step 8" in stop.message
    assert _feed([{"rule": "dev_drop", "evals": 3}], rows) is None  # three falls in a row never happened


def test_a_flat_dev_score_is_not_a_drop():
    assert _feed([{"rule": "dev_drop", "evals": 1}], [(s, {"eval_dev_pass_at_1": 0.5}) for s in range(5)]) is None


@pytest.mark.parametrize("rule, metric, values, fires_at", [
    ({"rule": "kl", "max": 0.1, "window": 2}, "kl_ref", [0.05, 0.2, 0.05, 0.2, 0.3], 4),
    ({"rule": "entropy", "min": 0.5}, "entropy", [2.0, 1.0, 0.4], 2),
    ({"rule": "lag_p95", "max": 2}, "staleness_p95", [1, 2, 2, 3], 3),
    ({"rule": "reward_gap", "max": 0.5}, "eval_reward_gap", [0.1, 0.3, float("nan"), 0.6], 3),
])
def test_bounds_fire_after_their_window(rule, metric, values, fires_at):
    stop = _feed([rule], [(s, {metric: v}) for s, v in enumerate(values)])
    assert stop is not None and stop.step == fires_at and stop.metric == metric
    assert f"train.stop_rules.0 ({rule['rule']})" in stop.message


@pytest.mark.parametrize("overrides, needles", [
    (["train.stop_rules=[{rule: kl}]"], ["'kl' has no bound", "set max"]),
    (["train.stop_rules=[{rule: entropy, min: 2, max: 1}]"], ["min 2 >= max 1", "set min below max"]),
    (["train.stop_rules=[{rule: dev_drop}]"], ["train.stop_rules.0 (dev_drop)", "eval.every_steps=0", "set eval.every_steps=N"]),
    (["train.stop_rules=[{rule: reward_gap, max: 0.5}]", "eval.every_steps=2"], ["eval.grader={name: math}"]),
    (["train.stop_rules=[{rule: speed, max: 1}]"], ["rule"]),
    (["train.stop_rules=[{rule: kl, max: 0.5}]"], ["train.stop_rules.0 (kl)", "algo.kl.coef=0", "set algo.kl.coef>0"]),
])
def test_config_errors_name_the_rule_the_reason_and_the_fix(overrides, needles):
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    text = str(info.value)
    for needle in needles:
        assert needle in text


def test_a_valid_stop_rule_config_loads():
    from rlctl.config.load import load_config

    config = load_config(None, ["eval.every_steps=2", "eval.grader={name: math}",
                                "train.stop_rules=[{rule: dev_drop, evals: 2}, {rule: reward_gap, max: 0.5}]"])
    assert [r.rule for r in config.train.stop_rules] == ["dev_drop", "reward_gap"]
    for mode in ("one_step_off", "async"):  # the dev eval runs at every mode's step end
        assert load_config(None, [f"mode={mode}", "eval.every_steps=2",
                                  "train.stop_rules=[{rule: dev_drop}]"]).train.stop_rules[0].rule == "dev_drop"
