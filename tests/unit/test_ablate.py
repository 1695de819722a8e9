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
