"""``rlctl train`` with a sharded learner on 2 CPU ranks (FSDP2; DeepSpeed ZeRO-3): checkpoints, SIGKILL, resume, export.

One straight 5-step run (a sharded checkpoint every 2 steps) is the reference.
A second run is SIGKILLed during step 4 (after step index 3 is logged) and
resumed on the same 2 ranks: the final parameters must be bitwise equal. A
third, killed the same way, is resumed on 1 rank (the checkpoint is
resharded 2 -> 1): its final parameters must match to 1e-6. ``rlctl export
--hf`` of the straight run's last sharded checkpoint must equal its final
policy bitwise. The DeepSpeed case is skipped without the deepspeed extra.
"""

from __future__ import annotations

import importlib.util
import json
import signal

import pytest

from tests.integration import test_resume as r
from tests.integration.test_cli import rlctl

pytestmark = pytest.mark.slow

RUN = ("train.learner_options.world_size=2", "train.steps=5", "checkpoint.every_steps=2", "checkpoint.async_save=false")
LEARNERS = {
    "fsdp2": ("train.learner=fsdp2",),
    "deepspeed-zero3": ("train.learner=deepspeed", "train.learner_options.zero_stage=3"),
}


@pytest.fixture(scope="module")
def home(tmp_path_factory, _rlctl_home):
    """An RLCTL_HOME of this module's runs, sharing the session's warm-start cache."""
    path = tmp_path_factory.mktemp("sharded_home")
    if (_rlctl_home / "cache").exists():
        (path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return path


def _killed_during_step_4(home, run_dir, overrides):
    proc = r.spawn(home, run_dir, *overrides)
    try:
        r.wait_for_step(proc, run_dir, 3, timeout_s=600)  # steps 0-3 logged: the 5th step (index 4) is running
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert (run_dir / "checkpoints").is_dir()


@pytest.mark.parametrize("learner", sorted(LEARNERS))
def test_sigkill_in_step_4_then_resume_on_2_and_on_1_ranks(home, tmp_path, learner):
    if learner.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("the deepspeed extra is not installed")
    overrides = (*LEARNERS[learner], *RUN)
    straight = tmp_path / "straight"
    r.train(home, straight, *overrides)
    manifest = json.loads((straight / "checkpoints" / "step-000004" / "COMMITTED").read_text())
    assert sum(f["path"].startswith("shards/") for f in manifest["files"]) == 2  # one file per rank

    same = tmp_path / "same"
    _killed_during_step_4(home, same, overrides)
    out = json.loads(r.resume(home, same).stdout)
    assert out["run"]["status"] == "succeeded" and out["first_step"] in (2, 4)
    r.assert_same_params(straight, same)

    one = tmp_path / "one"
    _killed_during_step_4(home, one, overrides)
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
