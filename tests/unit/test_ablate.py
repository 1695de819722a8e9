"""rlctl ablate's pieces without training: axes, cells, the pooled bootstrap, the registry tables."""

from __future__ import annotations

import pytest

from rlctl.config.load import load_config
from rlctl.contracts.errors import ConfigError
from rlctl.lifecycle.ablate import parse_axis, plan


def test_parse_axis():
    axis = parse_axis("algo.name=grpo, rloo,dr_grpo")
    assert (axis.key, axis.values) == ("algo.name", ("grpo", "rloo", "dr_grpo"))
    for bad in ("algo.name", "=a,b", "algo.name=", "algo.name=a,,b", "algo.name=a,a"):
        with pytest.raises(ConfigError):
            parse_axis(bad)


def test_plan_is_the_cartesian_product_with_the_first_values_as_baseline():
    base = load_config(None, ["run.seed=7"])
    p = plan(base, ["algo.name=grpo,rloo", "algo.group_size=4,8"], seeds=3, budget_tokens=1000)
    assert [c.key for c in p.cells] == ["algo.name=grpo algo.group_size=4", "algo.name=grpo algo.group_size=8",
                                        "algo.name=rloo algo.group_size=4", "algo.name=rloo algo.group_size=8"]
    assert p.baseline.key == "algo.name=grpo algo.group_size=4"
    assert p.seeds == (7, 8, 9)
    assert p.spec_hash() == plan(base, ["algo.name=grpo,rloo", "algo.group_size=4,8"], 3, 1000).spec_hash()
    assert p.spec_hash() != plan(base, ["algo.name=grpo,rloo", "algo.group_size=4,8"], 2, 1000).spec_hash()


def test_plan_validates_every_cell_before_running():
    base = load_config(None, [])
    with pytest.raises(ConfigError, match="ablation cell"):
        plan(base, ["algo.group_size=8,0"], seeds=1, budget_tokens=None)
    with pytest.raises(ConfigError, match="--seeds"):
        plan(base, ["algo.name=grpo"], seeds=0, budget_tokens=None)
    with pytest.raises(ConfigError, match="twice"):
        plan(base, ["algo.name=grpo", "algo.name=rloo"], seeds=1, budget_tokens=None)
    with pytest.raises(ConfigError, match="at least one"):
        plan(base, [], seeds=1, budget_tokens=None)


def test_a_seconds_budget_is_parsed_hashed_apart_and_a_token_plan_keeps_its_hash():
    from rlctl.lifecycle.ablate import parse_budget

    base = load_config(None, [])
    assert parse_budget(None, 500) == ("tokens", 500) and parse_budget("tokens=300", None) == ("tokens", 300)
    assert parse_budget("wall-seconds=90", None) == ("wall-seconds", 90.0)
    assert parse_budget("device-seconds", None) == ("device-seconds", None)
    for bad, match in [("hours=3", "one of tokens"), ("wall-seconds=0", "positive"), ("wall-seconds=x", "positive")]:
        with pytest.raises(ConfigError, match=match):
            parse_budget(bad, None)
    with pytest.raises(ConfigError, match="two budgets"):
        parse_budget("wall-seconds=5", 100)
    tokens = plan(base, ["algo.name=grpo,rloo"], 1, 1000)
    assert "budget_kind" not in tokens.spec()  # the spec (and the hash an interrupted ablation is found by)
    assert plan(base, ["algo.name=grpo,rloo"], 1, None, "tokens=1000").spec_hash() == tokens.spec_hash()
    wall = plan(base, ["algo.name=grpo,rloo"], 1, None, "wall-seconds=60")
    assert (wall.budget_kind, wall.budget_seconds, wall.budget_tokens) == ("wall-seconds", 60.0, None)
    assert wall.spec_hash() != plan(base, ["algo.name=grpo,rloo"], 1, None, "device-seconds=60").spec_hash()


def test_devices_used_counts_learner_ranks_and_rollout_engines():
    from rlctl.lifecycle.ablate import devices_used

    assert devices_used(load_config(None, [])) == 2  # local sync: the learner and the one rollout engine
    assert devices_used(load_config(None, ["mode=async", "cluster.num_rollout_workers=3"])) == 4
    assert devices_used(load_config(None, ["mode=async", "cluster.num_rollout_workers=2", "train.learner=fsdp",
                                           "train.learner_options.world_size=2"])) == 4
