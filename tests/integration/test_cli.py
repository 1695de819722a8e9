"""The CLI as a user meets it: fast help, one clear line for bad input, JSON output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES

REPO = Path(__file__).resolve().parents[2]


def rlctl(*args: str, home: Path, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, RLCTL_HOME=str(home), OMP_NUM_THREADS="1")
    env.pop("RLCTL_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "rlctl.cli.app", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"rlctl {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_help_does_not_import_torch():
    code = ("import sys\nfrom rlctl.cli.app import main\n"
            "rc = main(['--help'])\nassert rc == 0\nprint('heavy:', sorted(m for m in ('torch', 'ray', 'transformers', "
            "'uvicorn', 'starlette', 'prometheus_client') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stdout


def _assert_one_line_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]
    assert any(line.startswith("hint: ") for line in proc.stderr.splitlines())


def _no_successful_run(home: Path) -> None:
    proc = rlctl("runs", "list", "--json", "--status", "succeeded", home=home, check=True)
    assert json.loads(proc.stdout)["runs"] == []


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path) -> Path:
    # share the warm-start cache with the session home so the tiny model is built once
    cache = tmp_path / "cache"
    cache.symlink_to(_rlctl_home / "cache", target_is_directory=True) if (_rlctl_home / "cache").exists() else None
    return tmp_path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_malformed_yaml(home, tmp_path):
    cfg = _write(tmp_path / "bad.yaml", "train:\n  steps: [1, 2\n")
    _assert_one_line_error(rlctl("train", str(cfg), home=home), "malformed YAML", "line")
    _no_successful_run(home)


def test_unknown_key_names_path_and_closest(home, tmp_path):
    cfg = _write(tmp_path / "c.yaml", "algo:\n  grup_size: 4\n")
    _assert_one_line_error(rlctl("train", str(cfg), home=home), "algo.grup_size", "did you mean algo.group_size")


def test_wrong_type(home, tmp_path):
    cfg = _write(tmp_path / "c.yaml", "train:\n  steps: many\n")
    _assert_one_line_error(rlctl("train", str(cfg), home=home), "train.steps", "'many'")


def test_group_size_below_two(home, tmp_path):
    cfg = _write(tmp_path / "c.yaml", "{}\n")
    _assert_one_line_error(rlctl("train", str(cfg), "algo.group_size=1", home=home), "group_size", ">= 2")


def test_missing_model_path(home, tmp_path):
    cfg = _write(tmp_path / "c.yaml", f"model:\n  path: {tmp_path / 'nope'}\n")
    _assert_one_line_error(rlctl("train", str(cfg), *TINY_OVERRIDES, home=home), "model directory not found")
    _no_successful_run(home)


def test_plugin_not_installed(home, tmp_path):
    cfg = _write(tmp_path / "c.yaml", "rollout:\n  backend: sglangg\n")
    _assert_one_line_error(rlctl("train", str(cfg), *TINY_OVERRIDES, home=home), "no rollout backend named 'sglangg'")
    _no_successful_run(home)


def test_dataset_row_without_answer(home, tmp_path):
    good = '{"prompt": "1+1=", "answer": "2"}\n'
    train = _write(tmp_path / "train.jsonl", good + '{"prompt": "2+2="}\n')
    dev = _write(tmp_path / "dev.jsonl", good)
    hidden = _write(tmp_path / "hidden.jsonl", '{"prompt": "3+3=", "answer": "6"}\n')
    cfg = _write(tmp_path / "c.yaml", f"task:\n  source: jsonl\n  options:\n    train: {train}\n    dev: {dev}\n"
                                      f"    hidden: {hidden}\n")
    _assert_one_line_error(rlctl("train", str(cfg), *TINY_OVERRIDES[:5], home=home), f"{train}:2", "'answer'")
    _no_successful_run(home)


def test_debug_flag_shows_traceback(home, tmp_path):
    cfg = _write(tmp_path / "c.yaml", "algo:\n  grup_size: 4\n")
    proc = rlctl("--debug", "train", str(cfg), home=home)
    assert proc.returncode == 1 and "Traceback" in proc.stderr


def test_usage_error_exits_2(home):
    assert rlctl("train", home=home).returncode == 2


def test_unknown_run_is_one_line(home):
    _assert_one_line_error(rlctl("runs", "show", "no-such-run", home=home), "no-such-run")


def test_plugins_lists_builtins_as_json(home):
    data = json.loads(rlctl("plugins", "--json", home=home, check=True).stdout)
    names = {p["name"]: p for p in data["plugins"]}
    assert {"tasks", "rewards", "local_engine", "torch_learner", "sinks"} <= set(names)
    assert names["rewards"]["registers"]["reward function"] == ["code", "digit_credit", "format", "length", "math", "reward_model"]
    assert names["rewards"]["registers"]["tool"] == ["python"]
    assert names["envs"]["registers"] == {"environment": ["tools"], "tool": ["calculator"]}
    assert names["local_engine"]["version"] and names["local_engine"]["builtin"] is True
