"""``rlctl train`` with the DeepSpeed learner on 2 CPU ranks: the run succeeds and ``--json`` stays valid JSON
(DeepSpeed prints its op builds to stdout; the plugin sends them to stderr). Checkpoints are refused at start with
one error line. Skipped without the deepspeed extra."""

from __future__ import annotations

import json

import pytest

from tests.integration import test_resume as r

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow

DS = ("train.learner=deepspeed", "train.learner_options.world_size=2", "train.steps=2")


def test_deepspeed_run_succeeds_with_clean_json_and_refuses_checkpoints(tmp_path, _rlctl_home):
    home = tmp_path / "home"
    home.mkdir()
    if (_rlctl_home / "cache").exists():
        (home / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    out = r.train(home, tmp_path / "run", *DS, "checkpoint.every_steps=0")
    report = json.loads(out.stdout)
    assert report["run"]["status"] == "succeeded" and report["last_metrics"]["policy_version"] == 2.0
    assert (tmp_path / "run" / "policy" / "final" / "model.safetensors").is_file()
    refused = r.train(home, tmp_path / "refused", *DS, "checkpoint.every_steps=1", check=False)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    assert "error: learner backend 'deepspeed' cannot be checkpointed" in refused.stderr
