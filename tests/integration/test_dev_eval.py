"""``eval.every_steps``: a dev pass@1 curve in the registry during training; a failing eval never stops it."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import rlctl


@pytest.mark.slow  # a tiny training run first
def test_dev_curve_is_recorded_during_training(tmp_path, _rlctl_home):
    from rlctl.registry.store import Registry

    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.steps=2", "eval.at_end=false",
                 "eval.every_steps=1", "eval.every_num_prompts=5", "--json", home=tmp_path, check=True)
    run = json.loads(proc.stdout)["run"]
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        points = reg.metrics(run["id"], ["eval_dev_pass_at_1", "eval_dev_seconds"])
        events = [e for e in reg.events(run["id"]) if e.kind == "dev_eval"]
    curve = sorted((p.step, p.value) for p in points if p.name == "eval_dev_pass_at_1")
    assert [step for step, _ in curve] == [0, 1] and all(0.0 <= v <= 1.0 for _, v in curve)
    assert len(events) == 2 and "on 5 prompts" in events[0].message


class _Registry:
    def __init__(self) -> None:
        self.events, self.metrics = [], []

    def log_metrics(self, run_id, step, metrics):
        self.metrics.append((step, dict(metrics)))

    def add_event(self, run_id, kind, message, data=None):
        self.events.append((kind, message))


def _roles(tiny_config, generate):
    config = tiny_config.model_copy(update={"eval": tiny_config.eval.model_copy(update={"every_steps": 2})})
    task = SimpleNamespace(dev=(), version="v")
    return SimpleNamespace(config=config, task=task, rollout=SimpleNamespace(generate=generate),
                           tokenizer=lambda text: {"input_ids": [1]})


def test_a_failing_dev_eval_is_reported_and_training_goes_on(tiny_config, plugins):
    from rlctl.lifecycle.periodic_eval import DevEval

    def broken(requests):
        raise RuntimeError("rollout engine fell over")

    registry, warnings = _Registry(), []
    dev = DevEval(_roles(tiny_config, broken), plugins, registry, "run-1", warnings.append)
    assert dev(0) is None and not registry.events  # not due: steps 2, 4, ...
    assert dev(1) is None
    assert registry.events[0][0] == "dev_eval_failed" and "rollout engine fell over" in registry.events[0][1]
    assert "training goes on" in warnings[0] and registry.metrics == []


def test_dev_eval_is_skipped_with_a_warning_outside_sync_mode(tiny_config, plugins):
    from rlctl.lifecycle.periodic_eval import DevEval

    roles = _roles(tiny_config, lambda requests: [])
    roles.config = roles.config.model_copy(update={"mode": "async"})
    warnings = []
    dev = DevEval(roles, plugins, _Registry(), "run-1", warnings.append)
    assert not dev.due(1) and "mode: sync only" in warnings[0]


def test_the_live_display_keeps_the_latest_dev_score():
    import io

    from rich.console import Console

    from rlctl.cli._display import TrainDisplay

    out = io.StringIO()
    display = TrainDisplay(3, Console(file=out, width=200), plain=True)
    display.step(0, {"reward_mean": 0.5})
    display.step(1, {"reward_mean": 0.5, "eval_dev_pass_at_1": 0.25})
    display.step(2, {"reward_mean": 0.625})
    lines = out.getvalue().splitlines()
    assert "dev" not in lines[0] and lines[1].count("dev 0.25") == 1 and "dev 0.25" in lines[2]


def test_the_live_display_keeps_the_latest_train_vs_eval_gap():
    import io

    from rich.console import Console

    from rlctl.cli._display import TrainDisplay

    out = io.StringIO()
    display = TrainDisplay(2, Console(file=out, width=200), plain=True)
    display.step(0, {"reward_mean": 0.5, "eval_dev_pass_at_1": 0.25, "eval_reward_gap": 0.5})
    display.step(1, {"reward_mean": 0.9})
    lines = out.getvalue().splitlines()
    assert "gap +0.5" in lines[0] and "gap +0.5" in lines[1]


def test_the_dev_eval_runs_before_the_save_and_a_new_best_asks_for_one(tiny_config, plugins, monkeypatch):
    """prepare (the checkpointer's hook) puts the dev score into the manifest's metrics; a new best forces a save
    when the best checkpoint is kept by the dev score (stop rules set that); take hands the same result on."""
    from rlctl.config.models import StopRule
    from rlctl.lifecycle.periodic_eval import DevEval, best_checkpoint_metric

    roles = _roles(tiny_config, lambda requests: [])
    roles.config = roles.config.model_copy(update={"train": roles.config.train.model_copy(
        update={"stop_rules": [StopRule(rule="dev_drop")]})})
    assert best_checkpoint_metric(roles.config) == "eval_dev_pass_at_1"
    dev = DevEval(roles, plugins, _Registry(), "run-1", lambda message: None)
    scores = iter([0.5, 0.25, 0.75])
    monkeypatch.setattr(dev, "_evaluate", lambda: {"eval_dev_pass_at_1": next(scores), "eval_dev_seconds": 0.1})
    assert dev.prepare(1, {"loss": 1.0}) == ({"loss": 1.0}, False)  # step 0: not due
    metrics, force = dev.prepare(2, {"loss": 1.0})
    assert force and metrics["eval_dev_pass_at_1"] == 0.5 and dev.take(1)["eval_dev_pass_at_1"] == 0.5
    assert dev.prepare(4, {})[1] is False  # 0.25: not a new best
    assert dev.prepare(6, {})[1] is True  # 0.75


def test_the_eval_grader_is_built_in_its_own_process(tiny_config):
    import os
    from functools import partial

    from rlctl.config.models import RewardComponentConfig
    from rlctl.engine.reward_pool import ProcessRewardPool
    from rlctl.lifecycle.grading import eval_grader_from_config

    config = tiny_config.model_copy(update={"eval": tiny_config.eval.model_copy(
        update={"grader": RewardComponentConfig(name="math")})})
    with ProcessRewardPool(partial(eval_grader_from_config, config), 1) as pool:
        assert pool.version.startswith("math@")
        assert all(w.proc.pid != os.getpid() for w in pool._workers)
