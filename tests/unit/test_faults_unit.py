"""Fault sites, the FaultContext window, the register_faults hook, and the scoring seam's retry / group drop."""

from __future__ import annotations

import pytest

from rlctl import RewardResult, Trajectory, hookimpl
from rlctl.contracts.errors import PluginError
from rlctl.engine.batching import drop_unscored_groups
from rlctl.engine.faults import FaultContext, arm, drain_recoveries, fault_site, report_recovery
from rlctl.engine.scoring import rescore_failed, score_all


def test_fault_site_is_a_no_op_until_armed_and_disarm_restores_it() -> None:
    assert fault_site("test.site", 5) == 5
    disarm = arm("test.site", lambda value, **info: value * info["k"])
    try:
        assert fault_site("test.site", 5, k=3) == 15
    finally:
        disarm()
    assert fault_site("test.site", 5, k=3) == 5


def test_recoveries_are_drained_once_in_order() -> None:
    drain_recoveries()
    report_recovery("a", "first", {"n": 1})
    report_recovery("b", "second")
    assert [k for k, _, _ in drain_recoveries()] == ["a", "b"]
    assert drain_recoveries() == []


def test_fault_context_fires_once_per_step_in_its_window_and_never_on_a_replayed_step() -> None:
    step, recorded = [0], []
    ctx = FaultContext(kind="k", at_step=2, count=2, rate=0.3, target=None, options=None, seed=0,
                       step=lambda: step[0], record=lambda m, d: recorded.append(d["step"]), fired_steps={3})
    due = []
    for s in range(6):
        step[0] = s
        if ctx.due():
            ctx.fire("x")
        due.append(ctx.due())
    assert recorded == [2]  # step 3 already fired before a restart, 4 and 5 are outside the window
    hits = sum(ctx.chance(str(i)) for i in range(2000))
    assert 500 < hits < 700 and ctx.chance("7") == ctx.chance("7")


class _Boom:
    def __init__(self, options=None) -> None:
        pass

    def arm(self, ctx):
        return arm("test.boom", lambda value, **_: value)


class _FaultPlugin:
    @hookimpl
    def register_faults(self, register):
        register("boom", _Boom)


def test_hook_register_faults() -> None:
    from rlctl.hooks.manager import load_plugins

    plugins = load_plugins(extra={"third_party_faults": _FaultPlugin()})
    assert "boom" in plugins.names("fault") and "oom" in plugins.names("fault")
    fault = plugins.build("fault", "boom", {}, "faults.inject.0.options")
    fault.arm(None)()
    with pytest.raises(PluginError, match="did you mean 'boom'"):
        plugins.get("fault", "bom")


def _traj(pid: str, i: int) -> Trajectory:
    from tests.unit.test_engine_parts import traj

    return traj(pid, i)


class _FlakyGrader:
    """Fails the first ``fails[id]`` calls of each sample with a timeout; counts instances (fresh graders)."""

    made = 0
    version = "flaky@1"

    def __init__(self, fails: dict[str, int], calls: dict[str, int]) -> None:
        _FlakyGrader.made += 1
        self.fails, self.calls = fails, calls

    def score(self, t: Trajectory, reference: str) -> RewardResult:
        n = self.calls[t.id] = self.calls.get(t.id, 0) + 1
        if n <= self.fails.get(t.id, 0):
            return RewardResult(total=0.0, components={}, grader_version=self.version, error_code="timeout:math")
        return RewardResult(total=float(t.id.endswith("/1")), components={"math": 1.0}, grader_version=self.version)


def test_failed_samples_are_retried_with_fresh_graders_then_whole_groups_dropped() -> None:
    trajs = [_traj(p, i) for p in ("a", "b", "c") for i in range(2)]
    fails, calls = {"a/0": 1, "b/1": 5}, {}
    _FlakyGrader.made = 0
    grader = _FlakyGrader(fails, calls)
    scored, _ = score_all(trajs, {"a": "1", "b": "1", "c": "1"}, grader, None)
    scored, stats = rescore_failed(scored, {"a": "1", "b": "1", "c": "1"}, lambda: _FlakyGrader(fails, calls), 2, None)
    assert stats == {"verifier_fail_frac": 2 / 6, "verifier_retries": 3.0, "verifier_recovered": 1.0}
    assert _FlakyGrader.made == 3  # the first grader, then one fresh grader per retry round
    kept, dropped = drop_unscored_groups(scored, 2)
    assert [t.prompt_id for t in kept] == ["a", "a", "c", "c"] and [t.id for t in dropped] == ["b/0", "b/1"]
    assert all(t.reward is not None for t in kept)  # never a silent zero for the unscored sample
    assert dropped[1].reward is None and dropped[1].reward_error == "timeout:math"


def test_a_verdict_is_not_retried() -> None:
    class Invalid:
        version = "v"

        def score(self, t, ref):
            return RewardResult(total=0.0, components={}, grader_version="v", error_code="invalid_reward")

    scored, _ = score_all([_traj("a", 0)], {"a": "1"}, Invalid(), None)
    _, stats = rescore_failed(scored, {"a": "1"}, Invalid, 3, None)
    assert stats["verifier_retries"] == 0


def test_a_retry_in_another_process_does_not_redraw_the_first_attempts_verifier_fault() -> None:
    """A reward actor's grader failed a sample; the driver re-scores it with a fresh grader: that is attempt 2
    (its own coin), not attempt 1 again (which would fail deterministically, whatever the rate)."""
    from rlctl_faults.kinds import VerifierError

    def context() -> FaultContext:
        return FaultContext(kind="verifier-error", at_step=0, count=None, rate=0.5, target=None, options=None,
                            seed=0, step=lambda: 0, record=lambda message, data: None)

    coin = context()
    first = next(t for t in (_traj(f"p{i}", 0) for i in range(200))
                 if coin.chance(f"{t.id}/1") and not coin.chance(f"{t.id}/2"))
    disarm = VerifierError().arm(context())  # the reward actor's process
    try:
        with pytest.raises(RuntimeError, match="attempt 1"):
            fault_site("verifier.score", trajectory=first, grader="math")
    finally:
        disarm()
    disarm = VerifierError().arm(context())  # the driver's process: it never saw the first attempt
    try:
        retried = first.updated(reward_error="grader_error:math")
        assert fault_site("verifier.score", 7, trajectory=retried, grader="math") == 7
    finally:
        disarm()


def test_jsonl_sink_rewrites_steps_re_run_in_the_same_process(tmp_path) -> None:
    import json

    from rlctl_sinks.jsonl import JsonlSink

    sink = JsonlSink(tmp_path)
    for step in (0, 1, 2, 3, 2, 3, 4):  # a rollback to step 2 after step 3
        sink.write(step, {"x": float(step)})
    sink.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]


def _ctx(kind: str, fired: list, at_step: int = 0) -> FaultContext:
    return FaultContext(kind=kind, at_step=at_step, count=1, rate=1.0, target=None, options=None, seed=0,
                        step=lambda: 0, record=lambda message, data: fired.append(data))


@pytest.mark.parametrize("mode", ["refused", "blackhole"])
def test_a_network_partition_makes_every_call_unreachable_then_heals(mode) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rlctl_faults.kinds import NetworkPartition, PartitionOptions
    from rlctl_sglang.client import ServerClient, ServerError

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's naming
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"ok": true}')

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = ServerClient(f"http://127.0.0.1:{server.server_address[1]}", timeout_s=0.5)
    fired: list = []
    disarm = NetworkPartition(PartitionOptions(duration_s=60, mode=mode)).arm(_ctx("network-partition", fired))
    try:
        with pytest.raises(ServerError) as err:
            client.model_info()
        assert err.value.unreachable and err.value.url == client.url  # the error still names the real server
        assert not client.healthy(timeout_s=0.5) and len(fired) == 1
    finally:
        disarm()  # heals the partition
    assert client.healthy() and client.model_info() == {"ok": True}
    server.shutdown()


@pytest.mark.parametrize("stage", ["publish", "apply"])
def test_a_weight_sync_failure_fails_the_publish_or_the_receivers_checksum(tmp_path, stage) -> None:
    import torch

    from rlctl.contracts.errors import RoleError
    from rlctl.contracts.types import WeightUpdate
    from rlctl.engine.transports.disk import DiskTransport, fetch_directory, is_committed
    from rlctl.engine.weight_sync import Broadcaster
    from rlctl_faults.kinds import WeightSyncFailure, WeightSyncOptions

    update = WeightUpdate(version=1, state_dict={"w": torch.arange(64, dtype=torch.float32)}, fingerprint="f")
    broadcaster = Broadcaster(DiskTransport(tmp_path))
    fired: list = []
    disarm = WeightSyncFailure(WeightSyncOptions(stage=stage)).arm(_ctx("weight-sync-failure", fired))
    try:
        if stage == "publish":
            with pytest.raises(OSError, match="No space left"):
                broadcaster.publish(update)
            assert not any(is_committed(d) for d in tmp_path.iterdir())  # nothing half-published is visible
            report = broadcaster.publish(update)  # fired once for this step: the retry goes through
            fetch_directory(report.location)
        else:
            report = broadcaster.publish(update)
            fault_site("weights.published", location=report.location, version=1)
            with pytest.raises(RoleError, match="sha256"):
                fetch_directory(report.location)  # what a server's load checks: it refuses the version
    finally:
        disarm()
    assert [d["stage"] for d in fired] == [stage]


class _Arbiter:
    """An in-process SharedClaims (the Ray placement's is a FaultBroker actor with the same four methods)."""

    def __init__(self) -> None:
        import threading

        self.now, self.claimed, self.events, self.lock = 0, {}, [], threading.Lock()

    def step(self) -> int:
        return self.now

    def fired(self, index: int, step: int) -> bool:
        return step in self.claimed.get(index, set())

    def claim(self, index: int, step: int) -> bool:
        with self.lock:
            steps = self.claimed.setdefault(index, set())
            first = step not in steps
            steps.add(step)
            return first

    def mark(self, index: int, step: int, event) -> None:
        with self.lock:
            self.claimed.setdefault(index, set()).add(step)
            if event is not None:
                self.events.append((index, *event))


def test_a_plan_armed_elsewhere_fires_once_per_step_across_every_context_bound_to_the_arbiter() -> None:
    import threading

    from rlctl.engine.faults import ArmedFault, arm_plan
    from rlctl_faults.kinds import SlowRollout, SlowRolloutOptions

    arbiter, recorded = _Arbiter(), []
    driver = FaultContext(kind="slow-rollout", at_step=1, count=2, rate=1.0, target=None, options=None, seed=0,
                          step=arbiter.step, record=lambda m, d: recorded.append(d), index=4)
    driver.share(arbiter)
    plan = [ArmedFault(index=4, kind="slow-rollout", options={"delay_s": 0.0}, where="faults.inject.4.options",
                       at_step=1, count=2, rate=1.0, target=None, seed=0)]
    disarms = [arm_plan(plan, arbiter, lambda f: SlowRollout(SlowRolloutOptions(**f.options))) for _ in range(3)]
    try:
        for step in range(4):
            arbiter.now = step
            threads = [threading.Thread(target=fault_site, args=("rollout.generate",), kwargs={"requests": 1})
                       for _ in range(6)]  # six calls racing through three armed copies
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            assert driver.take() is False  # the driver's own context never gets a step an armed copy took
        assert [(i, d["step"]) for i, _, d in arbiter.events] == [(4, 1), (4, 2)]  # once per step in the window
        assert recorded == [] and not driver.due()
        driver.accept(*arbiter.events[0][1:])  # the driver records what the arbiter collected
        assert [d["step"] for d in recorded] == [1] and driver.num_fired == 1
    finally:
        for disarm in disarms:
            disarm()
    assert fault_site("rollout.generate", "v") == "v"


def test_recoveries_reported_in_a_role_process_go_to_the_forwarding_sink() -> None:
    from rlctl.engine.faults import forward_recoveries

    drain_recoveries()
    sent = []
    forward_recoveries(lambda kind, message, data: sent.append((kind, data)))
    try:
        report_recovery("oom_recovered", "halved", {"micro_batch_to": 8})
    finally:
        forward_recoveries(None)
    assert sent == [("oom_recovered", {"micro_batch_to": 8})] and drain_recoveries() == []


def test_a_fault_published_mid_run_reaches_the_listeners_and_one_that_fails_leaves_it_unlisted() -> None:
    from rlctl.engine.faults import ArmedFault, armed_plan, on_publish, publish

    def armed(index: int) -> tuple[ArmedFault, FaultContext]:
        fault = ArmedFault(index=index, kind="oom", options=None, where="inject", at_step=3, count=1, rate=1.0,
                           target=None, seed=0)
        return fault, FaultContext(kind="oom", at_step=3, count=1, rate=1.0, target=None, options=None, seed=0,
                                   step=lambda: 0, record=lambda m, d: None, index=index)

    heard = []
    remove = on_publish(lambda fault, ctx: heard.append((fault.index, ctx.index)))
    withdraw = publish(*armed(7))
    try:
        assert heard == [(7, 7)] and [f.index for f, _ in armed_plan()] == [7]
    finally:
        withdraw()
        remove()

    def refuse(fault, ctx):
        raise RuntimeError("the placement's broker is gone")

    remove = on_publish(refuse)
    try:
        with pytest.raises(RuntimeError, match="broker is gone"):
            publish(*armed(8))
    finally:
        remove()
    assert armed_plan() == [] and heard == [(7, 7)]  # not armed everywhere: not listed; a removed listener is quiet
