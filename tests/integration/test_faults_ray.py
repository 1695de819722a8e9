"""worker-crash with cluster.backend=ray: a rollout actor's process is SIGKILLed mid-run.

Recovery: the worker's in-flight prompts are released and claimed again, Ray
restarts the actor, and it loads the current weights before it serves again.
Proven by the run's registry events and counters and by the trajectory
ledger's audit (nothing lost, nothing trained twice). This test found a
deadlock: a producer waiting at the admission gate held the claim lock that
the dead worker's producer needed to give its prompts back.

Also: the hang watchdog names the learner when the driver's call into the
learner actor blocks while the rollout actors keep working.
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_faults import _events, _run_id, _train

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("ray", reason="needs ray: pip install -e '.[ray]'")


def test_a_killed_rollout_actor_is_restarted_and_its_prompts_regenerated(ray_cluster, _rlctl_home, tmp_path):
    from rlctl.engine.ledger import audit

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


def test_faults_armed_in_the_config_fire_inside_the_learner_rollout_and_reward_actors(ray_cluster, _rlctl_home,
                                                                                     tmp_path):
    """The run's faults reach the actors' processes: an OOM and a SIGKILL in the learner actor, a straggler in
    a rollout actor, grader errors in the reward actors. Each fires once per step across all processes, and
    each ends in its recovery: the OOM retried with a smaller micro-batch (its report comes back from the
    actor), the killed learner restarted and restored from the newest checkpoint, failed grader calls re-scored
    with a fresh grader (whole groups dropped past the retries), and the trajectory audit finds nothing lost or
    trained twice."""
    from rlctl.engine.ledger import audit

    steps = 5
    faults = [{"kind": "oom", "at_step": 1}, {"kind": "learner-crash", "at_step": 3},
              # which driver step a rollout call starts in races the learner (see the test above): two steps
              {"kind": "slow-rollout", "at_step": 1, "count": 2, "options": {"delay_s": 0.2}},
              {"kind": "verifier-error", "rate": 0.2}]
    result, reg, run_dir = _train(
        _rlctl_home, tmp_path, "ray-faults", "cluster.backend=ray", "cluster.rollout_num_cpus=0.5",
        "cluster.learner_num_cpus=0.5", "cluster.reward_num_cpus=0", "reward.workers=2", "mode=async",
        "staleness.max_staleness=1", f"train.steps={steps}", "checkpoint.every_steps=1",
        "algo.micro_batch_size=16", "staleness.take_timeout_s=300", "faults.inject=" + json.dumps(faults))
    assert result.run.status == "succeeded"
    fired: dict[str, list[int]] = {}
    for event in _events(reg, run_dir, "fault_injected"):
        fired.setdefault(event.data["kind"], []).append(event.data["step"])
    assert fired["oom"] == [1] and fired["learner-crash"] == [3], fired  # once, in the learner actor
    assert len(fired["slow-rollout"]) in (1, 2) and len(set(fired["slow-rollout"])) == len(fired["slow-rollout"])
    [oom] = _events(reg, run_dir, "oom_recovered")  # reported inside the learner actor, recorded by the driver
    assert (oom.data["micro_batch_from"], oom.data["micro_batch_to"]) == (16, 8)
    [restart] = _events(reg, run_dir, "learner_restarted")
    assert restart.data["restarts"] == 1
    m = {(p.step, p.name): p.value for p in reg.metrics(_run_id(run_dir))}
    # the graders failed inside the reward actors; the producer re-scored those samples with a fresh grader
    # (faults.verifier_retries, as the sync loop does), and a group still failing is dropped whole, never scored 0
    total = {name: sum(v for (_, n), v in m.items() if n == name)
             for name in ("verifier_retries", "verifier_recovered", "reward_error_count", "groups_dropped")}
    assert total["verifier_recovered"] > 0 and total["verifier_retries"] >= total["verifier_recovered"], total
    assert total["reward_error_count"] == 4 * total["groups_dropped"], total
    assert sorted({s for s, name in m if name == "reward_mean"}) == list(range(steps))
    assert m[(steps - 1, "learner_restarts")] == 1 and m[(steps - 1, "micro_batch_size")] == 8
    report = audit(run_dir / "queue")
    assert report.lost == () and report.double_counted == 0


def test_faults_injected_into_the_running_run_fire_inside_the_live_learner_actor_and_the_one_ray_restarts(
        ray_cluster, _rlctl_home, tmp_path):
    """`rlctl inject --run RUN` on a running Ray run: after step 1 two OOMs (steps 2 and 4) are dropped into
    the run's inbox; the guard arms them at that step end, the placement adds them to the fault broker's plan
    and re-arms the live actors, so the first fires in the learner actor that was already running. The learner
    actor is SIGKILLed at step 3 (a config fault): the process that trains step 4 is a restart that never got
    that re-arm, it arms the broker's plan as Ray starts it, and the second OOM fires there. Each fires once
    across the driver and every actor; the recovery reports come back from the actors (micro-batch halved)."""
    from rlctl.config.load import load_config
    from rlctl.config.models import FaultSpec
    from rlctl.engine.ledger import audit
    from rlctl.hooks.manager import load_plugins
    from rlctl.incidents.inject import inject_running
    from rlctl.lifecycle.run import TrainCallbacks
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    from tests.integration.test_faults import BASE

    steps, run_dir, injected = 5, tmp_path / "ray-live", []

    def after_step(step, metrics):
        if step == 1 and not injected:  # once: a learner rewind may run step 1's end again
            injected.extend(inject_running(run_dir, FaultSpec.model_validate({"kind": "oom", "at_step": at}))
                            for at in (2, 4))

    cfg = load_config(None, [
        *BASE, "cluster.backend=ray", "cluster.rollout_num_cpus=0.5", "cluster.learner_num_cpus=0.5", "mode=async",
        "staleness.max_staleness=1", f"train.steps={steps}", "checkpoint.every_steps=1", "algo.micro_batch_size=16",
        "staleness.take_timeout_s=300", "faults.inject=" + json.dumps([{"kind": "learner-crash", "at_step": 3}])])
    reg = Registry.open(f"sqlite:///{tmp_path / 'registry.db'}")
    result = train(cfg, registry=reg, plugins=load_plugins(), home=_rlctl_home, run_dir=run_dir,
                   callbacks=TrainCallbacks(step=after_step))
    assert result.run.status == "succeeded"
    assert len(injected) == 2 and all(p.with_suffix(".armed").is_file() for p in injected)  # taken from the inbox
    armed = [(e.data["kind"], e.data["at_step"], e.data["fault_index"]) for e in _events(reg, run_dir, "fault_armed")]
    assert armed == [("oom", 2, 1), ("oom", 4, 2)], armed
    fired = [(e.data["kind"], e.data["step"], e.data["fault_index"]) for e in _events(reg, run_dir, "fault_injected")]
    assert sorted(fired) == [("learner-crash", 3, 0), ("oom", 2, 1), ("oom", 4, 2)], fired  # each once
    [restart] = _events(reg, run_dir, "learner_restarted")
    assert restart.data["restarts"] == 1
    ooms = _events(reg, run_dir, "oom_recovered")  # reported inside the learner actors, recorded by the driver
    assert [(e.data["micro_batch_from"], e.data["micro_batch_to"]) for e in ooms] == [(16, 8), (8, 4)]
    m = {(p.step, p.name): p.value for p in reg.metrics(_run_id(run_dir))}
    assert [m[(s, "micro_batch_size")] for s in range(steps)] == [16, 16, 8, 8, 4]
    report = audit(run_dir / "queue")
    assert report.lost == () and report.double_counted == 0


def test_watchdog_names_the_learner_actor_call_that_hangs(ray_cluster, _rlctl_home, tmp_path, monkeypatch):
    """On Ray the session's learner is a RayLearner swapped in after the guard started; the driver's call into
    it blocks (patched here) while the rollout actors keep generating: the hang names the learner, not a step
    end or a rollout. The timeout leaves room for the actors to come up (the first weight export waits for it)."""
    import time

    from rlctl.placement.ray_placement import RayLearner
    from rlctl.incidents.recovery import HangError

    def stuck(self, batch):
        time.sleep(300)  # interrupted by the watchdog's HangError

    monkeypatch.setattr(RayLearner, "train_step_with_logprobs", stuck)
    err, reg, run_dir = _train(
        _rlctl_home, tmp_path, "ray-hang", "cluster.backend=ray", "cluster.rollout_num_cpus=0.5",
        "cluster.learner_num_cpus=0.5", "mode=async", "faults.watchdog_timeout_s=30", expect_error=True)
    assert isinstance(err, HangError)
    [hang] = _events(reg, run_dir, "hang")
    assert (hang.data["role"], hang.data["phase"], hang.data["thread"]) == ("learner", "train", "MainThread")
