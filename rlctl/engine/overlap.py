"""The overlapped driver's learner loop: rollout workers feed a durable queue, the learner trains from it.

What this is: ``run_overlapped`` for ``mode: sync | one_step_off | async``
when the placement gave the run a fleet of rollout workers (threads or Ray
actors). The producers (rlctl.engine.producers) generate and score groups
into the TrajectoryQueue; this loop takes B groups per step, selects them
(rlctl.engine.groups.select_groups, as the synchronous loop does), trains on
them with the step every mode shares (rlctl.engine.step.train_on), records
the step in the ledger, logs and checkpoints together with the queue cursor.

The modes differ only in how far rollout may run ahead (``spec.max_ahead``):
sync 0, one_step_off 1, async ``staleness.max_staleness``. Admission follows
the clock each mode takes by -- learner steps in sync and one_step_off, policy
versions in async (its bound counts versions) -- and the batch the learner
waits for is always admitted (rlctl.engine.queue), so steps that leave the
policy as it was (critic warm-up steps, steps without signal, NaN-skipped
ones) never close the window. The learner takes batch s in
draw order in sync and one_step_off, oldest-first among whatever is ready in
async. dv beyond the bound is dropped or
reweighted (truncated importance sampling) and always counted. Partial
rollout (``partial_fraction`` < 1): a step proceeds once that share of its B
groups is ready; the rest carry over with their policy versions, so the dv
bound applies to them as to any other.

A learner that raises LearnerLost is restored through ``recover`` (the
newest checkpoint, including the queue cursor) and training continues from
that step; the ledger records the rewind so ``audit`` can rebuild the
committed history. The learner's wait for a batch is the heartbeat phase
``generate`` (role rollout, waiting for threads).

What this is not: the rollout side (rlctl.engine.producers), placement
(rlctl.placement) or run bookkeeping (rlctl.lifecycle).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.contracts.errors import LearnerLost, RoleError
from rlctl.contracts.roles import MetricSink
from rlctl.contracts.types import Trajectory
from rlctl.engine.groups import request_encoder, select_groups, unscorable_batch
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.ledger import Ledger
from rlctl.engine.loop import Checkpointer, Evaluate, Observer, StepEnd
from rlctl.engine.producers import Producers, RolloutFleet
from rlctl.engine.queue import DROP_REASONS, QueueError, QueueTimeout, TakeResult, TrajectoryQueue
from rlctl.engine.roles import START, ResumePoint, Roles
from rlctl.engine.spec import LoopSpec
from rlctl.engine.step import StepInput, StepOutcome, train_on

EMPTY_CURSOR = {"watermark": 0, "resolved": [], "drops": {}}


def run_overlapped(roles: Roles, spec: LoopSpec, queue_dir: Path, sinks: Sequence[MetricSink], *,
                   observer: Observer | None = None, resume: ResumePoint = START,
                   checkpoint: Checkpointer | None = None, heartbeat: Heartbeat = NO_HEARTBEAT,
                   recover: Callable[[], ResumePoint] | None = None, store: Any = None,
                   evaluate: Evaluate | None = None) -> dict[str, float]:
    """Run steps ``resume.step .. spec.steps-1``; return the last step's metrics.

    ``store`` (the checkpoint store) lets compaction keep the log of every
    committed checkpoint; ``recover`` restores a lost learner in-run; ``evaluate`` is the periodic eval,
    which generates on the fleet's first worker between its producer's calls (RolloutFleet.generate).
    """
    if not isinstance(roles.rollout, RolloutFleet):
        raise ValueError("the overlapped driver needs the placement's RolloutFleet as the rollout role")
    if spec.capacity < spec.prompts_per_step:
        raise RoleError(f"the queue capacity {spec.capacity} is below one batch of {spec.prompts_per_step} "
                        "groups, so the learner could never fill a step",
                        "raise staleness.queue_capacity to at least algo.prompts_per_step")
    loop = _Overlapped(roles, spec, queue_dir, heartbeat, recover, store)
    return loop.run(StepEnd(spec, sinks, observer, checkpoint, heartbeat, evaluate), resume)


class _Overlapped:
    def __init__(self, roles: Roles, spec: LoopSpec, queue_dir: Path, heartbeat: Heartbeat,
                 recover: Callable[[], ResumePoint] | None, store: Any) -> None:
        self.roles, self.spec, self.recover, self.store = roles, spec, recover, store
        self.fleet: RolloutFleet = roles.rollout  # type: ignore[assignment]
        self.heartbeat = heartbeat  # the driver thread and every producer thread beat through it
        self.beat = heartbeat.phase
        queue_dir.mkdir(parents=True, exist_ok=True)
        self.queue = TrajectoryQueue(queue_dir, capacity=spec.capacity, batch_groups=spec.prompts_per_step,
                                     max_ahead=spec.max_ahead, ttl_s=spec.queue.ttl_s,
                                     segment_bytes=spec.queue.segment_bytes)
        self.ledger = Ledger(queue_dir / "ledger.jsonl")
        self.producers = Producers(roles, spec, self.fleet, self.queue, heartbeat,
                                   request_encoder(roles, spec.group_size))
        self._watermarks: dict[int, int] = {}  # steps done -> queue watermark then (what a checkpoint there holds)
        self._graded_reported = (0, 0, 0, 0)  # the producers' grader counters up to the last step's metrics
        self.learner_restarts = 0

    def run(self, end: StepEnd, resume: ResumePoint) -> dict[str, float]:
        if resume.queue_cursor is not None:
            self.queue.restore_cursor(resume.queue_cursor)
        self.ledger.write({"start": resume.step, "cursor": self.queue.cursor()})
        with self.beat("publish", "learner"):
            self.fleet.update_weights(self.roles.learner.export_weights())
        self._admit(resume.step, self.roles.learner.policy_version)
        self.producers.start()
        metrics: dict[str, float] = {}
        step = resume.step
        try:
            while step < self.spec.steps:
                try:
                    metrics, samples = self._step(step, end)
                    spent = end.log(step, metrics, samples)
                    self._save(end, step, metrics)
                    end.count(metrics["generated_tokens"])  # once the step is done: a redone step counts once
                except LearnerLost as err:
                    step = self._recover_learner(err)
                    continue
                end.observe(step, metrics)
                step += 1
                if spent:
                    break
        finally:
            in_flight = self.producers.stop()
            self.ledger.write({"end": step, "cursor": self.queue.cursor(), "in_flight": in_flight})
            self.ledger.close()
        return metrics

    def _save(self, end: StepEnd, step: int, metrics: dict[str, float]) -> None:
        if end.checkpoint is None:
            return
        self._watermarks[step + 1] = self.queue.cursor()["watermark"]  # what a checkpoint here holds
        end.save(step, metrics, self.queue.cursor())
        self._compact()

    def _compact(self) -> None:
        """Delete log segments wholly below the oldest committed checkpoint's cursor (none from before this process).

        A checkpoint saved before this process started (a resume) has an
        unknown watermark: nothing is compacted until retention removes it.
        """
        if self.store is None:
            return
        committed = [manifest.step for _, manifest in self.store.list_committed()]
        if not committed or any(s not in self._watermarks for s in committed):
            return
        self.queue.compact(min(self._watermarks[s] for s in committed))
        for s in [s for s in self._watermarks if s < min(committed)]:
            del self._watermarks[s]

    def _recover_learner(self, err: BaseException) -> int:
        while True:
            self.learner_restarts += 1
            if self.recover is None or self.learner_restarts > self.spec.queue.max_learner_restarts:
                raise RoleError(f"the learner died ({err}) and cannot be recovered "
                                f"({self.learner_restarts} restarts)", "resume the run from its newest checkpoint "
                                "with `rlctl resume`") from None
            try:
                with self.beat("restore", "learner"):
                    point = self.recover()  # restores the learner, publishes its weights
                    version = self.roles.learner.policy_version
                break
            except LearnerLost as again:  # it died again while being restored, or right after
                err = again
        self.queue.restore_cursor(point.queue_cursor if point.queue_cursor is not None else EMPTY_CURSOR)
        self._admit(point.step, version)
        self.ledger.write({"rewind": point.step, "cursor": self.queue.cursor()})
        return point.step

    def _admit(self, steps_done: int, version: int) -> None:
        """Move the queue's admission gate: by steps in the in-order modes, by versions in async."""
        self.queue.set_version(steps_done if self.spec.mode != "async" else version)

    # -- one step -------------------------------------------------------------------

    def _step(self, step: int, end: StepEnd) -> tuple[dict[str, float], tuple[Trajectory, ...]]:
        spec, counters = self.spec, self.producers.counters
        t0 = time.perf_counter()
        version = self.roles.learner.policy_version
        self._admit(step, version)
        with counters.lock:
            tokens0, wait0 = counters.generated_tokens, counters.rollout_wait_s
        key_below = (step + 1) * spec.prompts_per_step if spec.mode != "async" else None
        with self.beat("generate", "rollout", waits_for_threads=True):  # the producers generate and grade it
            taken = self._take(version, key_below)
        if not taken.groups:
            raise RoleError(f"step {step} has no trajectory group left to train on (dropped: {taken.drops})",
                            "raise staleness.queue_ttl_s or staleness.max_staleness")
        consumed = sum(g.num_tokens for g in taken.groups) + taken.dropped_tokens
        with counters.lock:  # the latencies of the groups generated while this step waited for them
            latencies, counters.latencies = counters.latencies, []
        outcome = self._train(step, version, taken, {"T_r": time.perf_counter() - t0, "T_v": 0.0}, latencies, {
            "generated_tokens": float(consumed), "generated_tokens_total": end.generated_total + consumed,
            "learner_wait_s": taken.waited_s, "learner_restarts": float(self.learner_restarts)})
        self._admit(step + 1, outcome.version)
        with counters.lock:
            generated = counters.generated_tokens - tokens0
            rollout_wait = (counters.rollout_wait_s - wait0) / max(1, len(self.fleet.workers))
            failures, requeued = counters.worker_failures, counters.requeued
        wall = time.perf_counter() - t0
        return {**outcome.metrics, **self._queue_metrics(taken), "rollout_wait_s": rollout_wait,
                "rollout_worker_failures": float(failures), "requeued_prompts": float(requeued),
                "generated_tokens_per_s": generated / wall if wall > 0 else 0.0,
                "effective_tokens_per_s": (generated / wall if wall > 0 else 0.0) * outcome.metrics["esr"]}, \
            outcome.samples

    def _train(self, step: int, version: int, taken: TakeResult, times: dict[str, float], latencies: list[float],
               driver: dict[str, float]) -> StepOutcome:
        """Select the taken groups, train on them, and write the step into the ledger."""
        g = self.spec.group_size
        by_first = {group.trajectories[0].id: group for group in taken.groups}
        selection = select_groups([t for group in taken.groups for t in group.trajectories],
                                  self.roles.estimator, g, self.spec.max_tokens)
        if not selection.kept and not selection.no_signal:
            raise unscorable_batch(selection.unscored, self.spec.verifier_retries)
        groups_of = lambda ts: [by_first[ts[i].id] for i in range(0, len(ts), g)]  # noqa: E731
        kept, unscored, no_signal = groups_of(selection.kept), groups_of(selection.unscored), \
            groups_of(selection.no_signal)
        dv = dict(zip((group.group_id for group in taken.groups), taken.staleness))
        inputs = StepInput(selection=selection, times=times, staleness=[dv[group.group_id] for group in kept],
                           reweighted=frozenset(i for i, group in enumerate(kept) if group.group_id in taken.weighted),
                           rollout_latencies=latencies, driver={**driver, **self._graded_metrics()})
        outcome = train_on(inputs, self.roles, self.spec, step=step, heartbeat=self.heartbeat)
        self.ledger.write({"step": step, "version": version,
                           "taken": [group.group_id for group in kept],
                           "dropped": taken.dropped_ids + [group.group_id for group in unscored + no_signal],
                           "weighted": [group.group_id for group in kept if group.group_id in taken.weighted],
                           "staleness": [dv[group.group_id] for group in kept]})
        return outcome

    def _graded_metrics(self) -> dict[str, float]:
        """The producers' grader counters since the previous step's report (every scored sample counts once)."""
        counters = self.producers.counters
        with counters.lock:
            now = counters.graded()
        graded = [a - b for a, b in zip(now, self._graded_reported)]
        self._graded_reported = now
        return {"verifier_fail_frac": graded[1] / graded[0] if graded[0] else 0.0,
                "verifier_retries": float(graded[2]), "verifier_recovered": float(graded[3])}

    def _queue_metrics(self, taken: TakeResult) -> dict[str, float]:
        stats = self.queue.stats()
        out = {"queue_depth": float(stats.depth), "queue_age_s": float(stats.oldest_age_s),
               "queue_duplicates": float(stats.duplicates),
               # partial rollout: groups of this step's batch left in flight for a later step (0 when waiting for all)
               "partial_carried_groups": float(max(0, self.spec.prompts_per_step - len(taken.groups)
                                                   - len(taken.dropped_ids)))}
        out.update({f"queue_drops_{reason}": float(stats.drops[reason]) for reason in DROP_REASONS})
        return out

    def _take(self, version: int, key_below: int | None) -> TakeResult:
        spec, producers = self.spec, self.producers
        deadline = time.monotonic() + spec.queue.take_timeout_s
        while True:
            if producers.error is not None:
                raise producers.error
            try:
                return self.queue.take(spec.prompts_per_step, version, max_staleness=spec.staleness_bound,
                                       stale_policy=spec.queue.stale_policy, key_below=key_below,
                                       min_groups=spec.min_groups,
                                       timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except QueueError as err:
                if producers.error is not None:  # a producer failed and closed the queue: report its error
                    raise producers.error from None
                if not isinstance(err, QueueTimeout):
                    raise
                if time.monotonic() >= deadline:
                    raise RoleError(f"the learner waited {spec.queue.take_timeout_s:.0f}s for a batch of "
                                    f"{spec.prompts_per_step} groups",
                                    "rollout workers are stuck or too slow; check their health or raise "
                                    "staleness.take_timeout_s") from None
