"""Output without a terminal: `rlctl train ... > log.txt 2>&1` writes complete plain lines.

A live progress bar redrawn into a file is cut at the console width
(``warm start (SF… loss 0.334  E…``); with no TTY the display prints one full
line every ``train.log_every`` steps and one per 5% of the warm start instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import TINY_OVERRIDES

REPO = Path(__file__).resolve().parents[2]


def test_train_into_a_file_prints_full_lines_every_log_every_steps(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    overrides = [o for o in TINY_OVERRIDES if not o.startswith("train.steps")]
    args = ["train", "configs/quickstart.yaml", *overrides, "train.steps=5", "train.log_every=2",
            "eval.at_end=false", "checkpoint.every_steps=0"]
    env = dict(os.environ, RLCTL_HOME=str(tmp_path / "home"), OMP_NUM_THREADS="1", COLUMNS="80")
    env.pop("RLCTL_DEBUG", None)
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "rlctl.cli.app", *args], stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, env=env, cwd=REPO, timeout=300)
    text = log.read_text()
    assert proc.returncode == 0, text
    assert "…" not in text and "..." not in text, text
    assert "\r" not in text and "\x1b[" not in text, "no redraws or escape codes in a file"
    steps = [line for line in text.splitlines() if line.startswith("GRPO step ")]
    assert [line.split()[2] for line in steps] == ["1/5", "3/5", "5/5"], text  # steps 0, 2, 4 (the last)
    for line in steps:
        for label in ("reward", "entropy", "len", "clip", "tok/s", "elapsed", "ETA"):
            assert f" {label} " in line, (label, line)
        assert re.search(r"ETA \d+:\d\d:\d\d$", line), line
    warm = [line for line in text.splitlines() if line.startswith("warm start (SFT) ")]
    assert warm and warm[-1].startswith("warm start (SFT) 30/30  loss "), text
    assert len(warm) <= 30 and all(re.search(r"ETA \d+:\d\d:\d\d$", line) for line in warm)
    started = [line for line in text.splitlines() if " -> " in line and line.startswith("run ")]
    assert len(started) == 1 and len(started[0]) > 80, text  # longer than the console: still one line
    assert re.fullmatch(rf"run (\S+) -> {re.escape(str(tmp_path / 'home' / 'runs'))}/\1", started[0]), started[0]
