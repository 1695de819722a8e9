"""Overlapped RL loop: rollout workers feed a durable queue, the learner trains from it.

What this is: ``run_async`` for ``mode: sync | one_step_off | async``. One
producer thread per rollout worker claims draw keys (prompt order) from the
queue's admission gate, loads the newest published weights, generates the G
samples of each prompt on that one worker (group-sticky), scores them and puts
the groups into the TrajectoryQueue (acknowledged once on disk). The learner,
on the calling thread, takes B groups, trains, publishes weights, logs, and
checkpoints together with the queue cursor.

Grader failures follow the synchronous loop's policy: the producer re-scores a
sample whose grader timed out or crashed with a fresh grader up to
``verifier_retries`` times (rlctl.engine.scoring.rescore_failed; a verdict
such as ``invalid_reward`` is not retried), before the group goes into the
queue, so retries never hold up the learner. A group still holding a sample
without a reward is dropped whole when the learner takes it (recorded in the
ledger as dropped, counted in ``groups_dropped``), never scored 0 or trained
partially; each step reports ``verifier_fail_frac``, ``verifier_retries`` and
``verifier_recovered`` for the samples the producers scored since the previous
step's report (whichever step later trains them).

The three modes differ only in how far rollout may run ahead (``max_ahead``):
sync 0 (batch s is generated with version s, so Δv = 0), one_step_off 1
(batch s+1 is generated while the learner trains on batch s), async
``max_staleness`` with per-group weight pickup; the learner takes batch s in
draw order in the first two, oldest-first among whatever is ready in async.
Admission follows the clock each mode takes by: learner steps in sync and
one_step_off (step s takes draw keys below (s + 1) * B, so a step that leaves
the policy as it was, such as a critic warm-up step, still lets the next batch
in), policy versions in async (``max_staleness`` counts versions).
Δv beyond ``max_staleness`` is dropped or reweighted (truncated importance
sampling) and always counted. Partial rollout (``partial_fraction`` < 1): a
step proceeds once that share of its B groups is ready; the groups still in
flight carry over to a later step (oldest first), each with the policy version
it was generated under, so the Δv bound applies to them as to any other.

Failures: a worker whose ``generate`` raises ``WorkerLost`` (the local
placement maps a backend's RolloutUnavailable / RuntimeError / OSError to it,
the Ray placement a dead actor) has its in-flight prompts released and claimed
again (by any worker); after a short backoff it is restarted and loads the
current weights before it serves again. A learner that raises
``LearnerLost`` is recovered through ``recover`` (restore the newest
checkpoint, including the queue cursor) and training continues from that
step; the trajectory ledger records the rewind so an audit can rebuild the
committed history.

Progress: the learner thread and the producer threads beat through the
run's ``heartbeat`` (rlctl.engine.heartbeat) around every call that can block
on a role. The learner's wait for a batch is the phase ``generate`` (role
rollout, waiting for threads: the producers generate and grade what it waits for).

What this is not: placement (rlctl.dist builds the workers, in threads or as
Ray actors) or run bookkeeping (rlctl.ops.train).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.contracts.roles import MetricSink
from rlctl.contracts.types import RolloutRequest, Trajectory, WeightUpdate
from rlctl.engine.batching import build_batch, group_rewards
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.metrics import _quantile, step_metrics
from rlctl.engine.queue import DROP_REASONS, Group, QueueError, QueueTimeout, TrajectoryQueue
from rlctl.engine.scoring import rescore_failed, retryable, score_all

MODES = ("sync", "one_step_off", "async")


class WorkerLost(Exception):
    """A rollout worker died (process killed, actor lost) while serving a call."""


class LearnerLost(Exception):
    """The learner died; its state must be restored from the newest checkpoint."""


class RolloutWorker(Protocol):
    """One rollout engine as the driver sees it (a thread-local backend or a Ray actor)."""

    name: str

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]: ...

    def load_weights(self, update: WeightUpdate) -> None: ...

    def restart(self) -> None:
        """Make the worker usable again after WorkerLost (a Ray actor restarts by itself: wait for it)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class AsyncSpec:
    """The few numbers the overlapped loop needs (never the whole run config)."""

    mode: str
    steps: int
    prompts_per_step: int  # B
    group_size: int  # G
    max_staleness: int = 1
    stale_policy: str = "drop"
    is_cap: float = 2.0
    queue_capacity: int | None = None  # groups buffered + in flight; None = (max_ahead + 1) * B
    queue_ttl_s: float | None = None
    rollout_chunk: int | None = None  # prompts per worker call; None = ceil(B / workers)
    take_timeout_s: float = 600.0
    queue_segment_bytes: int = 64 << 20
    partial_fraction: float = 1.0  # a step proceeds once this share of its B groups is ready (1 = all)
    max_worker_restarts: int = 3
    max_learner_restarts: int = 3
    log_every: int = 1
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_placement: str = "loss"
    normalize_std: bool = True
    truncation_penalty: float | None = 0.0
    max_tokens: int = 0  # rollout.max_tokens: estimators that shape rewards by length read it
    critic_warmup_steps: int = 0  # steps that train only the critic (read only when the session has one)
    verifier_retries: int = 0  # re-score a timed-out / crashed sample with a fresh grader up to N times

    @property
    def max_ahead(self) -> int:
        return {"sync": 0, "one_step_off": 1}.get(self.mode, self.max_staleness)

    @property
    def staleness_bound(self) -> int:
        return self.max_ahead

    @property
    def min_groups(self) -> int | None:
        """Partial rollout: the fewest groups a step proceeds with; None = the whole batch."""
        if self.partial_fraction >= 1:
            return None
        return max(1, math.ceil(self.partial_fraction * self.prompts_per_step))

    @property
    def capacity(self) -> int:
        return self.queue_capacity or (self.max_ahead + 1) * self.prompts_per_step

    @classmethod
    def from_config(cls, config: Any) -> "AsyncSpec":
        s, a = config.staleness, config.algo
        return cls(mode=config.mode, steps=config.train.steps, prompts_per_step=a.prompts_per_step,
                   group_size=a.group_size, max_staleness=s.max_staleness, stale_policy=s.stale_policy,
                   is_cap=s.is_cap, queue_capacity=s.queue_capacity, queue_ttl_s=s.queue_ttl_s,
                   rollout_chunk=s.rollout_chunk, take_timeout_s=s.take_timeout_s,
                   queue_segment_bytes=s.queue_segment_bytes, partial_fraction=s.partial_fraction,
                   max_worker_restarts=config.cluster.max_restarts, max_learner_restarts=config.cluster.max_restarts,
                   log_every=config.train.log_every, kl_coef=a.kl.coef, kl_estimator=a.kl.estimator,
                   kl_placement=a.kl.placement, normalize_std=a.normalize_std,
                   truncation_penalty=config.rollout.truncation_penalty, max_tokens=config.rollout.max_tokens,
                   critic_warmup_steps=a.critic.warmup_steps, verifier_retries=config.faults.verifier_retries)


class WeightBoard:
    """The newest published weights; ``generation`` grows on every publish (also when a restore goes back)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = 0
        self.update: WeightUpdate | None = None

    def publish(self, update: WeightUpdate) -> None:
        with self._lock:
            self.generation += 1
            self.update = update

    def latest(self) -> tuple[int, WeightUpdate | None]:
        with self._lock:
            return self.generation, self.update


class Ledger:
    """Append-only, fsynced record of what each step trained and dropped (and of rewinds)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, entry: Mapping[str, Any]) -> None:
        os.write(self._fd, (json.dumps(entry, sort_keys=True) + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class _Counters:
    lock: threading.Lock = field(default_factory=threading.Lock)
    generated_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    rollout_wait_s: float = 0.0
    worker_failures: int = 0
    requeued: int = 0
    scored_samples: int = 0  # grader accounting of the producers (rescore_failed), read as deltas per step
    verifier_failed: int = 0  # samples whose first grader call timed out or crashed
    verifier_retries: int = 0
    verifier_recovered: int = 0


class WorkerPool:
    """Stands in for ``session.rollout`` during an overlapped run: weight updates go to every worker.

    ``update_weights`` publishes (workers load it before their next call);
    ``generate`` serves callers outside the loop (e.g. a checkpoint restore
    never generates, but evaluation may) on the first worker.
    """

    def __init__(self, workers: Sequence[RolloutWorker], board: WeightBoard) -> None:
        self.workers, self.board = list(workers), board

    @property
    def policy_version(self) -> int:
        update = self.board.latest()[1]
        return update.version if update is not None else 0

    def update_weights(self, update: WeightUpdate) -> None:
        self.board.publish(update)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        worker = self.workers[0]
        update = self.board.latest()[1]
        if update is not None:
            worker.load_weights(update)
        return worker.generate(requests)

    def health(self) -> Mapping[str, Any]:
        return {"workers": len(self.workers), "policy_version": self.policy_version}

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return {}  # each worker holds its own copy (a thread's backend or an actor's process)

    def close(self) -> None:
        for worker in self.workers:
            close = getattr(worker, "close", None)
            if close is not None:
                close()


Recover = Callable[[], int]  # restore the newest checkpoint into the session; return its step (0 = fresh)


class AsyncDriver:
    """Owns the producer threads and the learner loop of one overlapped run."""

    def __init__(self, session: Any, spec: AsyncSpec, workers: Sequence[RolloutWorker], queue_dir: Path, *,
                 recover: Recover | None = None, store: Any = None,
                 heartbeat: Heartbeat = NO_HEARTBEAT) -> None:
        if spec.mode not in MODES:
            raise RoleError(f"unknown mode {spec.mode!r}", f"use one of {', '.join(MODES)}")
        if spec.capacity < spec.prompts_per_step:
            raise RoleError(f"the queue capacity {spec.capacity} is below one batch of {spec.prompts_per_step} "
                            "groups, so the learner could never fill a step",
                            "raise staleness.queue_capacity to at least algo.prompts_per_step")
        self.session, self.spec, self.workers = session, spec, list(workers)
        self.recover = recover
        self.beat = heartbeat.phase  # the driver thread and every producer thread beat through it
        queue_dir.mkdir(parents=True, exist_ok=True)
        self.queue = TrajectoryQueue(queue_dir, capacity=spec.capacity, batch_groups=spec.prompts_per_step,
                                     max_ahead=spec.max_ahead, ttl_s=spec.queue_ttl_s,
                                     segment_bytes=spec.queue_segment_bytes)
        self.store = store  # the checkpoint store: compaction keeps the log of every committed checkpoint
        self._watermarks: dict[int, int] = {}  # steps done -> queue watermark then (what a checkpoint there holds)
        self.ledger = Ledger(queue_dir / "ledger.jsonl")
        self.board = WeightBoard()
        self.counters = _Counters()
        self._graded_reported = (0, 0, 0, 0)  # the producers' grader counters up to the last step's metrics
        self._claim_lock = threading.Lock()
        self._score_lock = threading.Lock()
        self._requeue: deque[int] = deque()  # keys to reserve again (lost in flight before a resume)
        self._handback: deque[int] = deque()  # keys a dead worker gave back: still reserved, generated next
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._threads: list[threading.Thread] = []
        self._encoded: dict[str, tuple[int, ...]] = {}
        self._answers = {r.id: r.answer for r in session.task.train}
        self.learner_restarts = 0
        self.chunk = spec.rollout_chunk or max(1, -(-spec.prompts_per_step // max(1, len(self.workers))))
        self._next_key = 0

    # -- prompts --------------------------------------------------------------------

    def _request(self, key: int) -> RolloutRequest:
        record = self.session.cursor.record_at(key)
        if record.id not in self._encoded:
            self._encoded[record.id] = tuple(self.session.tokenizer(record.text)["input_ids"])
        return RolloutRequest(prompt_id=record.id, prompt_tokens=self._encoded[record.id],
                              group_size=self.spec.group_size, sampling=self.session.sampling,
                              dataset_version=self.session.task.version)

    def _resume_keys(self) -> None:
        """Draw keys continue after the log; keys below that never acknowledged (lost in flight) go first."""
        known = self.queue.known_keys()
        self._next_key = max(known, default=-1) + 1
        self._requeue.extend(sorted(set(range(self._next_key)) - known))

    def _claim(self) -> list[int]:
        """Up to ``chunk`` admitted keys, re-queued ones first; [] when none was admitted within 0.2 s or stopping.

        The claim lock is never held across more than one wait: while one
        producer waits at the admission gate, another whose worker died must
        be able to give its keys back (holding the lock through the wait
        deadlocked the two when the gate waited for exactly those keys).
        """
        keys: list[int] = []
        with self._claim_lock:
            while self._handback and len(keys) < self.chunk:
                keys.append(self._handback.popleft())
            while len(keys) < self.chunk and not self._stop.is_set():
                key = self._requeue[0] if self._requeue else self._next_key
                waited = time.monotonic()
                try:
                    self.queue.reserve(key, timeout=0.2 if not keys else 0.0)
                except QueueTimeout:
                    with self.counters.lock:
                        self.counters.rollout_wait_s += time.monotonic() - waited
                    break  # let go of the lock: a producer whose worker died must give its keys back
                except QueueError:
                    break
                with self.counters.lock:
                    self.counters.rollout_wait_s += time.monotonic() - waited
                if self._requeue and self._requeue[0] == key:
                    self._requeue.popleft()
                else:
                    self._next_key += 1
                keys.append(key)
        return keys

    # -- producers ------------------------------------------------------------------

    def _produce(self, worker: RolloutWorker) -> None:
        loaded = -1
        failures = 0
        try:
            while not self._stop.is_set():
                keys = self._claim()
                if not keys:
                    continue
                generation, update = self.board.latest()
                try:
                    if generation != loaded and update is not None:
                        with self.beat("publish", "rollout"):
                            worker.load_weights(update)  # a (re)started worker serves only current weights
                        loaded = generation
                    started = time.perf_counter()
                    with self.beat("generate", "rollout"):
                        trajectories = worker.generate([self._request(k) for k in keys])
                    latency = time.perf_counter() - started
                except WorkerLost as err:
                    failures += 1
                    self._give_back(keys)
                    with self.counters.lock:
                        self.counters.worker_failures += 1
                    if failures > self.spec.max_worker_restarts:
                        raise RoleError(f"rollout worker {worker.name} died {failures} times ({err})",
                                        "see the worker's log; raise cluster.max_restarts if the failures are "
                                        "transient") from None
                    loaded = -1
                    time.sleep(min(5.0, 0.2 * failures))  # give a dying engine (server, actor) time to come back
                    try:
                        worker.restart()
                    except WorkerLost:
                        pass  # not back yet: the next call fails again and counts as one more failure
                    continue
                except BaseException:
                    self._give_back(keys)
                    raise
                self._put(keys, trajectories, latency)
        except BaseException as err:  # surfaced on the learner thread
            if not self._stop.is_set():
                self._error = err
                self._stop.set()
                self.queue.close()

    def _give_back(self, keys: Sequence[int]) -> None:
        """A dead worker's keys go to the next claim; they stay reserved, so the learner keeps waiting for them
        (released, a take could find every key below its batch resolved and return a short or empty batch)."""
        with self._claim_lock:
            self._handback.extendleft(sorted(keys, reverse=True))
        with self.counters.lock:
            self.counters.requeued += len(keys)

    def _put(self, keys: Sequence[int], trajectories: Sequence[Trajectory], latency: float) -> None:
        g = self.spec.group_size
        if len(trajectories) != g * len(keys):
            raise RoleError(f"a rollout worker returned {len(trajectories)} trajectories for {len(keys)} prompts "
                            f"x {g} samples", "the rollout backend must return group_size samples per request")
        with self.beat("score", "reward"):  # grading, the pool's turn and the retries included
            scored = self._score(trajectories)
        groups = []
        now = time.time()
        for i, key in enumerate(keys):
            gid = f"d{key}"
            samples = tuple(t.updated(id=f"{gid}/{j}") for j, t in enumerate(scored[i * g:(i + 1) * g]))
            groups.append(Group(group_id=gid, key=key, trajectories=samples, put_at=now))
        self.queue.put_many(groups)
        with self.counters.lock:
            self.counters.generated_tokens += sum(t.num_response_tokens for t in trajectories)
            self.counters.latencies.extend([latency] * len(keys))

    def _score(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """Score on this producer thread, then re-score timed-out / crashed samples as the synchronous loop does.

        The retries use a fresh in-process grader (``session.reward_factory``),
        not the pool, so they never wait for the pool's lock.
        """
        s = self.session
        pool = s.reward_pool  # reward.workers > 1: processes (local) or actors (Ray)
        with self._score_lock if pool is not None else contextlib.nullcontext():  # one producer drives the pool
            scored, _ = score_all(trajectories, self._answers, s.reward, self.spec.truncation_penalty, pool=pool)
        failed = sum(1 for t in scored if retryable(t.reward_error))
        scored, stats = rescore_failed(scored, self._answers, s.reward_factory or (lambda: s.reward),
                                       self.spec.verifier_retries, self.spec.truncation_penalty)
        with self.counters.lock:
            self.counters.scored_samples += len(scored)
            self.counters.verifier_failed += failed
            self.counters.verifier_retries += int(stats["verifier_retries"])
            self.counters.verifier_recovered += int(stats["verifier_recovered"])
        return scored

    # -- learner --------------------------------------------------------------------

    def run(self, sinks: Sequence[MetricSink], observer: Callable[[int, Mapping[str, float]], None] | None = None,
            start_step: int = 0, checkpoint: Any = None) -> dict[str, float]:
        s, spec = self.session, self.spec
        cursor = getattr(s, "queue_cursor", None)
        if cursor is not None:
            self.queue.restore_cursor(cursor)
        s.queue = self.queue
        self._resume_keys()
        self.ledger.write({"start": start_step, "cursor": self.queue.cursor()})
        with self.beat("publish", "learner"):
            self.board.publish(s.learner.export_weights())
        self._admit(start_step, s.learner.policy_version)
        self._threads = [threading.Thread(target=self._produce, args=(w,), name=f"rollout-{w.name}", daemon=True)
                         for w in self.workers]
        for thread in self._threads:
            thread.start()
        metrics: dict[str, float] = {}
        step = start_step
        try:
            while step < spec.steps:
                try:
                    metrics = self._step(step)
                except LearnerLost as err:
                    step = self._recover_learner(err)
                    continue
                if step % spec.log_every == 0 or step == spec.steps - 1:
                    for sink in sinks:
                        sink.write(step, metrics)
                if checkpoint is not None:
                    self._watermarks[step + 1] = self.queue.cursor()["watermark"]  # what a checkpoint here holds
                    try:
                        with self.beat("save", "checkpoint"):
                            checkpoint.after_step(step + 1, metrics)
                    except LearnerLost as err:
                        step = self._recover_learner(err)
                        continue
                    self._compact()
                if observer is not None:
                    observer(step, metrics)
                step += 1
        finally:
            self.stop()
            with self._claim_lock:
                in_flight = sorted(set(self.queue.reserved_keys()) | set(self._requeue) | set(self._handback))
            self.ledger.write({"end": step, "cursor": self.queue.cursor(), "in_flight": in_flight})
            self.ledger.close()
        return metrics

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
        floor = min(self._watermarks[s] for s in committed)
        self.queue.compact(floor)
        for s in [s for s in self._watermarks if s < min(committed)]:
            del self._watermarks[s]

    def _recover_learner(self, err: BaseException) -> int:
        while True:
            self.learner_restarts += 1
            if self.recover is None or self.learner_restarts > self.spec.max_learner_restarts:
                raise RoleError(f"the learner died ({err}) and cannot be recovered "
                                f"({self.learner_restarts} restarts)", "resume the run from its newest checkpoint "
                                "with `rlctl resume`") from None
            try:
                with self.beat("restore", "learner"):
                    step = self.recover()  # sets session.queue_cursor, publishes the restored weights
                    version = self.session.learner.policy_version
                break
            except LearnerLost as again:  # it died again while being restored, or right after
                err = again
        cursor = getattr(self.session, "queue_cursor", None)
        self.queue.restore_cursor(cursor if cursor is not None else {"watermark": 0, "resolved": [], "drops": {}})
        self._admit(step, version)
        self.ledger.write({"rewind": step, "cursor": self.queue.cursor()})
        return step

    def _admit(self, steps_done: int, version: int) -> None:
        """Move the queue's admission gate: by steps in the in-order modes, the clock their ``key_below`` uses."""
        self.queue.set_version(steps_done if self.spec.mode != "async" else version)

    def _step(self, step: int) -> dict[str, float]:
        import torch

        from rlctl.algo.importance import lag_divergence, truncated_is_weights
        from rlctl.engine.estimation import estimate, unscorable_batch

        s, spec = self.session, self.spec
        t0 = time.perf_counter()
        version = s.learner.policy_version
        self._admit(step, version)
        with self.counters.lock:
            tokens0, wait0 = self.counters.generated_tokens, self.counters.rollout_wait_s
            self.counters.latencies = []
        key_below = (step + 1) * spec.prompts_per_step if spec.mode != "async" else None
        with self.beat("generate", "rollout", waits_for_threads=True):  # the producers generate and grade it
            taken = self._take(version, key_below)
        if self._error is not None:
            raise self._error
        if not taken.groups:
            raise RoleError(f"step {step} has no trajectory group left to train on (dropped: {taken.drops})",
                            "raise staleness.queue_ttl_s or staleness.max_staleness")
        t1 = time.perf_counter()
        # a group with a sample still unscored after the producer's retries is dropped whole, as in the sync loop
        scorable: list[Group] = []
        unscored: list[Group] = []
        for group in taken.groups:
            (unscored if any(t.reward_error is not None for t in group.trajectories) else scorable).append(group)
        lost = [t for g in unscored for t in g.trajectories]
        if not scorable:
            raise unscorable_batch(lost, spec.verifier_retries)
        groups, rewards, valid, no_signal = self._signal(scorable)  # rewards, valid: [B', G]
        kept_ids = {g.group_id for g in groups}
        staleness = [dv for g, dv in zip(taken.groups, taken.staleness) if g.group_id in kept_ids]
        scored = [t for g in groups for t in g.trajectories]
        batch = build_batch(scored, [0.0] * len(scored), s.tokenizer.pad_token_id, s.sampling)
        mu, mask = batch.behavior_logprobs, batch.action_mask  # [N, T]: as generated (reweighting replaces some)
        trains_policy = s.critic is None or step >= spec.critic_warmup_steps  # the critic's warm-up leaves it as is
        # prox: log pi_learner of the trained tokens before this update, [N, T]. A learner with
        # train_step_with_logprobs returns them from its training forward (no second pass, no second batch
        # transfer to a learner actor); the reweighted path needs them before the update, to build the batch.
        capture = getattr(s.learner, "train_step_with_logprobs", None) if trains_policy else None
        with self.beat("train", "learner"):
            prox = s.learner.logprobs(batch).float() if taken.weighted or capture is None else None
        weight = torch.ones_like(batch.action_mask)  # [N, T]
        if taken.weighted:
            rows = [i for i, g in enumerate(groups) if g.group_id in set(taken.weighted)
                    for i in range(i * spec.group_size, (i + 1) * spec.group_size)]
            w = truncated_is_weights(prox, batch.behavior_logprobs, batch.action_mask, spec.is_cap)
            weight[rows] = w[rows]
            behavior = batch.behavior_logprobs.clone()
            behavior[rows] = prox[rows]  # decoupled PPO: the clip is taken against the learner's own policy
            batch = replace(batch, behavior_logprobs=behavior)
        est = estimate(estimator=s.estimator, batch=batch, rewards=rewards, valid=valid,
                       kl_coef=spec.kl_coef if spec.kl_placement == "reward" else 0.0, kl_estimator=spec.kl_estimator,
                       ref_logprobs=s.learner.ref_logprobs, values=s.critic.values if s.critic is not None else None)
        advantages, adv_stats = est.advantages.float() * weight, est.stats  # [N, T]
        batch = replace(batch, advantages=advantages)
        learner_stats: dict[str, float] = {}
        if s.critic is not None:  # the critic regresses onto returns of the values the advantages used
            with self.beat("train", "critic"):
                learner_stats.update(s.critic.train_step(batch, est.returns, est.values))
        with self.beat("train", "learner"):
            if trains_policy and prox is None:
                trained, before = capture(batch)
                learner_stats.update(trained)
                prox = before.float()
            elif trains_policy:
                learner_stats.update(s.learner.train_step(batch))
        dlag = lag_divergence(prox, mu, mask).tolist()  # [N]: mean |log pi_learner - log mu| per sample
        t2 = time.perf_counter()
        with self.beat("publish", "learner"):
            update = s.learner.export_weights()  # carries the new policy_version (one learner actor call)
        with self.beat("publish", "rollout"):
            s.rollout.update_weights(update)
        self._admit(step + 1, update.version)
        t3 = time.perf_counter()
        self.ledger.write({"step": step, "version": version, "taken": [g.group_id for g in groups],
                           "dropped": taken.dropped_ids + [g.group_id for g in unscored] + no_signal,
                           "weighted": taken.weighted,
                           "staleness": staleness})
        with self.counters.lock:
            generated = self.counters.generated_tokens - tokens0
            rollout_wait = (self.counters.rollout_wait_s - wait0) / max(1, len(self.workers))
            latencies = list(self.counters.latencies)
            failures, requeued = self.counters.worker_failures, self.counters.requeued
            now_graded = self._graded()
        graded = [now - before for now, before in zip(now_graded, self._graded_reported)]
        self._graded_reported = now_graded  # the next step reports from here: every scored sample counts once
        wall = t3 - t0
        metrics = step_metrics(scored=scored, learner_stats=learner_stats, adv_stats=adv_stats,
                               advantages=advantages.abs().sum(-1),
                               verify_latencies=[], learner_version=update.version,
                               times={"T_r": t1 - t0, "T_v": 0.0, "T_l": t2 - t1, "T_s": t3 - t2},
                               trained_version=version, dropped=lost, group_size=spec.group_size)
        metrics.update(verifier_fail_frac=graded[1] / graded[0] if graded[0] else 0.0,
                       verifier_retries=float(graded[2]), verifier_recovered=float(graded[3]))
        metrics.update(overlap_metrics(staleness=[dv for dv in staleness for _ in range(spec.group_size)],
                                       dlag=dlag, latencies=latencies, bound=spec.staleness_bound))
        stats = self.queue.stats()
        metrics.update({
            "generated_tokens_per_s": generated / wall if wall > 0 else 0.0,
            "effective_tokens_per_s": (generated / wall if wall > 0 else 0.0) * metrics["esr"],
            "learner_wait_s": taken.waited_s, "rollout_wait_s": rollout_wait,
            "queue_depth": float(stats.depth), "queue_age_s": float(stats.oldest_age_s),
            "queue_duplicates": float(stats.duplicates), "groups_trained": float(len(groups)),
            "ds_dropped_groups": float(len(no_signal)),
            "reweighted_groups": float(len(taken.weighted)), "rollout_worker_failures": float(failures),
            "requeued_prompts": float(requeued), "learner_restarts": float(self.learner_restarts),
            # partial rollout: groups of this step's batch left in flight for a later step (0 when waiting for all)
            "partial_carried_groups": float(max(0, spec.prompts_per_step - len(taken.groups)
                                                - len(taken.dropped_ids))),
        })
        for reason in DROP_REASONS:
            metrics[f"queue_drops_{reason}"] = float(stats.drops[reason])
        return metrics

    def _graded(self) -> tuple[int, int, int, int]:
        """The producers' grader counters (samples, first-call failures, retries, recovered); hold counters.lock."""
        c = self.counters
        return c.scored_samples, c.verifier_failed, c.verifier_retries, c.verifier_recovered

    def _signal(self, taken: Sequence[Group]) -> tuple[list[Group], Any, Any, list[str]]:
        """Shaped rewards of the taken groups, less those the estimator filters out (DAPO's zero-signal groups).

        When no group carries signal, all are trained (zero advantages, zero
        gradient), as in the synchronous loop. Filtered ids go to the ledger as dropped.
        """
        import torch

        s, g = self.session, self.spec.group_size
        scored = [t for group in taken for t in group.trajectories]
        rewards, valid = group_rewards(scored, g)  # [B', G]
        lengths = torch.tensor([t.num_response_tokens for t in scored]).view_as(rewards)
        rewards = s.estimator.shape_rewards(rewards, lengths, self.spec.max_tokens)
        keep = s.estimator.keep_groups(rewards, valid)  # [B'] bool
        if bool(keep.all()) or not bool(keep.any()):
            return list(taken), rewards, valid, []
        kept = [i for i in range(len(taken)) if bool(keep[i])]
        return ([taken[i] for i in kept], rewards[kept], valid[kept],
                [taken[i].group_id for i in range(len(taken)) if not bool(keep[i])])

    def _take(self, version: int, key_below: int | None) -> Any:
        deadline = time.monotonic() + self.spec.take_timeout_s
        while True:
            if self._error is not None:
                raise self._error
            try:
                return self.queue.take(self.spec.prompts_per_step, version, max_staleness=self.spec.staleness_bound,
                                       stale_policy=self.spec.stale_policy, key_below=key_below,
                                       min_groups=self.spec.min_groups,
                                       timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except QueueError as err:
                if self._error is not None:  # a producer failed and closed the queue: report its error
                    raise self._error from None
                if not isinstance(err, QueueTimeout):
                    raise
                if time.monotonic() >= deadline:
                    raise RoleError(f"the learner waited {self.spec.take_timeout_s:.0f}s for a batch of "
                                    f"{self.spec.prompts_per_step} groups",
                                    "rollout workers are stuck or too slow; check their health or raise "
                                    "staleness.take_timeout_s") from None

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        for thread in self._threads:
            thread.join(timeout=60)


def overlap_metrics(*, staleness: Sequence[int], dlag: Sequence[float], latencies: Sequence[float],
                    bound: int) -> dict[str, float]:
    """Δv, D_lag and rollout-latency percentiles plus bound violations; the same names in every placement."""
    out: dict[str, float] = {}
    for q, label in ((0.5, "p50"), (0.95, "p95"), (0.99, "p99")):
        out[f"staleness_{label}"] = _quantile([float(x) for x in staleness], q)
        out[f"dlag_{label}"] = _quantile(list(dlag), q)
        out[f"rollout_latency_{label}_s"] = _quantile(list(latencies), q)
    out["staleness_mean"] = float(sum(staleness) / len(staleness)) if staleness else 0.0
    out["staleness_max"] = float(max(staleness, default=0))
    out["staleness_violations"] = float(sum(1 for x in staleness if x > bound))
    return out


# -- audit ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Audit:
    """The committed training history rebuilt from the ledger, checked against the log and the final cursor."""

    steps: int
    trained: int
    double_counted: int
    dropped: int
    lost: tuple[str, ...]  # acknowledged groups consumed by the cursor but never trained, or skipped draw keys
    pending: int  # acknowledged, not yet trained: buffered for the next step or a resume
    max_staleness: int


def audit(queue_dir: Path) -> Audit:
    """Rebuild what each committed step trained (a start or rewind discards later steps); find loss or repeats."""
    history: dict[int, Mapping[str, Any]] = {}
    final: Mapping[str, Any] | None = None
    for line in (queue_dir / "ledger.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if "step" in entry:
            history[int(entry["step"])] = entry
            final = None
        elif "rewind" in entry or "start" in entry:
            floor = int(entry.get("rewind", entry.get("start", 0)))
            history = {k: v for k, v in history.items() if k < floor}
            final = None
        elif "end" in entry:
            final = entry
    trained = [gid for k in sorted(history) for gid in history[k]["taken"]]
    dropped = {gid for k in history for gid in history[k]["dropped"]}
    queue = TrajectoryQueue(queue_dir)
    try:
        logged = {g.group_id: g for g in queue._iter_log()}
        compacted = queue.known_keys() - {g.key for g in logged.values()}
    finally:
        queue.close()
    done = set(trained) | dropped
    lost: list[str] = []
    if final is not None:
        cursor = final["cursor"]
        consumed = set(cursor["resolved"])
        for gid, group in logged.items():
            if gid not in done and (group.seq < cursor["watermark"] or group.seq in consumed):
                lost.append(gid)  # the cursor says consumed, the history never trained or dropped it
        top = max((logged[g].key for g in done if g in logged), default=-1)
        keys = {g.key for g in logged.values()} | compacted | set(final.get("in_flight", ()))
        lost += [f"d{k}" for k in range(top + 1) if k not in keys]  # a drawn prompt never acknowledged
    staleness = [dv for k in history for dv in history[k].get("staleness", ())]
    return Audit(steps=len(history), trained=len(trained), double_counted=len(trained) - len(set(trained)),
                 dropped=len(dropped), lost=tuple(lost), pending=sum(1 for g in logged if g not in done),
                 max_staleness=max(staleness, default=0))
