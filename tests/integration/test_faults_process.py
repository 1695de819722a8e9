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
                 "--run-dir", str(run_dir), "--supervise", home=home, timeout=900)
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
                 home=home, timeout=900)
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
                 str(run_dir), "--supervise", home=home, timeout=900)
    assert proc.returncode == 137
    run_id = _run_id(run_dir)
    with _registry(home) as reg:
        assert "supervisor_gave_up" in _kinds(reg, run_id)
    # the reason and the runbook to open, as one error line and one hint line
    assert f"error: run {run_id} cannot recover: training killed by SIGKILL again after 1 restart(s)" in proc.stderr
    assert "hint:" in proc.stderr and "rlctl runbook show oom" in proc.stderr and "Traceback" not in proc.stderr


def test_an_unrecoverable_nan_run_exits_non_zero_with_the_reason_and_runbook(home, tmp_path):
    run_dir = tmp_path / "nan"
    proc = rlctl("train", "configs/quickstart.yaml", *BASE, "checkpoint.every_steps=0", "faults.nan_rollback_after=2",
                 "faults.inject=[{kind: nan, at_step: 1, count: 3}]", "--run-dir", str(run_dir), home=home,
                 timeout=900)
    assert proc.returncode == 1
    assert "error: 2 NaN/Inf steps in a row and no committed checkpoint" in proc.stderr
    assert "hint:" in proc.stderr and "rlctl runbook show reward-drop-or-nan" in proc.stderr
    assert "Traceback" not in proc.stderr
    with _registry(home) as reg:
        assert reg.get_run(_run_id(run_dir)).status == "failed"


def test_inject_cli_on_a_stopped_run_resumes_it_with_the_fault(home, tmp_path):
    run_dir = tmp_path / "later"
    rlctl("train", "configs/quickstart.yaml", *BASE, "train.steps=2", "--run-dir", str(run_dir), home=home,
          check=True)
    run_id = _run_id(run_dir)
    proc = rlctl("inject", "--fault", "oom", "--run", run_id, "--at-step", "3", "train.steps=4", "--json",
                 home=home, check=True, timeout=900)
    assert json.loads(proc.stdout)["run"]["status"] == "succeeded"
    with _registry(home) as reg:
        [oom] = [e for e in reg.events(run_id) if e.kind == "oom_recovered"]
    assert oom.data["step"] == 3


def test_inject_refuses_an_unknown_kind_in_one_line(home):
    proc = rlctl("inject", "--fault", "nann", "configs/quickstart.yaml", home=home, timeout=900)
    assert proc.returncode == 1 and "did you mean 'nan'" in proc.stderr and "Traceback" not in proc.stderr


def test_inject_into_a_running_run_is_armed_at_its_next_step(home, tmp_path):
    import os
    import subprocess
    import sys
    import time

    from tests.integration.test_cli import REPO

    run_dir = tmp_path / "live"
    env = dict(os.environ, RLCTL_HOME=str(home), OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "train", "configs/quickstart.yaml", *BASE,
                              "faults.inject=[{kind: slow-rollout, at_step: 1, options: {delay_s: 20}}]",
                              "--run-dir", str(run_dir)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "run.json").is_file() or not _slow_fired(home, run_dir):
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read() if child.poll() else ""
            time.sleep(0.5)
        out = rlctl("inject", "--fault", "oom", "--run", _run_id(run_dir), "--at-step", "3", home=home, check=True,
                    timeout=900)
        assert "armed at its next step" in out.stdout
        assert child.wait(timeout=900) == 0, child.stderr.read()[-2000:]
    finally:
        if child.poll() is None:
            child.kill()
    with _registry(home) as reg:
        kinds = _kinds(reg, _run_id(run_dir))
        [oom] = [e for e in reg.events(_run_id(run_dir)) if e.kind == "oom_recovered"]
    assert kinds.index("fault_armed") < kinds.index("oom_recovered") and oom.data["step"] == 3


def _slow_fired(home: Path, run_dir: Path) -> bool:
    with _registry(home) as reg:
        return any(e.kind == "fault_injected" for e in reg.events(_run_id(run_dir)))


def test_runbook_check_and_diagnose_report_on_a_recorded_run(home, tmp_path):
    run_dir = tmp_path / "vt"
    rlctl("train", "configs/quickstart.yaml", *BASE, "train.steps=3", "checkpoint.every_steps=0",
          "faults.inject=[{kind: verifier-timeout, rate: 0.3}]", "--run-dir", str(run_dir), home=home, check=True,
          timeout=900)
    run_id = _run_id(run_dir)
    check = rlctl("runbook", "check", "verifier-timeouts", "--run", run_id, "--json", home=home, timeout=900)
    assert check.returncode == 3, check.stderr  # triggered
    report = json.loads(check.stdout)
    assert report["triggered"] and {f["trigger"] for f in report["firings"]} >= {"grader-first-try-failures"}
    assert report["checks"] and all(c["exit_code"] == 0 for c in report["checks"]), report["checks"]
    clear = rlctl("runbook", "check", "oom", "--run", run_id, "--no-checks", home=home, timeout=900)
    assert clear.returncode == 0 and "clear" in clear.stdout
    page = tmp_path / "report.html"
    diag = json.loads(rlctl("diagnose", run_id, "--json", "--report", str(page), home=home, check=True,
                            timeout=900).stdout)
    assert diag["findings"][0]["branch"] == "grader" and diag["findings"][0]["runbook"] == "verifier-timeouts"
    html = page.read_text()
    assert "data:image/png;base64," in html and "verifier-timeouts" in html and "<script" not in html
