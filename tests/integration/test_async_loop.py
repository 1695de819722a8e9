"""The overlapped loop in-process (cluster.backend=local): modes, staleness bounds, worker loss, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES

OVERLAP_METRICS = ("staleness_p50", "staleness_p95", "staleness_p99", "dlag_p50", "dlag_p95", "dlag_p99",
                   "queue_depth", "queue_age_s", "queue_drops_stale", "queue_drops_ttl", "queue_drops_orphaned",
                   "esr", "generated_tokens_per_s", "effective_tokens_per_s", "rollout_latency_p50_s",
                   "rollout_latency_p95_s", "rollout_latency_p99_s", "learner_wait_s", "rollout_wait_s",
                   "staleness_violations", "reward_mean", "loss")


class ListSink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []

    def write(self, step, metrics) -> None:
        self.rows.append((step, dict(metrics)))

    def close(self) -> None:
        pass


def session_for(plugins, home: Path, *overrides: str):
    """The placement of the tiny config with ``overrides``; a local ``mode=sync`` one gets rollout workers too, so
    every mode goes through the overlapped driver (its queue, ledger and audit)."""
    from rlctl.config.load import load_config
    from rlctl.placement import place

    config = load_config(None, [*TINY_OVERRIDES, "eval.at_end=false", *overrides])
    return place(config, plugins, cache_root=home / "cache", fleet=True)


def run(placement, directory: Path, roles=None, **kw):
    """Drive ``roles`` (default: the placement's) to the end of the run, then close the placement; the rows logged."""
    from rlctl.engine.drive import drive
    from rlctl.engine.spec import LoopSpec

    roles = roles or placement.roles
    sink = ListSink()
    try:
        drive(roles, LoopSpec.from_config(roles.config), [sink], directory=directory, **kw)
    finally:
        placement.close()
    return sink.rows


def with_workers(placement, wrap):
    """The placement's roles with each rollout worker wrapped by ``wrap(index, worker)`` (a fleet of the wrappers)."""
    from dataclasses import replace

    from rlctl.engine.producers import RolloutFleet

    workers = placement.roles.rollout.workers
    return replace(placement.roles, rollout=RolloutFleet([wrap(i, w) for i, w in enumerate(workers)]))


@pytest.mark.parametrize("continuous", [False, True], ids=["calls", "continuous"])
@pytest.mark.parametrize("mode,bound", [("sync", 0), ("one_step_off", 1), ("async", 1)])
def test_modes_respect_their_staleness_bound(plugins, _rlctl_home, tmp_path, tiny_policy_dir, mode, bound,
                                             continuous):
    """Each mode's bound holds, every group is trained once or dropped as counted, with one call per chunk or a
    continuous call (groups queued as they end, weights loaded mid-call)."""
    from rlctl.engine.ledger import audit

    session = session_for(plugins, _rlctl_home, f"mode={mode}", "train.steps=4", "staleness.max_staleness=1",
                          f"staleness.continuous_rollout={str(continuous).lower()}")
    rows = run(session, tmp_path)
    assert [s for s, _ in rows] == [0, 1, 2, 3]
    for _, m in rows:
        for name in OVERLAP_METRICS:
            assert name in m, name
        assert m["staleness_max"] <= bound and m["staleness_violations"] == 0
        assert m["groups_trained"] == 4
    assert rows[-1][1]["policy_version"] == 4
    if mode == "sync":
        assert all(m["staleness_max"] == 0 and m["queue_drops_stale"] == 0 for _, m in rows)
    report = audit(tmp_path / "queue")
    assert report.double_counted == 0 and report.lost == () and report.trained == 16


def test_reweight_keeps_stale_groups_with_truncated_weights(plugins, _rlctl_home, tmp_path, tiny_policy_dir):
    session = session_for(plugins, _rlctl_home, "mode=async", "train.steps=4", "staleness.max_staleness=0",
                          "staleness.stale_policy=reweight", "staleness.queue_capacity=12")
    rows = run(session, tmp_path)
    assert sum(m["queue_drops_stale"] for _, m in rows) == 0
    assert sum(m["reweighted_groups"] for _, m in rows) == sum(m["staleness_violations"] for _, m in rows) / 4


class WithoutCapture:
    """The session's real learner without ``train_step_with_logprobs``: the loop falls back to its separate pass."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        if name == "train_step_with_logprobs":
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("extra", [(), ("algo.num_mini_batches=2",)], ids=["one-mini-batch", "two-mini-batches"])
def test_dlag_from_the_training_forward_equals_the_separate_pass(plugins, _rlctl_home, tmp_path, tiny_policy_dir,
                                                                 extra):
    """D_lag (mean |log pi_learner - log mu| per sample, P50/P95/P99) is the same value the extra pass gave."""
    overrides = ("mode=sync", "train.steps=3", "cluster.num_rollout_workers=1", *extra)
    fast = session_for(plugins, _rlctl_home, *overrides)
    from dataclasses import replace

    old = session_for(plugins, _rlctl_home, *overrides)
    rows_fast = run(fast, tmp_path / "fast")
    rows_old = run(old, tmp_path / "old", roles=replace(old.roles, learner=WithoutCapture(old.roles.learner)))
    assert [s for s, _ in rows_fast] == [s for s, _ in rows_old] == [0, 1, 2]
    for (_, a), (_, b) in zip(rows_fast, rows_old):
        assert a.keys() == b.keys()
        assert a["response_length_mean"] == b["response_length_mean"] and a["reward_mean"] == b["reward_mean"]
        for name in ("dlag_p50", "dlag_p95", "dlag_p99", "loss"):
            assert a[name] == pytest.approx(b[name], rel=1e-5, abs=1e-7), name
    assert rows_fast[-1][1]["dlag_p95"] > 0  # the samples' own log-probs differ from the learner's by rounding


@pytest.mark.parametrize("mode", ["sync", "one_step_off"])
def test_learner_asking_before_the_producer_claims_waits_for_the_batch(plugins, _rlctl_home, tmp_path,
                                                                       tiny_policy_dir, monkeypatch, mode):
    """The learner's take comes first at every step: keys no producer has claimed yet are waited for.

    The order that made these modes flaky ("no trajectory group left to train on"), forced: the producer claims a
    step's keys only once the learner's take is blocked waiting for them.
    """
    import threading

    from rlctl.engine.ledger import audit
    from rlctl.engine.producers import Producers
    from rlctl.engine.queue import TrajectoryQueue

    learner_waits = threading.Event()
    real_wait, real_claim = TrajectoryQueue._wait, Producers._claim

    def wait(self, deadline, what, restore=None):
        if restore is not None:  # the learner's take (a producer's reserve passes none)
            learner_waits.set()
        return real_wait(self, deadline, what, restore)

    def claim(self, *args, **kwargs):
        while not learner_waits.wait(timeout=0.05):
            if self._stop.is_set():
                return []
        keys = real_claim(self, *args, **kwargs)
        if keys:
            learner_waits.clear()
        return keys

    monkeypatch.setattr(TrajectoryQueue, "_wait", wait)
    monkeypatch.setattr(Producers, "_claim", claim)
    session = session_for(plugins, _rlctl_home, f"mode={mode}", "train.steps=3", "cluster.num_rollout_workers=1")
    rows = run(session, tmp_path)
    assert [s for s, _ in rows] == [0, 1, 2] and all(m["groups_trained"] == 4 for _, m in rows)
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 12


class FlakyWorker:
    """A real local worker that loses the given calls (the far side of a worker crash: the process dying)."""

    def __init__(self, inner, lose_calls) -> None:
        self.inner, self.lose, self.calls, self.restarts = inner, set(lose_calls), 0, 0
        self.name = inner.name

    def generate(self, requests):
        from rlctl.contracts.errors import WorkerLost

        self.calls += 1
        if self.calls in self.lose:
            self.inner.generate(requests)  # it worked on them, then died before answering
            raise WorkerLost("simulated crash")
        return self.inner.generate(requests)

    def load_weights(self, update):
        self.loaded = update.version
        self.inner.load_weights(update)

    def restart(self):
        self.restarts += 1
        self.inner.restart()

    def close(self):
        self.inner.close()


def test_lost_worker_prompts_are_regenerated_with_current_weights(plugins, _rlctl_home, tmp_path, tiny_policy_dir,
                                                                   monkeypatch):
    from rlctl.engine.ledger import audit

    session = session_for(plugins, _rlctl_home, "mode=async", "train.steps=4", "cluster.max_restarts=3")
    roles = with_workers(session, lambda i, w: FlakyWorker(w, {2, 3}))
    flaky = roles.rollout.workers
    rows = run(session, tmp_path, roles=roles)
    assert sum(w.restarts for w in flaky) >= 2
    assert rows[-1][1]["rollout_worker_failures"] >= 2 and rows[-1][1]["requeued_prompts"] >= 2
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 16


class StragglerWorker:
    """A real local worker whose odd calls answer late (the far side of a slow rollout server)."""

    def __init__(self, inner, delay_s: float) -> None:
        self.inner, self.delay_s, self.calls, self.name = inner, delay_s, 0, inner.name

    def generate(self, requests):
        import time

        self.calls += 1
        out = self.inner.generate(requests)
        if self.calls % 2:
            time.sleep(self.delay_s)
        return out

    def load_weights(self, update):
        self.inner.load_weights(update)

    def restart(self):
        self.inner.restart()

    def close(self):
        self.inner.close()


def test_partial_rollout_carries_unfinished_groups_over(plugins, _rlctl_home, tmp_path, tiny_policy_dir, monkeypatch):
    """partial_fraction=0.5: steps proceed without the straggler's groups, which a later step trains (within Δv)."""
    from rlctl.engine.ledger import audit

    session = session_for(plugins, _rlctl_home, "mode=one_step_off", "train.steps=5", "staleness.max_staleness=1",
                          "staleness.partial_fraction=0.5", "staleness.rollout_chunk=1", "staleness.queue_capacity=8")
    rows = run(session, tmp_path, roles=with_workers(session, lambda i, w: StragglerWorker(w, 0.8 if i == 0 else 0.0)))
    assert [s for s, _ in rows] == [0, 1, 2, 3, 4]
    assert all(m["groups_trained"] >= 2 for _, m in rows)  # never below the fraction (B = 4)
    assert any(m["partial_carried_groups"] > 0 for _, m in rows)  # some step did not wait for the straggler
    assert all(m["staleness_violations"] == 0 for _, m in rows)  # carried groups still obey the bound
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.max_staleness <= 1
    ledger = [json.loads(line) for line in (tmp_path / "queue" / "ledger.jsonl").read_text().splitlines()]
    trained = {gid: step["step"] for step in ledger if "step" in step for gid in step["taken"]}
    assert any(step > int(gid[1:]) // 4 for gid, step in trained.items())  # a group trained after its own batch's step


def test_ppo_with_a_critic_trains_overlapped(plugins, _rlctl_home, tmp_path, tiny_policy_dir):
    from rlctl.engine.ledger import audit

    session = session_for(plugins, _rlctl_home, "algo.name=ppo", "mode=async", "train.steps=3")
    rows = run(session, tmp_path)
    assert [s for s, _ in rows] == [0, 1, 2] and all("value_loss" in m for _, m in rows)
    assert session.roles.learner.policy_version == 3
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 12


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_critic_warmup_steps_still_admit_the_next_batch(plugins, _rlctl_home, tmp_path, tiny_policy_dir, mode):
    """A warm-up step trains only the critic (the policy version stays): rollout is admitted by steps in the
    in-order modes, and in async by the draw keys the learner resolved when the version did not move."""
    from rlctl.engine.ledger import audit

    session = session_for(plugins, _rlctl_home, "algo.name=ppo", "algo.critic.warmup_steps=1", f"mode={mode}",
                          "train.steps=3", "staleness.take_timeout_s=60")
    rows = run(session, tmp_path)
    assert [s for s, _ in rows] == [0, 1, 2] and all(m["groups_trained"] == 4 for _, m in rows)
    assert session.roles.learner.policy_version == 2  # step 0 left the policy as it was
    assert all(m["staleness_max"] <= (0 if mode == "sync" else 1) for _, m in rows)
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 12


def test_dapo_filters_groups_without_signal_and_refuses_refills(plugins, _rlctl_home, tmp_path, tiny_policy_dir):
    from rlctl.contracts.errors import ConfigError
    from rlctl.engine.ledger import audit

    with pytest.raises(ConfigError, match="refills filtered groups") as err:  # refused before any role is built
        session_for(plugins, _rlctl_home, "algo.name=dapo", "mode=one_step_off", "train.steps=3")
    assert "max_sample_rounds=1" in err.value.hint
    session = session_for(plugins, _rlctl_home, "algo.name=dapo", "mode=one_step_off", "train.steps=3",
                          "algo.options={max_sample_rounds: 1}")
    rows = run(session, tmp_path / "filter")
    assert all(m["groups_trained"] + m["ds_dropped_groups"] == 4 for _, m in rows)
    report = audit(tmp_path / "filter" / "queue")  # a filtered group is dropped in the ledger, never lost
    assert report.lost == () and report.double_counted == 0
    assert report.trained + report.dropped == 12


def test_config_refuses_partial_rollout_in_sync_mode():
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="partial_fraction"):
        load_config(None, ["mode=sync", "staleness.partial_fraction=0.5"])


class EngineGone:
    """A real rollout backend whose engine vanishes on the given calls (the far side: a dead server or process)."""

    def __init__(self, inner, lose_calls) -> None:
        self.inner, self.lose, self.calls = inner, set(lose_calls), 0

    def generate(self, requests):
        from rlctl.contracts.errors import RolloutUnavailable

        self.calls += 1
        if self.calls in self.lose:
            raise RolloutUnavailable("no rollout server is reachable (connection refused)", "start the servers")
        return self.inner.generate(requests)

    def update_weights(self, update):
        self.loaded = max(getattr(self, "loaded", 0), update.version)
        return self.inner.update_weights(update)

    def stream(self, requests, on_group, more=None):
        """A continuous call may serve the whole run, so its engine vanishes mid-call instead: at the first group
        it would deliver once it holds weights newer than the initial ones (between calls or mid-call)."""
        from rlctl.contracts.errors import RolloutUnavailable
        from rlctl.contracts.weights import WeightUpdate

        def asked(free, idle):
            got = more(free, idle)
            if isinstance(got, WeightUpdate):
                self.loaded = max(getattr(self, "loaded", 0), got.version)
            return got

        def deliver(k, group):
            if self.lose and getattr(self, "loaded", 0) >= 1:
                self.lose.clear()
                raise RolloutUnavailable("no rollout server is reachable (connection refused)", "start the servers")
            on_group(k, group)

        return self.inner.stream(requests, deliver, asked if more is not None else None)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("continuous", [False, True], ids=["calls", "continuous"])
def test_rollout_unavailable_requeues_and_restarts_with_current_weights(plugins, _rlctl_home, tmp_path,
                                                                        tiny_policy_dir, monkeypatch, continuous):
    """A backend whose engine is gone mid-batch: its prompts are regenerated by a restarted worker at the current version."""
    from rlctl.engine.ledger import audit
    from rlctl.placement import local

    events: list[tuple[str, str, int]] = []  # (worker, what, version)
    originals = {name: getattr(local.LocalWorker, name) for name in ("load_weights", "restart", "generate", "stream")}

    def load_weights(self, update):
        events.append((self.name, "load", update.version))
        originals["load_weights"](self, update)

    def restart(self):
        events.append((self.name, "restart", -1))
        originals["restart"](self)

    def generate(self, requests):
        events.append((self.name, "generate", -1))
        return originals["generate"](self, requests)

    def stream(self, requests, on_group, more=None):  # a continuous call (staleness.continuous_rollout)
        events.append((self.name, "generate", -1))
        return originals["stream"](self, requests, on_group, more)

    for name, fn in (("load_weights", load_weights), ("restart", restart), ("generate", generate),
                     ("stream", stream)):
        monkeypatch.setattr(local.LocalWorker, name, fn)
    session = session_for(plugins, _rlctl_home, "mode=async", "train.steps=4", "cluster.max_restarts=3",
                          "cluster.num_rollout_workers=1",  # one worker: the run finishes only if it comes back
                          f"staleness.continuous_rollout={str(continuous).lower()}")
    worker = session.roles.rollout.workers[0]
    worker.backend = EngineGone(worker.backend, {2})  # its engine goes away on the second call
    rows = run(session, tmp_path)
    assert rows[-1][1]["rollout_worker_failures"] == 1 and rows[-1][1]["requeued_prompts"] >= 1
    mine = [(what, v) for name, what, v in events if name == "local-0"]
    after = mine[mine.index(("restart", -1)) + 1:]
    assert after[0][0] == "load" and after[0][1] >= 1  # the new backend loads the current weights first
    assert ("generate", -1) in after  # and then serves again
    report = audit(tmp_path / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 16


def test_worker_restart_storm_fails_clearly(plugins, _rlctl_home, tmp_path, tiny_policy_dir, monkeypatch):
    from rlctl.contracts.errors import RoleError

    session = session_for(plugins, _rlctl_home, "mode=async", "train.steps=2", "cluster.max_restarts=1")
    with pytest.raises(RoleError, match="died 2 times"):
        run(session, tmp_path, roles=with_workers(session, lambda i, w: FlakyWorker(w, range(1, 100))))


@pytest.mark.parametrize("compacting", [False, True], ids=["plain", "compacted"])
def test_resume_from_checkpoint_neither_drops_nor_repeats(plugins, _rlctl_home, tmp_path, tiny_policy_dir,
                                                          compacting):
    """Crash after step 4 of 6 with the newest checkpoint at 4 completed steps: the resumed run trains every group exactly once.

    ``compacted``: one log segment per put, so every committed checkpoint lets
    the driver delete the segments below the oldest kept checkpoint's cursor
    before the crash; the resume must still neither regenerate nor retrain them.
    """
    from rlctl.engine.ledger import audit
    from rlctl.engine.checkpoint import DiskCheckpointStore
    from rlctl.engine.snapshot import Provenance, StepCheckpointer, restore

    overrides = ("mode=async", "train.steps=6", "staleness.max_staleness=2", "staleness.queue_capacity=12",
                 *(["staleness.queue_segment_bytes=1"] if compacting else []))
    session = session_for(plugins, _rlctl_home, *overrides)
    store = DiskCheckpointStore(tmp_path / "checkpoints", keep_last=3, async_save=False)
    prov = Provenance(run_id="r", config_hash="h", code_version="c")
    ckpt = StepCheckpointer(session.roles, store, prov, every_steps=2, total_steps=6)

    class Crash(Exception):
        pass

    def observer(step, metrics):
        if step == 4:  # step 4 trained and was logged, but its checkpoint (at 6) never came
            raise Crash

    with pytest.raises(Crash):
        run(session, tmp_path, observer=observer, checkpoint=ckpt, store=store)
    if compacting:  # the checkpoints at 2 and 4 are kept: segments below the one at 2 are gone
        assert (tmp_path / "queue" / "compacted.json").is_file()
        first = min(int(p.stem.split("-")[1]) for p in (tmp_path / "queue").glob("seg-*.log"))
        assert first > 0
    path, state, _ = store.load_latest()
    assert state.step == 4 and state.queue is not None and state.queue["watermark"] >= 0
    assert json.loads((Path(path) / "state.json").read_text())["queue"] == state.queue

    again = session_for(plugins, _rlctl_home, *overrides)
    report = restore(again.roles, state, 1e-5)
    assert report.resume.step == 4 and report.resume.queue_cursor == state.queue
    rows = run(again, tmp_path, resume=report.resume, store=store)
    assert [s for s, _ in rows] == [4, 5]
    report = audit(tmp_path / "queue")
    assert report.steps == 6 and report.trained == 24 and report.double_counted == 0 and report.lost == ()


def test_config_rejects_unknown_mode_and_backend():
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="mode"):
        load_config(None, ["mode=fast"])
    with pytest.raises(ConfigError, match="backend"):
        load_config(None, ["cluster.backend=slurm"])


@pytest.mark.slow
def test_cli_async_train_sigkill_then_resume_trains_every_group_once(_rlctl_home, tmp_path, tiny_policy_dir):
    """``rlctl train mode=async`` SIGKILLed mid-run, then ``rlctl resume``: the committed history is exact."""
    import signal

    from rlctl.engine.ledger import audit
    from tests.integration.test_cli import rlctl
    from tests.integration.test_resume import run_id, spawn, wait_for_step

    home = tmp_path / "home"
    home.mkdir()
    (home / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    run_dir = tmp_path / "run"
    overrides = ["mode=async", "staleness.max_staleness=2", "checkpoint.every_steps=3", "train.steps=9",
                 "eval.at_end=false", "train.deterministic=false"]
    proc = spawn(home, run_dir, *overrides)
    wait_for_step(proc, run_dir, 4)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    out = json.loads(rlctl("resume", run_id(run_dir), "--json", home=home, check=True).stdout)
    assert out["run"]["status"] == "succeeded"
    report = audit(run_dir / "queue")
    assert report.steps == 9 and report.double_counted == 0 and report.lost == (), report
    assert report.trained == 9 * 4 and report.max_staleness <= 2
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(set(steps)) == list(range(9))
