"""``rlctl ablate`` end to end on the tiny model: table, JSON, registry, equal budget, plot, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO, _assert_one_line_error, rlctl

OVERRIDES = [o for o in TINY_OVERRIDES if not o.startswith("train.steps")]
ARGS = ["ablate", "configs/quickstart.yaml", *OVERRIDES, "train.steps=2", "--axis", "algo.name=grpo,rloo",
        "--seeds", "2"]


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path, tiny_policy_dir) -> Path:
    (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return tmp_path


def test_bad_axis_is_one_line(home):
    _assert_one_line_error(rlctl("ablate", "configs/quickstart.yaml", "--axis", "algo.name", home=home),
                           "--axis", "KEY=v1,v2")


def test_set_is_refused_with_the_positional_form(home):
    result = rlctl("ablate", "configs/quickstart.yaml", "--axis", "algo.name=grpo,rloo", "--set", "train.steps=2",
                   home=home)
    _assert_one_line_error(result, "--set")
    assert "hint: rlctl ablate configs/quickstart.yaml train.steps=2 --axis" in result.stderr


def test_overrides_follow_the_config_like_train(home):
    """A bad override is found before anything runs, with the same message `rlctl train` gives."""
    result = rlctl("ablate", "configs/quickstart.yaml", "algo.grup_size=4", "--axis", "algo.name=grpo,rloo",
                   home=home)
    _assert_one_line_error(result, "algo.grup_size", "algo.group_size")


def test_unknown_estimator_fails_before_anything_is_recorded(plugins, tmp_path):
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import PluginError
    from rlctl.lifecycle.ablate import plan, run_ablation
    from rlctl.registry.store import Registry

    p = plan(load_config(REPO / "configs" / "quickstart.yaml", TINY_OVERRIDES), ["algo.name=grpo,nosuch"], 1, None)
    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        with pytest.raises(PluginError, match="nosuch"):
            run_ablation(p, name="x", registry=reg, plugins=plugins, home=tmp_path)
        assert reg.list_runs() == []


@pytest.mark.slow
def test_ablate_matrix_equal_budget_report_and_resume(home):
    from rlctl.registry.ablations import AblationStore
    from rlctl.registry.store import Registry

    out = json.loads(rlctl(*ARGS, "--json", home=home, check=True, timeout=900).stdout)
    cells = {c["cell"]: c for c in out["cells"]}
    assert set(cells) == {"algo.name=grpo", "algo.name=rloo"} and out["baseline"] == "algo.name=grpo"
    assert out["missing"] == [] and out["status"] == "succeeded"
    batch_tokens = 4 * 4 * 6  # prompts x G x max_tokens: the most one step can generate
    tokens = [t for c in out["cells"] for t in c["tokens"]]
    assert len(tokens) == 4 and max(tokens) - min(tokens) <= batch_tokens
    assert out["budget_tokens"] == min(tokens)  # set by the baseline's first seed
    for cell in out["cells"]:
        gain = cell["gain_vs_warm_start"]
        assert len(cell["pass_at_1"]) == 2 and gain["ci_low"] <= gain["diff"] <= gain["ci_high"]
    rloo = cells["algo.name=rloo"]
    assert rloo["vs_baseline"]["num_seeds"] == 2 and len(rloo["vs_baseline_per_seed"]) == 2
    assert Path(out["plot"]).stat().st_size > 1000
    with Registry.open(f"sqlite:///{home / 'registry.db'}") as reg:
        store = AblationStore(reg)
        runs = store.runs(out["ablation_id"])
        assert len(runs) == 4 and {r.status for r in runs} == {"succeeded"}
        for r in runs:
            assert reg.get_run(r.run_id).status == "succeeded"
            assert any(e.details.get("ablation_id") == out["ablation_id"] for e in reg.evals(r.run_id))
        # as if the last run had been interrupted: the same command re-runs only that one
        last = runs[-1]
        store.set_run(out["ablation_id"], last.cell, last.seed, status="interrupted")
        store.update(out["ablation_id"], status="interrupted")
    again = rlctl(*ARGS, home=home, check=True, timeout=900)
    assert f"continuing ablation {out['ablation_id']}" in again.stderr
    assert again.stderr.count("done earlier, skipped") == 3
    assert "gain vs warm start" in again.stdout and "algo.name=rloo" in again.stdout
    with Registry.open(f"sqlite:///{home / 'registry.db'}") as reg:
        rerun = {(r.cell, r.seed): r for r in AblationStore(reg).runs(out["ablation_id"])}
        assert rerun[(last.cell, last.seed)].run_id != last.run_id
        assert len(reg.list_runs(limit=100)) == 5


@pytest.mark.slow  # two tiny runs
def test_ablate_at_equal_device_seconds_reports_what_each_run_spent(home):
    """--budget device-seconds without an amount: the baseline's first seed sets it (its RL seconds x its 2
    devices, learner + rollout engine); the other cell trains until its RL seconds x devices reach it. The
    table and the JSON carry each run's cost: RL seconds, device-seconds, tokens and grading seconds."""
    args = ["ablate", "configs/quickstart.yaml", *OVERRIDES, "train.steps=2", "--axis", "algo.name=grpo,rloo",
            "--seeds", "1", "--budget", "device-seconds"]
    out = json.loads(rlctl(*args, "--json", home=home, check=True, timeout=900).stdout)
    cells = {c["cell"]: c for c in out["cells"]}
    base, other = cells["algo.name=grpo"], cells["algo.name=rloo"]
    assert out["budget_kind"] == "device-seconds" and out["budget_tokens"] is None
    assert out["budget_seconds"] == pytest.approx(base["rl_s"][0] * 2)
    assert base["device_s"] == [pytest.approx(out["budget_seconds"])]
    assert other["device_s"][0] >= out["budget_seconds"]  # it stopped after the step that spent the budget
    for cell in out["cells"]:
        assert cell["grade_s"][0] > 0 and cell["tokens"][0] > 0
    again = rlctl(*args, home=home, check=True, timeout=900)  # every run done: the table alone
    text = " ".join(again.stdout.split())  # rich wraps long lines to the terminal's width
    assert "device-seconds per run" in text and "cost per run: mean (min-max) over seeds" in text
