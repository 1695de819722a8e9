"""A run whose process died (SIGKILL) is not left 'running' forever in the registry."""

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
from tests.integration.test_cli import REPO, rlctl

pytestmark = pytest.mark.slow


def test_sigkilled_run_is_reconciled_to_failed_or_interrupted(tmp_path: Path, _rlctl_home: Path):
    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    env = dict(os.environ, RLCTL_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "rlctl.cli.app", "train", "configs/quickstart.yaml",
                             *TINY_OVERRIDES, "train.steps=400", "checkpoint.every_steps=1000", "eval.at_end=false"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            runs = json.loads(rlctl("runs", "list", "--json", home=tmp_path, check=True).stdout)["runs"]
            if runs and runs[0]["status"] == "running":
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.5)
        else:
            pytest.fail("the run never showed up as running")
        running = runs[0]["id"]
        # while the process lives, reconcile must leave it alone
        assert json.loads(rlctl("runs", "show", running, "--json", home=tmp_path, check=True).stdout)["run"][
            "status"] == "running"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    shown = json.loads(rlctl("runs", "show", running, "--json", home=tmp_path, check=True).stdout)
    assert shown["run"]["status"] == "failed"
    assert any(e["kind"] == "reconciled" for e in shown["events"])
