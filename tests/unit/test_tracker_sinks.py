"""TensorBoard, MLflow and W&B (offline) sinks: what each writes is read back with the tool's own reader.

Each test skips only when its extra is not installed (CI installs all three).
Metric names pass through unchanged (``reward/math`` included); a resume never
leaves a step twice in the tracker.
"""

from __future__ import annotations

import importlib.util
import json
import math

import pytest


RUN_ID = "20261201-120000-abc123"
NAMES = ("reward_mean", "reward/math", "kl_ref", "grad_norm", "T_r", "verifier_latency_p95_s")


def _needs(module: str, extra: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} not installed: pip install -e '.[{extra}]'")


def _metrics(step: int, attempt: int = 0) -> dict[str, float]:
    return {name: step + i / 10 + attempt * 100 for i, name in enumerate(NAMES)}


def _run_files(run_dir) -> None:
    """What the run directory holds when sinks are built (RunDir.write_run_files)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps({"run": {"name": "arith"}}))
    (run_dir / "run.json").write_text(json.dumps({"run_id": RUN_ID, "config_hash": "cfg123", "code_version": "code456",
                                                  "dataset_version": "data789", "tokenizer_hash": "tok", "seed": 7}))


def _attempts(plugins, name, tmp_path, options=None, first=range(0, 5), second=range(3, 7)):
    """A run that logs ``first``, is resumed from a checkpoint after step 2, and logs ``second``."""
    for attempt, steps in enumerate((first, second)):
        _run_files(tmp_path)
        sink = plugins.build("metric_sink", name, options or {}, "train.metric_sinks.0.options", run_dir=tmp_path,
                             run_id=RUN_ID)
        for step in steps:
            sink.write(step, _metrics(step, attempt))
        sink.close()


@_needs("tensorboard", "tensorboard")
def test_tensorboard_event_files_round_trip_and_resume_purges(plugins, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _attempts(plugins, "tensorboard", tmp_path)
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == set(NAMES)
    for i, name in enumerate(NAMES):
        points = [(e.step, e.value) for e in acc.Scalars(name)]
        # steps 0-2 from the first attempt; 3-6 only from the resumed one (TensorBoard's purge step)
        want = [(s, s + i / 10) for s in range(3)] + [(s, s + i / 10 + 100) for s in range(3, 7)]
        assert [p[0] for p in points] == [w[0] for w in want], name
        assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(points, want)), name


@pytest.mark.slow
@_needs("mlflow", "mlflow")
def test_mlflow_local_store_round_trips_params_and_metrics_without_duplicates(plugins, tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _attempts(plugins, "mlflow", tmp_path, {"experiment": "arith-test"})
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("arith-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlctl_run_id"] == RUN_ID
    assert {k: run.data.params[k] for k in ("config_hash", "seed", "dataset_version", "code_version")} == {
        "config_hash": "cfg123", "seed": "7", "dataset_version": "data789", "code_version": "code456"}
    assert set(run.data.metrics) == set(NAMES)
    for i, name in enumerate(NAMES):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, name))
        # MLflow cannot delete points: steps 3-4 keep the first attempt's values, 5-6 come from the resume
        want = [(s, s + i / 10) for s in range(5)] + [(s, s + i / 10 + 100) for s in (5, 6)]
        assert [h[0] for h in history] == [w[0] for w in want], name
        assert all(math.isclose(a, b, rel_tol=1e-9) for (_, a), (_, b) in zip(history, want)), name


@pytest.mark.slow
@_needs("wandb", "wandb")
def test_wandb_offline_transaction_log_round_trips_without_network(plugins, tmp_path, monkeypatch):
    from rlctl_sinks.wandb_sink import offline_logs, history, read_records

    monkeypatch.setenv("WANDB_MODE", "online")  # the sink must force offline whatever the environment says
    monkeypatch.setenv("WANDB_API_KEY", "")
    _attempts(plugins, "wandb", tmp_path, {"project": "arith-test"})
    import os

    assert os.environ["WANDB_MODE"] == "online"  # restored after close
    first, second = offline_logs(tmp_path, RUN_ID)
    seen: dict[int, dict[str, float]] = {}
    for log in (first, second):
        for step, values in history(log).items():
            assert step not in seen, f"step {step} logged twice"
            seen[step] = values
    assert sorted(seen) == list(range(7))
    for step, values in seen.items():
        attempt = 0 if step < 5 else 1  # steps up to 4 were in the first attempt's log already
        assert set(values) == set(NAMES)
        assert all(math.isclose(values[n], _metrics(step, attempt)[n], rel_tol=1e-9) for n in NAMES), step
    run = next(r["run"] for r in read_records(first) if r.get("type") == "run")
    assert run["run_id"] == RUN_ID and run["project"] == "arith-test"
    config = run["config"]["update"]
    assert config["config_hash"] == "cfg123" and config["seed"] == 7 and config["dataset_version"] == "data789"
    exits = [r["exit"] for r in read_records(second) if r.get("type") == "exit"]
    assert exits and exits[-1].get("exit_code", 0) == 0


def test_tracker_options_are_typed_and_a_missing_extra_names_the_fix(plugins, tmp_path, monkeypatch):
    from rlctl.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown config key train.metric_sinks.0.options.experimnt"):
        plugins.build("metric_sink", "mlflow", {"experimnt": "x"}, "train.metric_sinks.0.options",
                      run_dir=tmp_path, run_id=RUN_ID)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'rlctl\[tensorboard\]'"):
        plugins.build("metric_sink", "tensorboard", {}, "train.metric_sinks.0.options", run_dir=tmp_path,
                      run_id=RUN_ID)


def test_config_takes_a_name_or_a_name_with_options(tiny_config):
    from rlctl.config.models import MetricSinkSpec, sink_specs

    assert sink_specs(tiny_config.train.metric_sinks) == [("jsonl", {})]
    train = tiny_config.train.model_validate(
        {"metric_sinks": ["jsonl", {"name": "mlflow", "options": {"experiment": "e"}}]})
    assert train.metric_sinks[1] == MetricSinkSpec(name="mlflow", options={"experiment": "e"})
    assert sink_specs(train.metric_sinks) == [("jsonl", {}), ("mlflow", {"experiment": "e"})]


@pytest.mark.slow
@_needs("tensorboard", "tensorboard")
@_needs("mlflow", "mlflow")
@_needs("wandb", "wandb")
def test_rlctl_train_sends_the_registry_metric_names_to_every_tracker(tmp_path, _rlctl_home, monkeypatch):
    """Through the CLI: the trackers hold exactly the metric names and steps the registry holds, the periodic dev
    eval's at the eval's step (eval.every_steps=2: step 1)."""
    import json
    from pathlib import Path

    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlctl_sinks.wandb_sink import history, offline_logs
    from tests.conftest import TINY_OVERRIDES
    from tests.integration.test_cli import rlctl

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if (_rlctl_home / "cache").exists():  # share the warm-start cache of the session
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    sinks = "train.metric_sinks=[jsonl, tensorboard, {name: mlflow, options: {experiment: e2e}}, wandb]"
    out = json.loads(rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "eval.at_end=false", sinks,
                           "eval.every_steps=2", "eval.every_num_prompts=4", "--json", home=tmp_path,
                           check=True).stdout)
    run_dir, run_id = Path(out["run"]["run_dir"]), out["run"]["id"]
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    names = set(lines[0]["metrics"])
    dev = {"eval_dev_pass_at_1", "eval_dev_seconds"}
    assert "reward_mean" in names and [line["step"] for line in lines] == [0, 1, 2]
    assert set(lines[1]["metrics"]) == names | dev and not dev & names

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == names | dev
    assert [e.step for e in acc.Scalars("reward_mean")] == [0, 1, 2]
    assert [e.step for e in acc.Scalars("eval_dev_pass_at_1")] == [1]

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("e2e").experiment_id])
    assert set(run.data.metrics) == names | dev and run.data.params["config_hash"] == out["run"]["config_hash"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "reward_mean")] == [0, 1, 2]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval_dev_pass_at_1")] == [1]

    (log,) = offline_logs(run_dir, run_id)
    steps = history(log)
    assert sorted(steps) == [0, 1, 2] and set(steps[0]) == names and set(steps[1]) == names | dev
