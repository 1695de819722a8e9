"""Several RL seeds from one warm start: ``rlctl train --seeds N`` and ``rlctl eval RUN1 RUN2 | --group G``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import rlctl


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path) -> Path:
    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return tmp_path


def test_train_seeds_runs_each_seed_from_one_warm_start_and_pools_them(home):
    out = json.loads(rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.steps=2", "run.seed=7",
                           "--seeds", "2", "--json", home=home, check=True).stdout)
    runs = out["runs"]
    assert [r["seed"] for r in runs] == [7, 8] and {r["status"] for r in runs} == {"succeeded"}
    assert len({r["id"] for r in runs}) == 2 and len({r["run_dir"] for r in runs}) == 2
    starts = {json.loads((Path(r["run_dir"]) / "run.json").read_text())["initial_policy"] for r in runs}
    assert len(starts) == 1, "every seed must start from the same warm start"
    assert all(r["config"]["model"]["warm_start"]["seed"] == 7 for r in runs)

    evals = out["evals"]
    assert [e["run_id"] for e in evals] == [r["id"] for r in runs]
    assert len({e["baseline_pass_at_1"] for e in evals}) == 1  # one starting policy, graded once
    pooled = out["pooled"]
    assert pooled["num_seeds"] == 2 and pooled["num_prompts"] == evals[0]["num_prompts"] == 20
    assert pooled["diff"] == pytest.approx(sum(e["diff"] for e in evals) / 2)
    assert pooled["ci_low"] <= pooled["diff"] <= pooled["ci_high"]
    assert set(out["times"]) == {"warm_start_s", "rl_s", "eval_s"} and out["wall_s"] > 0

    # the group is in the registry: `rlctl eval --group` finds both runs and reports the same numbers
    group = out["group"]
    again = json.loads(rlctl("eval", "--group", group[:-2], "--json", home=home, check=True).stdout)
    assert [e["run_id"] for e in again["evals"]] == [r["id"] for r in runs]
    assert again["pooled"]["diff"] == pytest.approx(pooled["diff"])
    from rlctl.registry.store import Registry

    with Registry.open(f"sqlite:///{home}/registry.db") as reg:
        assert reg.runs_in_group(group) == [r["id"] for r in runs]
        assert any(e.kind == "seed_group" and e.message == group for e in reg.events(runs[1]["id"]))
        assert [e.kind for e in reg.events(runs[0]["id"])].count("group_eval") == 1

    table = rlctl("eval", runs[0]["id"], runs[1]["id"], "--num-prompts", "10", home=home, check=True).stdout
    assert "pooled, 2 seeds" in table and "(seed 8)" in table and "gain positive in" in table and "10 prompts" in table
    missing = rlctl("eval", "--group", "seeds-nope", home=home)
    assert missing.returncode == 1 and "no runs in seed group" in missing.stderr


@pytest.mark.slow
def test_eval_refuses_to_pool_runs_on_different_prompts(home):
    a = json.loads(rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.steps=1", "eval.at_end=false",
                         "--json", home=home, check=True).stdout)["run"]["id"]
    b = json.loads(rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.steps=1", "eval.at_end=false",
                         "eval.num_prompts=10", "--json", home=home, check=True).stdout)["run"]["id"]
    proc = rlctl("eval", a, b, home=home)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "cannot be pooled" in proc.stderr
