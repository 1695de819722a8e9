"""One real `rlctl train` on a small code-flavoured task whose completions run in the sandbox.

The task: Python expressions (``max(4,9)=``, ``len('abc')+2=``, ...) with their
values as answers; the warm-started tiny policy completes them, and the
``code`` reward runs each completion as ``answer = <completion>`` inside
bubblewrap against two tests: ``answer == <value>`` and ``type(answer) is
int``. A completion earns the second test's half only by being executed (the
jail evaluates it), so a positive reward/code shows the policy's output ran.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import rlctl

pytestmark = pytest.mark.slow


def expressions() -> list[dict[str, str]]:
    rows = []
    for a in range(2, 9):
        for b in range(1, 8):
            for expr in (f"max({a},{b})", f"abs({b}-{a})", f"len('{'x' * a}')+{b}", f"{a}*{b}%7"):
                rows.append({"prompt": f"{expr}=", "answer": str(eval(expr))})  # noqa: S307 - our own literals
    return rows


def test_train_on_a_code_task_runs_the_policys_completions_in_the_sandbox(needs_sandbox, tmp_path, _rlctl_home):
    rows = expressions()
    files = {}
    for split, part in (("train", rows[:150]), ("dev", rows[150:170]), ("hidden", rows[170:])):
        files[split] = tmp_path / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(r) + "\n" for r in part))
    task = "task.options={" + ", ".join(f"{k}: {v}" for k, v in files.items()) + "}"
    code = ('reward.components=[{name: code, options: {program: "answer = {code}", '
            'tests: "assert answer == {reference}\\nassert type(answer) is int", wall_s: 5, score: fraction}}]')
    run_dir = tmp_path / "run"
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "task.source=jsonl", task, code,
                 "model.warm_start.steps=150", "train.steps=3", "eval.at_end=false", "--run-dir", str(run_dir),
                 home=_rlctl_home, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["metrics"] for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 3
    assert all(m["reward_error_count"] == 0 and "reward/code" in m for m in steps), steps  # no sandbox errors
    assert max(m["reward/code"] for m in steps) > 0  # completions were executed in the jail (and some ran clean)
