"""``rlctl train`` with the DeepSpeed ZeRO-3 learner on 2 CPU ranks: sharded checkpoints, SIGKILL, resume, export.

The same scenario as the FSDP2 learner's (tests/integration/test_fsdp_resume.py,
whose helpers it reuses): a straight 5-step run (a sharded checkpoint every 2
steps) is the reference; a run SIGKILLed during step 4 and resumed on the same
2 ranks must end bitwise equal; one killed the same way and resumed on 1 rank
(the checkpoint resharded 2 -> 1) must match to 1e-6; ``rlctl export --hf`` of
the straight run's last checkpoint equals its final policy bitwise. Skipped
without the deepspeed extra.
"""

from __future__ import annotations

import json
import signal

import pytest

from tests.integration import test_resume as r
from tests.integration.test_cli import rlctl
from tests.integration import test_fsdp_resume

pytest.importorskip("deepspeed")
pytestmark = pytest.mark.slow
home = test_fsdp_resume.home  # the module's RLCTL_HOME fixture (sharing the session's warm-start cache)

DS = ("train.learner=deepspeed", "train.learner_options.zero_stage=3", "train.learner_options.world_size=2",
      "train.steps=5", "checkpoint.every_steps=2", "checkpoint.async_save=false")


def _killed_during_step_4(home, run_dir):
    proc = r.spawn(home, run_dir, *DS)
    try:
        r.wait_for_step(proc, run_dir, 3, timeout_s=600)  # steps 0-3 logged: the 5th step (index 4) is running
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert (run_dir / "checkpoints").is_dir()


def test_zero3_sigkill_in_step_4_then_resume_on_2_and_on_1_ranks(home, tmp_path):
    straight = tmp_path / "straight"
    r.train(home, straight, *DS)
    manifest = json.loads((straight / "checkpoints" / "step-000004" / "COMMITTED").read_text())
    assert sum(f["path"].startswith("shards/") for f in manifest["files"]) == 2  # one file per rank

    same = tmp_path / "same"
    _killed_during_step_4(home, same)
    out = json.loads(r.resume(home, same).stdout)
    assert out["run"]["status"] == "succeeded" and out["first_step"] in (2, 4)
    r.assert_same_params(straight, same)

    one = tmp_path / "one"
    _killed_during_step_4(home, one)
    out = json.loads(r.resume(home, one, "train.learner_options.world_size=1").stdout)
    assert out["run"]["status"] == "succeeded"
    a, b = r.params(straight), r.params(one)
    assert set(a) == set(b) and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6

    hf = tmp_path / "hf"
    rlctl("export", str(straight / "checkpoints" / "step-000005"), "--hf", str(hf), "--json", home=home, check=True)
    from safetensors.torch import load_file

    exported = load_file(hf / "model.safetensors")
    final = r.params(straight)
    assert set(exported) <= set(final) and all((exported[k] == final[k]).all() for k in exported)
