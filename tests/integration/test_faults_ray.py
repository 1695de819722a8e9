"""worker-crash with cluster.backend=ray: a rollout actor's process is SIGKILLed mid-run.

Recovery: the worker's in-flight prompts are released and claimed again, Ray
restarts the actor, and it loads the current weights before it serves again.
Proven by the run's registry events and counters and by the trajectory
ledger's audit (nothing lost, nothing trained twice). This test found a
deadlock: a producer waiting at the admission gate held the claim lock that
the dead worker's producer needed to give its prompts back.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_faults import _events, _run_id, _train

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("ray")


def test_a_killed_rollout_actor_is_restarted_and_its_prompts_regenerated(ray_cluster, _rlctl_home, tmp_path):
    from rlctl.engine.async_loop import audit

    steps = 5
    result, reg, run_dir = _train(
        _rlctl_home, tmp_path, "ray", "cluster.backend=ray", "cluster.rollout_num_cpus=0.5",
        "cluster.learner_num_cpus=0.5", "mode=sync", f"train.steps={steps}", "staleness.take_timeout_s=300",
        # A two-step window: which driver step a rollout call happens in is a race with the learner (a call for
        # step 2 may start while the driver still counts step 1), so "exactly at step 2" could miss entirely.
        "faults.inject=" + json.dumps([{"kind": "worker-crash", "at_step": 2, "count": 2}]))
    assert result.run.status == "succeeded"
    fired = _events(reg, run_dir, "fault_injected")
    assert 1 <= len(fired) <= 2, fired
    assert all(f.data["worker"].startswith("ray-") and isinstance(f.data["pid"], int) for f in fired)
    lost = _events(reg, run_dir, "rollout_worker_lost")
    assert sum(e.data["failures"] for e in lost) == len(fired) and lost[-1].data["requeued_prompts"] >= 1
    assert "worker-crash" in {e.data["runbook"] for e in _events(reg, run_dir, "alert")}
    m = {(p.step, p.name): p.value for p in reg.metrics(_run_id(run_dir))}
    assert sorted({s for s, name in m if name == "reward_mean"}) == list(range(steps))
    assert m[(steps - 1, "rollout_worker_failures")] == len(fired)
    report = audit(run_dir / "queue")
    assert report.lost == () and report.double_counted == 0
