"""``rlctl train`` with the DeepSpeed learner on 2 CPU ranks: the run succeeds and ``--json`` stays valid JSON
(DeepSpeed prints its op builds to stdout; the plugin sends them to stderr), and the last step's sharded checkpoint
is committed. Resume is tests/integration/test_sharded_resume.py. Skipped without the deepspeed extra."""

from __future__ import annotations

import json

import pytest

from tests.integration import test_resume as r

pytest.importorskip("deepspeed", reason="needs deepspeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")
pytestmark = pytest.mark.slow

DS = ("train.learner=deepspeed", "train.learner_options.world_size=2", "train.steps=2")


def test_deepspeed_run_succeeds_with_clean_json_and_a_sharded_checkpoint(tmp_path, _rlctl_home):
    home = tmp_path / "home"
    home.mkdir()
    if (_rlctl_home / "cache").exists():
        (home / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    out = r.train(home, tmp_path / "run", *DS, "checkpoint.every_steps=1")
    report = json.loads(out.stdout)
    assert report["run"]["status"] == "succeeded" and report["last_metrics"]["policy_version"] == 2.0
    assert (tmp_path / "run" / "policy" / "final" / "model.safetensors").is_file()
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-000002" / "COMMITTED").read_text())
    assert sum(f["path"].startswith("shards/") for f in manifest["files"]) == 2  # one file per rank
