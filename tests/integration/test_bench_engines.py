"""bench/engines.py at tiny settings (local engine and model.generate; the vLLM column needs .venv-vllm and a
server start, so the full run is the documented command): it runs, every engine makes exactly the workload's
tokens (the script checks and fails otherwise), and the table and its markdown carry the ratios and the
command that reproduces them."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.test_cli import REPO


def test_engines_bench_runs_at_tiny_settings(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCTL_HOME=str(tmp_path / "home"))
    args = ["--shapes", "quickstart", "--engines", "local,local-mkl,generate", "--batches", "1,3", "--new-tokens", "4",
            "--tail-rows", "4", "--tail-max", "12", "--repeats", "1", "--steps", "2", "--step-tokens", "4",
            "--markdown", str(tmp_path / "table.md")]
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "engines.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| shape | workload | local | local-mkl | local-mkl / local | generate | generate / local |")
    rows = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| quickstart")]
    assert [r[1] for r in rows][:2] == ["batch 1 x 4", "batch 3 x 4"]
    assert rows[2][1].startswith("long tail 4 rows") and rows[3][1].startswith("GRPO step")
    assert all(float(r[4]) > 0 and float(r[6]) > 0 for r in rows[:3])  # ratios to local on every generation row
    assert "python bench/engines.py --shapes quickstart" in table and "Load average" in table
