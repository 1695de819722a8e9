"""Acceptance of eval.grader + train.stop_rules: a reward that pays for length, graded apart by `math`.

The training reward is the built-in ``length`` penalty with weight -1, so it
pays per response token (a reward hack by construction); ``eval.grader`` is
``math`` in its own process. The gap between the two on the same dev answers
grows, the ``eval-gap-growing`` live alert fires, and a ``reward_gap`` stop
rule ends the run ``stopped`` with its best dev checkpoint kept.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_cli import rlctl

HACK = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64", "model.warm_start.steps=400", "model.warm_start.batch_size=32",
    "model.warm_start.target_dev_accuracy=null", "task.options.num_train=2000", "task.options.num_dev=40",
    "task.options.num_hidden=40", "algo.prompts_per_step=8", "algo.group_size=4", "rollout.max_tokens=8",
    "eval.max_tokens=8", "train.seeds=1", "train.steps=24", "train.optim.lr=0.003",
    "eval.every_steps=2", "eval.every_num_prompts=20", "checkpoint.every_steps=4", "checkpoint.keep_last=1",
    "eval.num_prompts=20",
    "reward.components=[{name: length, weight: -1.0, options: {target_tokens: 0}}]", "eval.grader={name: math}",
    "train.stop_rules=[{rule: reward_gap, max: 0.8}]",
]


@pytest.mark.slow  # a warm start and up to 24 tiny steps (about 40 s on a loaded 2-core machine)
def test_a_length_hack_grows_the_gap_alerts_and_stops_the_run_keeping_the_best_dev_checkpoint(tmp_path):
    from rlctl.engine.checkpoint import read_manifest
    from rlctl.registry.store import Registry

    proc = rlctl("train", "configs/quickstart.yaml", *HACK, "--json", home=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(proc.stdout)["run"]
    assert run["status"] == "stopped"
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        gap = sorted((p.step, p.value) for p in reg.metrics(run["id"], ["eval_reward_gap"]))
        dev = {p.step: p.value for p in reg.metrics(run["id"], ["eval_dev_pass_at_1"])}
        events = reg.events(run["id"])
        checkpoints = reg.checkpoints(run["id"])
        final_eval = reg.evals(run["id"])[-1]
    assert len(gap) >= 2 and gap[-1][1] > gap[0][1] and gap[-1][1] > 0.8  # the gap grew past the bound
    evals = [e for e in events if e.kind == "dev_eval"]
    assert evals[0].data["eval_grader"] == "math" and evals[0].data["eval_grader_version"].startswith("math@")
    alerts = [e for e in events if e.kind == "alert" and e.data["trigger"] == "eval-gap-growing"]
    assert alerts, [e.message for e in events if e.kind == "alert"]
    stopped = [e for e in events if e.kind == "stopped"]
    assert len(stopped) == 1 and stopped[0].data["rule"] == "reward_gap"
    assert stopped[0].data["step"] == gap[-1][0] < 23  # it stopped at the eval that crossed the bound, early
    best = stopped[0].data["best_checkpoint"]
    assert best and Path(best).is_dir() and best in {c.path for c in checkpoints}
    assert read_manifest(best).metrics["eval_dev_pass_at_1"] == max(dev.values())
    apart = final_eval.details["eval_grader"]  # the end-of-run table: training reward vs eval score, per policy
    assert apart["final"]["eval_grader_version"].startswith("math@")
    assert apart["final"]["gap"] == apart["final"]["train_reward"] - apart["final"]["eval_score"] > 0
    show = rlctl("runs", "show", run["id"], home=tmp_path, check=True).stdout
    assert "stopped by" in show and "reward_gap" in show
    # pass@k of the same run is counted by the kept-apart grader too, and says which one
    passk = rlctl("eval", run["id"], "--k", "1,2", "--num-prompts", "5", home=tmp_path, check=True).stdout
    assert "graded by eval.grader math@" in " ".join(passk.split())  # the table's title, wrapped to the width
    table = reg_eval_details(tmp_path, run["id"])["pass_at_k"]
    assert table["grader"]["name"] == "math" and table["grader"]["version"].startswith("math@")
    assert set(table["final"]["pass_at_k"]) == {"1", "2"}


def reg_eval_details(home, run_id):
    from rlctl.registry.store import Registry

    with Registry.open(f"sqlite:///{home / 'registry.db'}") as reg:
        return reg.evals(run_id)[-1].details


@pytest.mark.slow  # a tiny training run
def test_a_bound_rule_stops_a_run_stopped_not_failed_with_its_final_policy(tmp_path, _rlctl_home):
    from tests.conftest import TINY_OVERRIDES

    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.steps=5", "eval.at_end=false",
                 "train.stop_rules=[{rule: entropy, max: 0.01, window: 2}]", "--json", home=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["run"]["status"] == "stopped"
    assert "stop rule train.stop_rules.0 (entropy) fired after step 2" in proc.stderr
    run_dir = Path(out["run"]["run_dir"])
    assert (run_dir / "policy" / "final" / "config.json").is_file()
