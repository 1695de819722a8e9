"""`rlctl train` scored by a reward model in another process (`rlctl serve reward`), and that server killed mid-run.

The run mixes the reward model (weight 0.5) with the math verifier; every
step records both components. Killing the reward-model server (SIGKILL) must
not turn into zero rewards: each sample is retried on the servers with
back-off, the engine re-scores failed samples with a fresh grader
(``faults.verifier_retries``), and then the run stops with one clear error
naming the reward model. A zero-filling grader would instead keep the run
going (and record reward/reward_model == 0.0 steps); neither happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO

pytestmark = pytest.mark.slow


def start_reward_server(model_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "serve", "reward", "--model", str(model_dir),
                             "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)
    line = proc.stdout.readline()
    assert "listening on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc, line.split("listening on ", 1)[1].split()[0]


def steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_train_against_a_reward_server_then_kill_it_flags_and_stops_never_zero(tiny_reward_model_dir, tmp_path,
                                                                               _rlctl_home):
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCTL_HOME=str(_rlctl_home))
    env.pop("RLCTL_DEBUG", None)
    server, url = start_reward_server(tiny_reward_model_dir, env)
    run_dir = tmp_path / "run"
    components = (f"reward.components=[{{name: reward_model, weight: 0.5, options: {{servers: [{url}], retries: 2, "
                  "backoff_s: 0.05, timeout_s: 5}}, {name: math, weight: 1.0}]")
    train = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "train", "configs/quickstart.yaml",
                              *TINY_OVERRIDES, components, "train.steps=400", "eval.at_end=false",
                              "faults.verifier_retries=2", "--run-dir", str(run_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 240
        while len(steps(run_dir)) < 3:
            assert train.poll() is None, f"train exited early: {train.stderr.read()}"
            assert time.monotonic() < deadline, "no 3 steps in 240 s"
            time.sleep(0.05)
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        _, stderr = train.communicate(timeout=240)
    finally:
        for proc in (server, train):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    recorded = steps(run_dir)
    assert train.returncode == 1, stderr
    assert len(recorded) < 400  # it stopped; a zero-filling grader would have trained on
    for step in recorded:  # every trained step was scored by both components, the reward model's never 0
        m = step["metrics"]
        assert m["reward/reward_model"] != 0.0 and "reward/math" in m and m["reward_error_count"] == 0, m
    lines = [line for line in stderr.splitlines() if line.strip() and not line.startswith("GRPO step")]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-2000:]
    assert "after 2 retries" in errors[0] and "grader_error:reward_model" in errors[0] and "none scored 0" in errors[0]

    from rlctl.registry.store import Registry

    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    with Registry.open(f"sqlite:///{_rlctl_home / 'registry.db'}") as reg:
        assert reg.get_run(run_id).status == "failed"
