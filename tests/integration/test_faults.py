"""Each injected fault ends in its documented recovery, proven by registry events and counters.

In-process tiny runs (deterministic CPU mode) through ``rlctl.lifecycle.train.train``:
OOM (classified, micro-batch halved, same final parameters as a fault-free
run within float tolerance), verifier timeouts (retried with a fresh grader,
whole groups dropped and counted, never scored 0), NaN (skipped without a
parameter change; K in a row roll back to the last committed checkpoint with a
lower LR and a canary step), and the hang watchdog (role and phase reported
with a stack dump, the run stops instead of hanging; in an overlapped run too,
where the role is the one the driver waits on). Process-killing faults
(learner crash under --supervise, bad checkpoint) are in test_faults_process.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES

BASE = [*TINY_OVERRIDES, "train.deterministic=true", "eval.at_end=false", "train.metric_sinks=[]",
        "checkpoint.every_steps=0", "train.optim.lr=1e-3"]


def _train(home: Path, tmp: Path, name: str, *overrides: str, expect_error: bool = False):
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    cfg = load_config(None, [*BASE, *overrides])
    registry = Registry.open(f"sqlite:///{tmp / 'registry.db'}")
    run_dir = tmp / name
    try:
        result = train(cfg, registry=registry, plugins=load_plugins(), home=home, run_dir=run_dir)
    except Exception as err:
        if not expect_error:
            raise
        result = err
    return result, registry, run_dir


def _run_id(run_dir: Path) -> str:
    import json

    return json.loads((run_dir / "run.json").read_text())["run_id"]


def _events(registry, run_dir: Path, kind: str):
    return [e for e in registry.events(_run_id(run_dir)) if e.kind == kind]


def _params(run_dir: Path):
    from safetensors.torch import load_file

    return load_file(run_dir / "policy" / "final" / "model.safetensors")


def test_oom_is_classified_micro_batch_halved_and_math_unchanged(_rlctl_home, tmp_path):
    base, _, base_dir = _train(_rlctl_home, tmp_path, "base", "algo.micro_batch_size=16")
    hit, reg, hit_dir = _train(_rlctl_home, tmp_path, "oom", "algo.micro_batch_size=16",
                               "faults.inject=[{kind: oom, at_step: 1}]")
    [event] = _events(reg, hit_dir, "oom_recovered")
    assert event.data["classification"] in ("activations", "parameters", "optimizer", "gradients")
    assert (event.data["micro_batch_from"], event.data["micro_batch_to"], event.data["step"]) == (16, 8, 1)
    assert len(_events(reg, hit_dir, "fault_injected")) == 1
    metrics = {(p.step, p.name): p.value for p in reg.metrics(_run_id(hit_dir), ["oom_recoveries", "micro_batch_size"])}
    assert metrics[(0, "micro_batch_size")] == 16 and metrics[(2, "micro_batch_size")] == 8
    assert metrics[(2, "oom_recoveries")] == 1
    a, b = _params(base_dir), _params(hit_dir)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst < 1e-5, f"the retried step changed the math: max |diff| {worst}"  # summation order only


def test_oom_at_micro_batch_one_stops_the_run_with_the_runbook(_rlctl_home, tmp_path):
    from rlctl.contracts.errors import RoleError

    err, reg, run_dir = _train(_rlctl_home, tmp_path, "oom1", "algo.micro_batch_size=1",
                               "faults.inject=[{kind: oom, at_step: 0, options: {max_rows: 0}}]", expect_error=True)
    assert isinstance(err, RoleError) and "runbook show oom" in str(err)
    assert reg.get_run(_run_id(run_dir)).status == "failed"


def test_verifier_timeouts_are_retried_then_whole_groups_dropped_and_counted(_rlctl_home, tmp_path):
    result, reg, run_dir = _train(_rlctl_home, tmp_path, "vt", "faults.verifier_retries=1", "train.steps=3",
                                  "faults.inject=[{kind: verifier-timeout, rate: 0.3}]")
    run_id = _run_id(run_dir)
    assert result.run.status == "succeeded"
    retries = _events(reg, run_dir, "verifier_retry")
    dropped = _events(reg, run_dir, "groups_dropped")
    assert retries and sum(e.data["recovered"] for e in retries) > 0
    m = {(p.step, p.name): p.value for p in reg.metrics(run_id)}
    for step in range(3):
        assert m[(step, "verifier_fail_frac")] > 0
        g = m[(step, "groups_dropped")]
        assert m[(step, "reward_error_count")] == g * 4  # only whole groups are missing, none scored 0
        assert m[(step, "esr")] <= 1 - g / 4 + 1e-9
    assert sum(m[(s, "groups_dropped")] for s in range(3)) == sum(e.data["groups_dropped"] for e in dropped)
    assert [e for e in reg.events(run_id) if e.kind == "alert" and e.data["runbook"] == "verifier-timeouts"]


def test_overlapped_run_re_scores_failed_grader_calls_on_the_producer_like_the_sync_loop(_rlctl_home, tmp_path,
                                                                                        monkeypatch):
    """mode=async: a timed-out grader call is re-scored with a fresh grader (faults.verifier_retries) before its
    group is queued; a group still failing is dropped whole and counted under the sync loop's metric names; the
    trajectory audit finds nothing lost or trained twice (the dropped groups are in the ledger)."""
    from rlctl.engine.ledger import audit
    from rlctl_faults import kinds

    injected: list[str] = []

    class CountedTimeout(TimeoutError):  # every injected grader failure, first calls and retries alike
        def __init__(self, *args: object) -> None:
            injected.append(str(args[0]) if args else "")
            super().__init__(*args)

    monkeypatch.setattr(kinds.VerifierTimeout, "error", CountedTimeout)
    steps = 4
    result, reg, run_dir = _train(_rlctl_home, tmp_path, "vt-async", "mode=async", f"train.steps={steps}",
                                  "faults.verifier_retries=2", "faults.inject=[{kind: verifier-timeout, rate: 0.3}]")
    assert result.run.status == "succeeded"
    m = {(p.step, p.name): p.value for p in reg.metrics(_run_id(run_dir))}
    assert sorted({s for s, name in m if name == "reward_mean"}) == list(range(steps))

    def total(name: str) -> float:
        return sum(m[(s, name)] for s in range(steps))

    assert any(m[(s, "verifier_fail_frac")] > 0 for s in range(steps))
    assert total("verifier_recovered") > 0 and total("verifier_retries") >= total("verifier_recovered")
    assert any("attempt 2" in message for message in injected)  # a retry reached the (faulty) grader again
    for step in range(steps):  # only whole groups are missing: none scored 0, none trained partially
        assert m[(step, "reward_error_count")] == m[(step, "groups_dropped")] * 4
    assert total("reward_error_count") < len(injected)  # re-scoring recovered most failed samples
    retried = _events(reg, run_dir, "verifier_retry")
    assert retried and sum(e.data["recovered"] for e in retried) == total("verifier_recovered")
    assert sum(e.data["groups_dropped"] for e in _events(reg, run_dir, "groups_dropped")) == total("groups_dropped")
    report = audit(run_dir / "queue")
    assert report.lost == () and report.double_counted == 0 and report.steps == steps
    assert report.trained == total("groups_trained") and report.dropped >= total("groups_dropped")


def test_nan_steps_are_skipped_then_rolled_back_with_lower_lr_and_a_canary(_rlctl_home, tmp_path):
    result, reg, run_dir = _train(_rlctl_home, tmp_path, "nan", "train.steps=6", "checkpoint.every_steps=2",
                                  "checkpoint.async_save=false", "faults.nan_rollback_after=2",
                                  "faults.inject=[{kind: nan, at_step: 2, count: 2}]")
    run_id = _run_id(run_dir)
    assert result.run.status == "succeeded"
    [back] = _events(reg, run_dir, "nan_rollback")
    assert (back.data["step"], back.data["to_step"]) == (3, 2)
    assert back.data["lr"] == pytest.approx(1e-3 * 0.5)
    assert _events(reg, run_dir, "canary_passed")[0].data["step"] == 2
    fired = sorted(e.data["step"] for e in _events(reg, run_dir, "fault_injected"))
    assert fired == [2, 3]  # a re-run step never re-fires its fault
    steps = sorted({p.step for p in reg.metrics(run_id, ["reward_mean"])})
    assert steps == list(range(6))  # the rolled-back steps were re-run, each recorded once
    lr = {p.step: p.value for p in reg.metrics(run_id, ["lr"])}
    assert lr[5] == pytest.approx(1e-3 * 0.5)


def test_overlapped_run_rolls_back_nan_steps_under_the_same_guard(_rlctl_home, tmp_path):
    """mode=async: the NaN rollback restores the checkpoint and its queue cursor; the history stays exact."""
    from rlctl.engine.ledger import audit

    result, reg, run_dir = _train(_rlctl_home, tmp_path, "nan-async", "mode=async", "train.steps=6",
                                  "checkpoint.every_steps=2", "checkpoint.async_save=false",
                                  "faults.nan_rollback_after=2", "faults.inject=[{kind: nan, at_step: 2, count: 2}]")
    assert result.run.status == "succeeded"
    [back] = _events(reg, run_dir, "nan_rollback")
    assert (back.data["step"], back.data["to_step"]) == (3, 2)
    assert _events(reg, run_dir, "canary_passed")[0].data["step"] == 2
    assert sorted({p.step for p in reg.metrics(_run_id(run_dir), ["reward_mean"])}) == list(range(6))
    report = audit(run_dir / "queue")
    assert report.steps == 6 and report.trained == 24 and report.double_counted == 0 and report.lost == ()


def test_a_skipped_nan_step_leaves_parameters_unchanged(tiny_config, plugins, _rlctl_home):
    import torch

    from rlctl.engine.batching import build_batch
    from rlctl.engine.faults import arm
    from tests.helpers import build_roles

    session = build_roles(tiny_config, plugins, cache_root=_rlctl_home / "cache")
    prompts = session.cursor.next(2)
    from rlctl.contracts.types import RolloutRequest

    reqs = [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(session.tokenizer(p.text)["input_ids"]), group_size=4,
                           sampling=session.sampling, dataset_version="d") for p in prompts]
    trajs = session.rollout.generate(reqs)
    batch = build_batch(trajs, [1.0, -1.0] * 4, session.tokenizer.pad_token_id, session.sampling)
    before = {k: v.clone() for k, v in session.learner.model.state_dict().items()}
    disarm = arm("learner.loss", lambda loss, **_: loss * float("nan"))
    try:
        stats = session.learner.train_step(batch)
    finally:
        disarm()
    assert stats["nan_inf_skipped_steps"] == 1
    assert all(torch.equal(before[k], v) for k, v in session.learner.model.state_dict().items())
    session.rollout.close()


def test_watchdog_reports_role_phase_and_stack_instead_of_hanging(_rlctl_home, tmp_path):
    import time

    from rlctl.incidents.recovery import HangError

    started = time.monotonic()
    err, reg, run_dir = _train(_rlctl_home, tmp_path, "hang", "faults.watchdog_timeout_s=1",
                               "faults.inject=[{kind: slow-rollout, at_step: 1, options: {delay_s: 600}}]",
                               expect_error=True)
    assert time.monotonic() - started < 150  # far below the 600 s straggler, with slack for a loaded machine
    assert isinstance(err, HangError) and "runbook show hang" in str(err)
    [hang] = _events(reg, run_dir, "hang")
    assert (hang.data["role"], hang.data["phase"], hang.data["step"]) == ("rollout", "generate", 1)
    assert "slow" in hang.data["stack"] or "sleep" in hang.data["stack"] or "kinds.py" in hang.data["stack"]
    assert Path(hang.data["dump"]).is_file()
    assert reg.get_run(_run_id(run_dir)).status == "failed"


# Overlapped runs swap the session's roles for a worker pool (and on Ray a learner actor handle); the loops
# beat their phases through the guard's heartbeat, so a hang still names the role the driver waits on.
OVERLAPPED = ["mode=async", "cluster.backend=local", "cluster.num_rollout_workers=1"]


def test_watchdog_names_the_rollout_when_an_overlapped_driver_waits_for_trajectories(_rlctl_home, tmp_path):
    """One worker (a second one would feed the async learner instead); it straggles past the timeout."""
    from rlctl.incidents.recovery import HangError

    err, reg, run_dir = _train(_rlctl_home, tmp_path, "hang-async-rollout", *OVERLAPPED,
                               "faults.watchdog_timeout_s=3",  # the straggler takes 8 s
                               "faults.inject=[{kind: slow-rollout, at_step: 0, options: {delay_s: 8}}]",
                               expect_error=True)
    assert isinstance(err, HangError) and "role rollout" in str(err)
    [hang] = _events(reg, run_dir, "hang")
    assert (hang.data["role"], hang.data["phase"], hang.data["step"]) == ("rollout", "generate", 0)
    assert hang.data["thread"] == "rollout-local-0"  # the producer thread inside the stuck generate call
    assert "kinds.py" in hang.data["stack"]
    assert reg.get_run(_run_id(run_dir)).status == "failed"


def test_watchdog_names_the_learner_when_it_hangs_while_producers_keep_beating(_rlctl_home, tmp_path):
    """A slow-learner fault blocks the learner's train call; producer beats do not reset the timer."""
    from rlctl.incidents.recovery import HangError

    # 5 s: the first batch, generated before the learner is reached, must fit in it on a loaded machine
    err, reg, run_dir = _train(_rlctl_home, tmp_path, "hang-async-learner", *OVERLAPPED,
                               "faults.watchdog_timeout_s=5",  # the learner sleeps 120 s, interrupted by the hang
                               "faults.inject=[{kind: slow-learner, at_step: 0, options: {delay_s: 120}}]",
                               expect_error=True)
    assert isinstance(err, HangError) and "role learner" in str(err)
    [hang] = _events(reg, run_dir, "hang")
    assert (hang.data["role"], hang.data["phase"], hang.data["step"]) == ("learner", "train", 0)
    assert hang.data["thread"] == "MainThread"
