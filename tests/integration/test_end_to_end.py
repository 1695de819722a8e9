"""End to end through the CLI: a tiny GRPO run, its registry rows, eval, and a third-party plugin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO, rlctl

pytestmark = pytest.mark.slow


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path) -> Path:
    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return tmp_path


def test_train_records_run_metrics_policy_and_eval(home, tmp_path):
    from safetensors.torch import load_file

    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.optim.lr=1e-3", "--json",
                 home=home, check=True)
    out = json.loads(proc.stdout)
    run = out["run"]
    assert run["status"] == "succeeded"
    for key in ("config_hash", "code_version", "dataset_version", "tokenizer_hash"):
        assert run[key], key
    assert run["seed"] == 0
    assert out["eval"]["num_prompts"] == 20 and out["eval"]["split"] == "hidden"

    shown = json.loads(rlctl("runs", "show", run["id"], "--json", home=home, check=True).stdout)
    metrics = shown["last_metrics"]
    for name in ("reward_mean", "entropy", "response_length_mean", "clip_fraction", "grad_norm",
                 "generated_tokens_per_s", "logprob_mismatch_max", "T_r", "T_l", "T_s", "esr"):
        assert name in metrics, name
    assert metrics["logprob_mismatch_max"]["value"] <= 1e-4
    assert {m["step"] for m in metrics.values()} == {2}
    assert shown["evals"] and shown["evals"][0]["run_id"] == run["id"]

    run_dir = Path(run["run_dir"])
    from rlctl.engine.checkpoint import verify

    manifest = verify(run_dir / "checkpoints" / "step-000003")  # the last step is always checkpointed
    assert manifest.step == 3 and manifest.run_id == run["id"]
    assert [c["step"] for c in shown["checkpoints"]] == [3]
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    start = load_file(Path(json.loads((run_dir / "run.json").read_text())["initial_policy"]) / "model.safetensors")
    final = load_file(run_dir / "policy" / "final" / "model.safetensors")
    assert any(not (start[k] == final[k]).all() for k in start), "training did not change the parameters"

    again = json.loads(rlctl("eval", run["id"], "--json", "--num-prompts", "10", home=home, check=True).stdout)
    assert again["eval"]["num_prompts"] == 10


def test_third_party_plugin_installed_from_a_directory_is_used_in_a_run(home, tmp_path):
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(REPO / "tests" / "fixtures" / "plugin_pkg")],
                         capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr
    import os

    os.environ["PYTHONPATH"] = f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    try:
        listed = json.loads(rlctl("plugins", "--json", home=home, check=True).stdout)
        ours = next(p for p in listed["plugins"] if p["name"] == "example_reward")
        assert ours["builtin"] is False and ours["version"] == "0.0.1"
        assert ours["registers"] == {"reward function": ["length_is"]}
        proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "eval.at_end=false", "--json",
                     "reward.components=[{name: length_is, weight: 1.0, options: {target: 2}}]",
                     home=home, check=True)
        run = json.loads(proc.stdout)["run"]
        assert "length_is" in run["config"]["reward"]["components"][0]["name"]
        shown = json.loads(rlctl("runs", "show", run["id"], "--json", home=home, check=True).stdout)
        assert "reward/length_is" in shown["last_metrics"]
    finally:
        os.environ["PYTHONPATH"] = os.environ["PYTHONPATH"].split(os.pathsep, 1)[1]


def test_runs_compare_shows_config_diff_and_metrics(home):
    first = json.loads(rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "eval.at_end=false", "--json",
                             home=home, check=True).stdout)["run"]["id"]
    second = json.loads(rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "eval.at_end=false",
                              "train.optim.lr=1e-3", "--json", home=home, check=True).stdout)["run"]["id"]
    out = json.loads(rlctl("runs", "compare", first, second, "--json", home=home, check=True).stdout)
    assert out["runs"] == [first, second]
    assert {"key": "train.optim.lr", "a": 2e-5, "b": 1e-3} in out["config_diff"]  # the quickstart lr
    assert out["provenance"]["config_hash"]["a"] != out["provenance"]["config_hash"]["b"]
    assert "reward_mean" in out["last_metrics"]
    table = rlctl("runs", "compare", first, second, home=home, check=True).stdout
    assert "train.optim.lr" in table
