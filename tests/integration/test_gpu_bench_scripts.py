"""The scripts tests/gpu/run.sh calls, run on CPU at tiny scale (the GPU run differs only in ``--device cuda``
and the model shape): bench/fsdp_ledger.py (fsdp2 GRPO steps, step time, ledger vs measured per role) and
bench/trl_step_time.py (rlctl vs TRL's GRPOTrainer, needs the bench extra)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.integration.test_cli import REPO

pytestmark = pytest.mark.slow


def _bench(script: str, *args: str, tmp_path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCTL_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--device", "cpu", "--shape", "tiny",
                           "--models", str(tmp_path / "models"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_fsdp_ledger_script_on_cpu(tmp_path):
    out = _bench("fsdp_ledger.py", "--vocab", "char", "--steps", "2", "--prompts", "2", "--group", "2",
                 "--max-tokens", "4", tmp_path=tmp_path)
    assert "fsdp2 (world_size 1) GRPO on CPU" in out and "step time: median" in out
    ratios = {m[0]: float(m[1]) for m in re.findall(r"^(rollout|train|sync) .* (\d+\.\d+)$", out, re.M)}
    assert set(ratios) == {"rollout", "train", "sync"}, out
    assert all(0.5 <= r <= 2.0 for r in ratios.values()), ratios  # the ledger is within 2x of the meter per role


def test_trl_step_time_script_on_cpu(tmp_path):
    pytest.importorskip("trl", reason="the bench extra: pip install -e '.[bench]'")
    out = _bench("trl_step_time.py", "--steps", "3", "--warmup", "1", "--prompts", "2", "--group", "2",
                 "--max-tokens", "4", tmp_path=tmp_path)
    row = next(line for line in out.splitlines() if line.startswith("tiny: qwen2"))
    rl, trl, ratio = (float(x) for x in row.split()[-4:-1])
    # the times are printed to 3 decimals and the ratio to 2: the ratio lies within what that rounding allows
    half = 0.0005
    assert rl > 0 and trl > 0
    assert (trl - half) / (rl + half) - 0.005 <= ratio <= (trl + half) / max(rl - half, 1e-9) + 0.005, row


def test_make_model_script_writes_a_loadable_model_and_task(tmp_path):
    """bench/make_model.py builds the model the TRL comparison loads (it once broke on a changed sft() result)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCTL_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "make_model.py"), str(tmp_path / "m"),
                           "--task-out", str(tmp_path / "task"), "--sft-steps", "2"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SFT 2 steps: loss" in proc.stdout and (tmp_path / "m" / "config.json").exists()
    assert any((tmp_path / "task").iterdir())
