"""Faults on the rollout side of the sglang backend, against real `rlctl serve rollout` processes (127.0.0.1).

Each test trains a tiny deterministic run in this process with ``rollout.backend:
sglang`` and one injected fault, then proves the documented recovery from the
run's registry events and metrics:

- worker-crash: a rollout server is SIGKILLed before a step's dispatch; its
  prompt groups go, whole, to the other server; every step still trains B
  groups of G samples.
- network-partition: no server is reachable for a while; generation pauses,
  the server is fenced (confirms the current version) on reconnect, and the
  step trains exactly B groups (none duplicated, none lost).
- weight-sync-failure (publish: a shard write fails; apply: the server's
  checksum refuses the version): the publish is written again and confirmed;
  rollout and learner log-probs agree at every step, so no half-applied or
  old weights ever served a sample.

The far side is rlctl's own SGLang-API server (a real SGLang needs a GPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_faults import _events, _run_id, _train
from tests.integration.test_serve_sglang import Served

pytestmark = pytest.mark.slow

STEPS = 4


def _sglang(tmp: Path, *urls: str, **options) -> str:
    opts = {"servers": list(urls), "publish_dir": str(tmp / "pub"), "retries": 3, "retry_backoff_s": 0.2,
            "reconnect_timeout_s": 120, **options}
    return f"rollout.options={json.dumps(opts)}"


def _metrics(reg, run_dir: Path) -> dict[tuple[int, str], float]:
    return {(p.step, p.name): p.value for p in reg.metrics(_run_id(run_dir))}


def _alerted(reg, run_dir: Path) -> set[str]:
    return {e.data["runbook"] for e in _events(reg, run_dir, "alert")}


def _fault(kind: str, at_step: int = 1, **options) -> str:
    return "faults.inject=" + json.dumps([{"kind": kind, "at_step": at_step, "options": options}])


def _trained_every_step_exactly_once(m: dict[tuple[int, str], float]) -> None:
    assert sorted({s for s, name in m if name == "reward_mean"}) == list(range(STEPS))
    for step in range(STEPS):  # every group generated and scored, none dropped
        assert m[(step, "reward_error_count")] == 0 and m[(step, "groups_dropped")] == 0
        assert m[(step, "logprob_mismatch_max")] <= 1e-4  # the server served exactly the learner's weights


@pytest.fixture(scope="module")
def server(tiny_policy_dir, tmp_path_factory):
    served = Served(tiny_policy_dir, tmp_path_factory.mktemp("serve"))
    yield served
    served.stop()


def test_worker_crash_reroutes_the_dead_servers_groups(_rlctl_home, tiny_policy_dir, tmp_path):
    servers = [Served(tiny_policy_dir, tmp_path), Served(tiny_policy_dir, tmp_path)]
    try:
        result, reg, run_dir = _train(_rlctl_home, tmp_path, "crash", "rollout.backend=sglang", f"train.steps={STEPS}",
                                      _sglang(tmp_path, *(s.url for s in servers)), _fault("worker-crash"))
        assert result.run.status == "succeeded"
        assert servers[0].proc.wait(timeout=30) == -9  # really SIGKILLed
        [fired] = _events(reg, run_dir, "fault_injected")
        assert fired.data["server"] == servers[0].url and fired.data["pid"] == servers[0].proc.pid
        lost = _events(reg, run_dir, "rollout_server_lost")
        assert lost and lost[0].data["server"] == servers[0].url and lost[0].data["step"] == 1
        assert sum(e.data["groups"] for e in lost if e.data["step"] == 1) >= 1
        assert "worker-crash" in _alerted(reg, run_dir)  # the live alert named the runbook
        _trained_every_step_exactly_once(_metrics(reg, run_dir))
    finally:
        for s in servers:
            s.stop()


@pytest.mark.parametrize("mode", ["refused", "blackhole"])
def test_network_partition_pauses_fences_and_reconnects(_rlctl_home, server, tmp_path, mode):
    rows = server.get("/get_server_info")["rlctl"]["rows"]
    result, reg, run_dir = _train(_rlctl_home, tmp_path, f"part-{mode}", "rollout.backend=sglang",
                                  f"train.steps={STEPS}", _sglang(tmp_path, server.url, timeout_s=2.0),
                                  _fault("network-partition", duration_s=3.0, mode=mode))
    assert result.run.status == "succeeded"
    assert [e.data["step"] for e in _events(reg, run_dir, "fault_injected")] == [1]
    [paused] = _events(reg, run_dir, "rollout_partition")
    [back] = _events(reg, run_dir, "rollout_reconnected")
    assert paused.data["step"] == back.data["step"] == 1 and back.data["servers"] == [server.url]
    assert "network-partition" in _alerted(reg, run_dir)
    # no duplicated work: the server generated each step's B x G samples once (the failed calls never reached it)
    assert server.get("/get_server_info")["rlctl"]["rows"] - rows == STEPS * 4 * 4
    _trained_every_step_exactly_once(_metrics(reg, run_dir))


@pytest.mark.parametrize("stage", ["publish", "apply"])
def test_weight_sync_failure_is_retried_until_the_server_confirms(_rlctl_home, server, tmp_path, stage):
    rows = server.get("/get_server_info")["rlctl"]["rows"]
    result, reg, run_dir = _train(_rlctl_home, tmp_path, f"sync-{stage}", "rollout.backend=sglang",
                                  f"train.steps={STEPS}", _sglang(tmp_path, server.url),
                                  _fault("weight-sync-failure", stage=stage))
    assert result.run.status == "succeeded"
    [fired] = _events(reg, run_dir, "fault_injected")
    assert fired.data["stage"] == stage and fired.data["step"] == 1
    failed, recovered = _events(reg, run_dir, "weight_sync_failed"), _events(reg, run_dir, "weight_sync_recovered")
    assert failed and {e.data["step"] for e in failed} == {1}
    assert recovered and {e.data["step"] for e in recovered} == {1}
    assert "weight-sync-failure" in _alerted(reg, run_dir)
    if stage == "apply":  # the server refused the damaged version, and kept serving the previous one meanwhile
        assert any("refused" in e.message or "sha256" in e.message for e in failed)
    info = server.get("/get_model_info")
    assert info["weight_version"] == str(STEPS)
    assert server.get("/get_server_info")["rlctl"]["rows"] - rows == STEPS * 4 * 4  # no step was generated twice
    _trained_every_step_exactly_once(_metrics(reg, run_dir))


def test_a_partition_past_the_reconnect_timeout_stops_the_run_with_the_runbook(_rlctl_home, server, tmp_path):
    from rlctl.contracts.errors import RoleError

    err, reg, run_dir = _train(_rlctl_home, tmp_path, "part-long", "rollout.backend=sglang", f"train.steps={STEPS}",
                               _sglang(tmp_path, server.url, reconnect_timeout_s=1.0),
                               _fault("network-partition", duration_s=600.0), expect_error=True)
    assert isinstance(err, RoleError) and f"no rollout server of ['{server.url}'] reachable" in err.message
    assert "rlctl runbook show network-partition" in err.hint
    assert _events(reg, run_dir, "rollout_partition") and not _events(reg, run_dir, "rollout_reconnected")
    assert reg.get_run(_run_id(run_dir)).status == "failed"
    assert server.get("/get_model_info")["weight_version"] == "1"  # it was never touched during the partition
