"""Faults that kill the process: learner crash under ``rlctl train --supervise``, bad checkpoint, ``rlctl inject``.

Real child processes (SIGKILL mid-step, a checkpoint truncated after commit);
the supervisor restarts from the newest committed checkpoint, falling back past
a damaged one, without a human. Proven by registry events and the metric
history (every step recorded exactly once).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import rlctl

pytestmark = pytest.mark.slow

BASE = [*TINY_OVERRIDES, "train.deterministic=true", "eval.at_end=false", "train.steps=6",
        "checkpoint.every_steps=2", "checkpoint.async_save=false", "checkpoint.keep_last=3"]


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path) -> Path:
    (_rlctl_home / "cache").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return tmp_path / "home"


def _registry(home: Path):
    from rlctl.registry.store import Registry

    return Registry.open(f"sqlite:///{home / 'registry.db'}")


def _kinds(reg, run_id: str) -> list[str]:
    return [e.kind for e in reg.events(run_id)]


def _run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "run.json").read_text())["run_id"]


def test_learner_crash_is_restarted_by_the_supervisor(home, tmp_path):
    run_dir = tmp_path / "crash"
    proc = rlctl("train", "configs/quickstart.yaml", *BASE, "faults.inject=[{kind: learner-crash, at_step: 3}]",
                 "--run-dir", str(run_dir), "--supervise", home=home)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id = _run_id(run_dir)
    with _registry(home) as reg:
        kinds = _kinds(reg, run_id)
        restart = next(e for e in reg.events(run_id) if e.kind == "supervisor_restart")
        resumed = next(e for e in reg.events(run_id) if e.kind == "resumed")
        steps = sorted(p.step for p in reg.metrics(run_id, ["reward_mean"]))
        assert reg.get_run(run_id).status == "succeeded"
    assert kinds.index("fault_injected") < kinds.index("supervisor_restart") < kinds.index("resumed")
    assert restart.data["cause"] == "killed by SIGKILL" and restart.data["restart"] == 1
    assert resumed.data["step"] == 2  # the newest committed checkpoint before the crash
    assert steps == list(range(6))
    lines = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(lines)) == lines == list(range(6))  # no step duplicated in the sink either


def test_bad_checkpoint_falls_back_to_the_previous_committed_one(home, tmp_path):
    run_dir = tmp_path / "bad"
    faults = "faults.inject=[{kind: bad-checkpoint, at_step: 4}, {kind: learner-crash, at_step: 5}]"
    proc = rlctl("train", "configs/quickstart.yaml", *BASE, faults, "--run-dir", str(run_dir), "--supervise",
                 home=home)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id = _run_id(run_dir)
    with _registry(home) as reg:
        fallback = next(e for e in reg.events(run_id) if e.kind == "checkpoint_fallback")
        steps = sorted(p.step for p in reg.metrics(run_id, ["reward_mean"]))
    assert fallback.data["step"] == 2 and fallback.data["num_skipped"] == 1
    assert "step-000004" in fallback.data["skipped"][0]
    assert (run_dir / "checkpoints" / "corrupt").is_dir()
    assert steps == list(range(6))


def test_supervisor_gives_up_after_max_restarts(home, tmp_path):
    run_dir = tmp_path / "storm"
    faults = ("faults.inject=[{kind: learner-crash, at_step: 3}, {kind: learner-crash, at_step: 3}, "
              "{kind: learner-crash, at_step: 3}]")
    proc = rlctl("train", "configs/quickstart.yaml", *BASE, faults, "faults.max_restarts=1", "--run-dir",
                 str(run_dir), "--supervise", home=home)
    assert proc.returncode == 137
    with _registry(home) as reg:
        assert "supervisor_gave_up" in _kinds(reg, _run_id(run_dir))


def test_inject_cli_on_a_stopped_run_resumes_it_with_the_fault(home, tmp_path):
    run_dir = tmp_path / "later"
    rlctl("train", "configs/quickstart.yaml", *BASE, "train.steps=2", "--run-dir", str(run_dir), home=home,
          check=True)
    run_id = _run_id(run_dir)
    proc = rlctl("inject", "--fault", "oom", "--run", run_id, "--at-step", "3", "train.steps=4", "--json",
                 home=home, check=True)
    assert json.loads(proc.stdout)["run"]["status"] == "succeeded"
    with _registry(home) as reg:
        [oom] = [e for e in reg.events(run_id) if e.kind == "oom_recovered"]
    assert oom.data["step"] == 3


def test_inject_refuses_an_unknown_kind_in_one_line(home):
    proc = rlctl("inject", "--fault", "nann", "configs/quickstart.yaml", home=home)
    assert proc.returncode == 1 and "did you mean 'nan'" in proc.stderr and "Traceback" not in proc.stderr
