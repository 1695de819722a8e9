"""``eval.every_steps``: a dev pass@1 curve in the registry during training; a failing eval never stops it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import rlctl


@pytest.mark.slow  # a tiny training run first
@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_dev_curve_is_recorded_during_training(tmp_path, _rlctl_home, mode):
    """In the plain loop and in the overlapped driver: the dev curve in the registry and in metrics.jsonl at the
    eval's steps (log_every would skip step 1), and a PNG of it from `rlctl runs plot`."""
    from rlctl.registry.store import Registry

    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, f"mode={mode}", "train.steps=2",
                 "train.log_every=5", "eval.at_end=false", "eval.every_steps=1", "eval.every_num_prompts=5",
                 "--json", home=tmp_path, check=True)
    run = json.loads(proc.stdout)["run"]
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        points = reg.metrics(run["id"], ["eval_dev_pass_at_1", "eval_dev_seconds"])
        events = [e for e in reg.events(run["id"]) if e.kind == "dev_eval"]
    curve = sorted((p.step, p.value) for p in points if p.name == "eval_dev_pass_at_1")
    assert [step for step, _ in curve] == [0, 1] and all(0.0 <= v <= 1.0 for _, v in curve)
    assert len(events) == 2 and "on 5 prompts" in events[0].message
    lines = [json.loads(line) for line in (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [(line["step"], line["metrics"]["eval_dev_pass_at_1"]) for line in lines] == curve
    from rlctl.engine.samples import read_samples  # the trained samples of the same steps, in every mode

    samples = list(read_samples(run["run_dir"]))
    assert [step for step, _ in samples] == [0, 1] and all(len(ts) == 8 and ts[0].reward is not None
                                                           for _, ts in samples)
    png = tmp_path / "curves.png"
    rlctl("runs", "plot", run["id"], "-o", str(png), home=tmp_path, check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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


def test_dev_eval_runs_in_every_mode(tiny_config, plugins):
    from rlctl.lifecycle.periodic_eval import DevEval

    roles = _roles(tiny_config, lambda requests: [])
    roles.config = roles.config.model_copy(update={"mode": "async"})
    warnings = []
    dev = DevEval(roles, plugins, _Registry(), "run-1", warnings.append)
    assert dev.enabled and dev.due(1) and not dev.due(0) and not warnings


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


def test_a_new_best_dev_score_asks_for_a_save(tiny_config, plugins):
    """prepare (the checkpointer's hook) reads the dev score the step end merged into the step's metrics; a new
    best forces a save when the best checkpoint is kept by the dev score (stop rules set that)."""
    from rlctl.config.models import StopRule
    from rlctl.lifecycle.periodic_eval import DevEval, best_checkpoint_metric

    roles = _roles(tiny_config, lambda requests: [])
    roles.config = roles.config.model_copy(update={"train": roles.config.train.model_copy(
        update={"stop_rules": [StopRule(rule="dev_drop")]})})
    assert best_checkpoint_metric(roles.config) == "eval_dev_pass_at_1"
    dev = DevEval(roles, plugins, _Registry(), "run-1", lambda message: None)
    assert dev.prepare(1, {"loss": 1.0}) == ({"loss": 1.0}, False)  # no eval at this step
    assert dev.prepare(2, {"loss": 1.0, "eval_dev_pass_at_1": 0.5})[1] is True
    assert dev.prepare(4, {"eval_dev_pass_at_1": 0.25})[1] is False  # not a new best
    assert dev.prepare(6, {"eval_dev_pass_at_1": 0.75})[1] is True


def test_the_step_end_merges_the_eval_into_the_step_and_every_sink_gets_it(tiny_config):
    """StepEnd (every mode's step end) runs the eval first: the sinks get its metrics at that step even when
    log_every would skip the step, and the observer sees them in the same dict."""
    from rlctl.engine.heartbeat import NO_HEARTBEAT
    from rlctl.engine.loop import StepEnd
    from rlctl.engine.spec import LoopSpec
    from rlctl_sinks.jsonl import JsonlSink

    config = tiny_config.model_copy(update={"train": tiny_config.train.model_copy(
        update={"steps": 10, "log_every": 5})})
    written, seen = [], []

    class Sink:
        def write(self, step, metrics):
            written.append((step, dict(metrics)))

        def close(self):
            pass

    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        jsonl = JsonlSink(tmp)
        end = StepEnd(LoopSpec.from_config(config), [Sink(), jsonl], lambda step, m: seen.append((step, dict(m))),
                      None, NO_HEARTBEAT, evaluate=lambda step: {"eval_dev_pass_at_1": 0.5} if step == 2 else None)
        for step in range(4):
            metrics = {"generated_tokens_total": 1.0, "reward_mean": 0.1}
            end.log(step, metrics)
            end.observe(step, metrics)
        jsonl.close()
        lines = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in written] == [0, 2]  # step 0 by log_every, step 2 because the eval ran
    assert written[1][1]["eval_dev_pass_at_1"] == 0.5 and "eval_dev_pass_at_1" not in written[0][1]
    assert [line["step"] for line in lines] == [0, 2] and lines[1]["metrics"]["eval_dev_pass_at_1"] == 0.5
    assert seen[2][1]["eval_dev_pass_at_1"] == 0.5


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
