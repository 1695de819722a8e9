"""bench/decode_bound.py at tiny settings: it runs, splits a profiled local run into GEMM / attention / other,
and its bound (generate time over GEMM + attention time) is a positive ratio next to the measured one."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.integration.test_cli import REPO


def test_decode_bound_bench_runs_at_tiny_settings(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", RLCTL_HOME=str(tmp_path / "home"))
    args = ["--shapes", "quickstart", "--rows", "8", "--new-tokens", "8", "--repeats", "1",
            "--markdown", str(tmp_path / "table.md")]
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "decode_bound.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| shape | local tok/s | generate tok/s | local / generate |")
    cells = [line.strip("| ").split(" | ") for line in table.splitlines() if line.startswith("| quickstart")][0]
    profiled, gemm, other, bound = float(cells[4]), float(cells[5]), float(cells[8]), float(cells[9])
    attention = float(cells[7].split(" ")[0])
    assert gemm > 0 and attention > 0 and bound > 0
    assert abs(profiled - gemm - attention - other) < 2e-4  # the split adds up to the profiled run
    assert float(cells[10].split(" ")[0].replace(",", "")) > 0  # generate on a bf16 copy ran
    assert "python bench/decode_bound.py --shapes quickstart" in table


def test_decode_bound_refuses_an_unknown_shape():
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "decode_bound.py"), "--shapes", "7b"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown shape: 7b" in proc.stderr and "Traceback" not in proc.stderr
