"""Rollout workers as child processes (cluster.rollout_workers): the same samples as in this process, a killed
child is a lost worker that comes back with current weights, and the overlapped loop trains every group once."""

from __future__ import annotations

import os
import signal

import pytest

from tests.conftest import TINY_OVERRIDES


def _config(*overrides: str):
    from rlctl.config.load import load_config

    return load_config(None, [*TINY_OVERRIDES, "eval.at_end=false", *overrides])


def _requests(common, config, n: int = 3):
    from rlctl.contracts.types import RolloutRequest
    from rlctl.placement.build import sampling_config

    return [RolloutRequest(prompt_id=r.id, prompt_tokens=tuple(common.tokenizer(r.text)["input_ids"]),
                           group_size=config.algo.group_size, sampling=sampling_config(config),
                           dataset_version=common.task.version) for r in common.task.train[:n]]


def _samples(trajectories):
    return [(t.prompt_id, t.response_tokens, t.behavior_logprobs, t.policy_version) for t in trajectories]


@pytest.fixture(scope="module")
def common(plugins, _rlctl_home, tiny_policy_dir):
    from rlctl.placement.build import build_common

    config = _config("train.deterministic=true")
    return config, build_common(config, plugins, _rlctl_home / "cache")


def _perturbed(common, version: int):
    """A new weight version: the policy's tensors, shifted (what a learner step would publish)."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlctl.contracts.types import WeightUpdate
    from rlctl.models.fingerprint import fingerprint

    model = AutoModelForCausalLM.from_pretrained(common.policy_dir, dtype=torch.float32)
    state = {k: v + 0.05 * torch.randn_like(v, generator=torch.Generator().manual_seed(version))  # tied: same noise
             for k, v in model.state_dict().items()}
    return WeightUpdate(version=version, state_dict=state, fingerprint=fingerprint(state))


def test_a_process_worker_samples_exactly_what_the_backend_samples_in_this_process(plugins, common):
    from rlctl.placement.processes import ProcessWorker

    config, common = common
    requests, update = _requests(common, config), _perturbed(common, 1)
    here = common.build_rollout(plugins, 0)
    worker = ProcessWorker("p0", config.rollout, common.rollout_context(0), 0)
    try:
        assert worker.pid != os.getpid()
        first = _samples(worker.generate(requests))
        assert first == _samples(here.generate(requests))
        here.update_weights(update)
        worker.load_weights(update)  # tensors through shared memory
        after = _samples(worker.generate(requests))
        assert after == _samples(here.generate(requests))
        assert {s[3] for s in after} == {1} and after != first
    finally:
        worker.close()
        here.close()
    assert worker.pid is None


def test_a_killed_child_is_a_lost_worker_and_a_restart_serves_again(common):
    from rlctl.contracts.errors import WorkerLost
    from rlctl.placement.processes import ProcessWorker

    config, common = common
    requests = _requests(common, config, n=1)
    worker = ProcessWorker("p0", config.rollout, common.rollout_context(0), 0)
    try:
        pid = worker.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(WorkerLost, match=rf"pid {pid}\) exited with code -9"):
            worker.generate(requests)
        worker.restart()
        assert worker.pid != pid
        worker.load_weights(_perturbed(common, 3))
        assert {t.policy_version for t in worker.generate(requests)} == {3}
    finally:
        worker.close()


def test_a_child_that_cannot_build_its_backend_raises_the_error_itself(common):
    from rlctl.contracts.errors import PluginError
    from rlctl.placement.processes import ProcessWorker

    config, common = common
    broken = config.rollout.model_copy(update={"backend": "no-such-engine"})
    with pytest.raises(PluginError, match="no-such-engine") as err:
        ProcessWorker("p0", broken, common.rollout_context(0), 0)
    assert err.value.hint  # the hint crossed the pipe with the error


def test_auto_picks_processes_only_for_the_python_bound_engine_without_injected_faults():
    from rlctl.placement.processes import use_processes

    assert use_processes(_config("cluster.rollout_workers=auto"))
    assert not use_processes(_config("cluster.rollout_workers=threads"))
    assert not use_processes(_config("cluster.rollout_workers=auto",
                                     "faults.inject=[{kind: slow-rollout, at_step: 0}]"))
    assert not use_processes(_config("cluster.rollout_workers=auto", "rollout.backend=sglang",
                                     "rollout.options={servers: ['http://127.0.0.1:9']}"))


def test_processes_with_injected_faults_are_refused_before_any_model_loads(plugins, _rlctl_home):
    from rlctl.contracts.errors import ConfigError
    from rlctl.placement import place

    config = _config("mode=async", "cluster.rollout_workers=processes",
                     "faults.inject=[{kind: slow-rollout, at_step: 0}]")
    with pytest.raises(ConfigError, match="cannot carry injected faults") as err:
        place(config, plugins, cache_root=_rlctl_home / "cache")
    assert "rollout_workers=threads" in err.value.hint


class KillsItsChild:
    """A process worker whose child is SIGKILLed on the given generate calls (the far side: the OOM killer)."""

    def __init__(self, inner, kill_calls) -> None:
        self.inner, self.kill, self.calls, self.name, self.pids = inner, set(kill_calls), 0, inner.name, []

    def generate(self, requests):
        self.calls += 1
        self.pids.append(self.inner.pid)
        if self.calls in self.kill:
            os.kill(self.inner.pid, signal.SIGKILL)
        return self.inner.generate(requests)

    def stream(self, requests, on_group, more=None):
        """A continuous call may serve the whole run, so each group it delivers counts as a call as well; on a
        killing one the child dies before that group reaches the driver (it is lost with the rest in flight)."""
        self.calls += 1
        self.pids.append(self.inner.pid)
        if self.calls in self.kill:
            os.kill(self.inner.pid, signal.SIGKILL)

        def deliver(k, group):
            self.calls += 1
            if self.calls in self.kill:
                os.kill(self.inner.pid, signal.SIGKILL)
                return
            on_group(k, group)

        return self.inner.stream(requests, deliver, more)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.slow
@pytest.mark.parametrize("continuous", [False, True], ids=["calls", "continuous"])
def test_async_on_worker_processes_loses_nothing_when_a_child_is_killed(plugins, _rlctl_home, tmp_path, continuous):
    from rlctl.engine.ledger import audit
    from rlctl.placement.processes import ProcessWorker
    from tests.integration.test_async_loop import run, session_for, with_workers

    session = session_for(plugins, _rlctl_home, "mode=async", "train.steps=4", "cluster.max_restarts=3",
                          "cluster.rollout_workers=auto", "cluster.num_rollout_workers=1",  # it must come back
                          f"staleness.continuous_rollout={str(continuous).lower()}")
    assert all(isinstance(w, ProcessWorker) for w in session.roles.rollout.workers)
    roles = with_workers(session, lambda i, w: KillsItsChild(w, {2}))
    rows = run(session, tmp_path, roles=roles)
    killed = roles.rollout.workers[0]
    assert len(set(killed.pids)) >= 2  # a new child served after the kill
    assert rows[-1][1]["rollout_worker_failures"] >= 1 and rows[-1][1]["requeued_prompts"] >= 1
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 16


@pytest.mark.slow
def test_a_rollout_fault_injected_into_a_run_on_worker_processes_is_refused_and_a_learner_fault_still_fires(
        _rlctl_home, tmp_path):
    """`rlctl inject --run` hands faults to the running run; one that arms inside the rollout backend cannot reach
    the worker processes: the run records why and goes on (it never fires silently nowhere)."""
    from rlctl.config.models import FaultSpec
    from rlctl.incidents.inject import inject_running
    from tests.integration.test_cli import rlctl
    from tests.integration.test_faults_process import _registry, _run_id

    run_dir = tmp_path / "run"
    inject_running(run_dir, FaultSpec(kind="slow-rollout", at_step=1, options={"delay_s": 30}))
    inject_running(run_dir, FaultSpec(kind="oom", at_step=2))
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "cluster.rollout_workers=auto", "mode=async",
                 "train.steps=4", "eval.at_end=false", "--run-dir", str(run_dir), home=_rlctl_home, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "injected fault slow-rollout not armed" in proc.stderr
    with _registry(_rlctl_home) as reg:
        events = reg.events(_run_id(run_dir))
    [refused] = [e for e in events if e.kind == "fault_refused"]
    assert refused.data["kind"] == "slow-rollout" and "rollout.generate" in refused.message
    assert "cluster.rollout_workers=threads" in refused.message
    assert [e.data["kind"] for e in events if e.kind == "fault_armed"] == ["oom"]
    assert any(e.kind == "oom_recovered" for e in events)  # a learner fault arms in the driver, as ever
    assert sorted(p.suffix for p in (run_dir / "inject").iterdir()) == [".armed", ".refused"]
