"""``rlctl train --supervise`` restarts an FSDP2 run (2 CPU ranks, gloo) after a ``learner-crash`` fault.

The fault SIGKILLs the training process (rank 0) in step 3; its follower rank
notices rank 0 is gone and exits, the supervisor restarts the run from the
newest committed sharded checkpoint (step 2; one is written every 2 steps) on
a fresh 2-rank group, and the run finishes its 5 steps. In deterministic mode
the final parameters equal a straight, uninterrupted run's bitwise: the
sharded checkpoint holds the fp32 shards and AdamW state exactly, and the
restarted run replays steps 2-4 from the same rollout seeds and mini-batch
generator state.
"""

from __future__ import annotations

import json

import pytest

from tests.integration import test_resume as r
from tests.integration.test_cli import rlctl
from tests.integration.test_sharded_resume import LEARNERS, RUN as SHARDED

pytestmark = pytest.mark.slow

RUN = (*LEARNERS["fsdp2"], *SHARDED, "checkpoint.keep_last=3")  # keep step 2's checkpoint (the one resumed from) to inspect it


@pytest.fixture()
def home(tmp_path, _rlctl_home):
    """An RLCTL_HOME of this test's runs, sharing the session's warm-start cache."""
    (_rlctl_home / "cache").mkdir(exist_ok=True)
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    return tmp_path / "home"


def test_supervisor_resumes_a_crashed_fsdp2_run_from_its_sharded_checkpoint(home, tmp_path):
    straight = tmp_path / "straight"
    r.train(home, straight, *RUN)

    crashed = tmp_path / "crashed"
    proc = rlctl("train", "configs/quickstart.yaml", *r.DET, *RUN,
                 "faults.inject=[{kind: learner-crash, at_step: 3}]", "--run-dir", str(crashed), "--supervise",
                 home=home, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_id = r.run_id(crashed)
    with r.registry(home) as reg:
        events = reg.events(run_id)
        kinds = [e.kind for e in events]
        restart = next(e for e in events if e.kind == "supervisor_restart")
        resumed = next(e for e in events if e.kind == "resumed")
        steps = sorted(p.step for p in reg.metrics(run_id, ["reward_mean"]))
        assert reg.get_run(run_id).status == "succeeded"
    assert kinds.index("fault_injected") < kinds.index("supervisor_restart") < kinds.index("resumed")
    assert restart.data["cause"] == "killed by SIGKILL" and restart.data["restart"] == 1
    assert resumed.data["step"] == 2  # the newest sharded checkpoint committed before the crash
    manifest = json.loads((crashed / "checkpoints" / "step-000002" / "COMMITTED").read_text())
    assert sum(f["path"].startswith("shards/") for f in manifest["files"]) == 2  # it was sharded: one file per rank
    assert steps == list(range(5))  # every step recorded once, none lost or duplicated
    r.assert_same_params(straight, crashed)
