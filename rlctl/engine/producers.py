"""The overlapped driver's rollout side: workers that claim prompts, generate, score and put groups into the queue.

What this is: ``RolloutFleet`` (the rollout role of an overlapped run: the
placement's workers plus a ``WeightBoard`` holding the newest published
weights) and ``Producers``, one thread per worker. A producer claims draw keys
(prompt order) from the queue's admission gate, loads the newest published
weights, generates the G samples of each prompt on its one worker
(group-sticky), scores them -- re-scoring a sample whose grader timed out or
crashed with a fresh grader up to ``verifier_retries`` times, so retries never
hold up the learner -- and puts the groups into the TrajectoryQueue
(acknowledged once on disk). With ``staleness.continuous_rollout`` a worker
that can (``stream``: the local engine's decode sessions) runs one continuous
call instead: groups are queued as they end, new prompts are claimed into
the slots finished rows free, and newer weights are loaded mid-call.

Failures: a worker whose ``generate`` raises WorkerLost has its in-flight
prompts handed back (still reserved, so the learner keeps waiting for them)
and claimed again by any worker; after a short backoff it is restarted and
loads the current weights before it serves again, up to
``queue.max_worker_restarts`` times. Any other error stops every producer and
surfaces on the learner's thread.

What this is not: the learner loop (rlctl.engine.overlap) or where workers
live (threads or Ray actors: rlctl.placement).
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from rlctl.contracts.errors import RoleError, WorkerLost
from rlctl.contracts.types import RolloutRequest, Trajectory, WeightUpdate
from rlctl.engine.heartbeat import Heartbeat
from rlctl.engine.queue import Group, QueueError, TrajectoryQueue
from rlctl.engine.roles import Roles
from rlctl.engine.scoring import rescore_failed, retryable, score_all
from rlctl.engine.spec import LoopSpec


@runtime_checkable
class RolloutWorker(Protocol):
    """One rollout engine as the driver sees it (a backend on a thread, or a Ray actor's handle)."""

    name: str

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]: ...

    def load_weights(self, update: WeightUpdate) -> None: ...

    def restart(self) -> None:
        """Make the worker usable again after WorkerLost (a Ray actor restarts by itself: wait for it)."""
        ...

    def close(self) -> None: ...


def stream_backend(backend: Any, requests: Sequence[RolloutRequest], on_group: Callable[[int, list[Trajectory]], None],
                   more: Callable[[int, bool], Sequence[RolloutRequest] | None] | None = None) -> None:
    """A worker's ``stream``: the backend's continuous ``stream`` where it supports sessions, else ``generate`` of
    ``requests`` with each group handed out after the call (``more`` is not asked)."""
    if getattr(backend, "supports_sessions", lambda: False)():
        backend.stream(requests, on_group, more)
        return
    out, start = backend.generate(requests), 0
    for k, req in enumerate(requests):
        on_group(k, out[start:start + req.group_size])
        start += req.group_size


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


class RolloutFleet:
    """The rollout role of an overlapped run: the placement's workers behind one RolloutBackend.

    ``update_weights`` publishes (each worker loads a new version before its
    next call); ``generate`` serves callers outside the loop (the periodic
    eval) on the first worker with the newest weights, between its producer's
    calls: ``serving(worker)`` is the lock a worker's load-and-generate holds;
    ``close`` closes every worker.
    """

    def __init__(self, workers: Sequence[RolloutWorker]) -> None:
        self.workers, self.board = list(workers), WeightBoard()
        self._serving = {id(worker): threading.Lock() for worker in self.workers}
        self._wanted: set[int] = set()  # workers a caller outside the loop waits for (their stream ends)

    @property
    def policy_version(self) -> int:
        update = self.board.latest()[1]
        return update.version if update is not None else 0

    def update_weights(self, update: WeightUpdate) -> None:
        self.board.publish(update)

    def serving(self, worker: RolloutWorker) -> threading.Lock:
        """Held while ``worker`` loads weights and generates: one caller at a time per engine."""
        return self._serving[id(worker)]

    def wanted(self, worker: RolloutWorker) -> bool:
        """Whether a caller outside the loop waits for ``worker`` (a continuous call then ends)."""
        return id(worker) in self._wanted

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        worker, lock = self.workers[0], self.serving(self.workers[0])
        self._wanted.add(id(worker))  # a continuous call on it ends; the producer's load and generate finish first
        try:
            lock.acquire()
        finally:
            self._wanted.discard(id(worker))
        try:
            update = self.board.latest()[1]
            if update is not None:
                worker.load_weights(update)
            return worker.generate(requests)
        finally:
            lock.release()

    def health(self) -> Mapping[str, Any]:
        return {"workers": len(self.workers), "policy_version": self.policy_version}

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return {}  # each worker holds its own copy (a thread's backend or an actor's process)

    def use_run_dir(self, run_dir: str) -> None:
        """RunDirAware: hand the run directory to the workers whose backend keeps files there (engine logs)."""
        for worker in self.workers:
            if hasattr(worker, "use_run_dir"):
                worker.use_run_dir(run_dir)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


@dataclass
class Counters:
    """What the producers did since the run started; the learner reports deltas per step (hold ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    generated_tokens: int = 0
    latencies: list[float] = field(default_factory=list)
    rollout_wait_s: float = 0.0
    worker_failures: int = 0
    requeued: int = 0
    scored_samples: int = 0
    verifier_failed: int = 0  # samples whose first grader call timed out or crashed
    verifier_retries: int = 0
    verifier_recovered: int = 0

    def graded(self) -> tuple[int, int, int, int]:
        """(samples, first-call failures, retries, recovered); hold ``lock``."""
        return self.scored_samples, self.verifier_failed, self.verifier_retries, self.verifier_recovered


class Producers:
    """One producer thread per rollout worker, feeding ``queue``; see the module docstring."""

    def __init__(self, roles: Roles, spec: LoopSpec, fleet: RolloutFleet, queue: TrajectoryQueue,
                 heartbeat: Heartbeat, encode: Callable[[Any], RolloutRequest]) -> None:
        self.roles, self.spec, self.fleet, self.queue = roles, spec, fleet, queue
        self.beat, self.encode = heartbeat.phase, encode
        self.counters = Counters()
        self.answers = {r.id: r.answer for r in roles.task.train}
        self.chunk = spec.queue.rollout_chunk or max(1, -(-spec.prompts_per_step // max(1, len(fleet.workers))))
        self._flush_at = max(1, -(-spec.prompts_per_step // 4))  # a continuous call queues groups this many at a time
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._claim_lock = threading.Lock()
        self._score_lock = threading.Lock()
        self._requeue: deque[int] = deque()  # keys to reserve again (lost in flight before a resume)
        self._handback: deque[int] = deque()  # keys a dead worker gave back: still reserved, generated next
        self._threads: list[threading.Thread] = []
        self._next_key = 0

    def start(self) -> None:
        """Continue draw keys after the log (keys below it never acknowledged go first), start one thread each."""
        known = self.queue.known_keys()
        self._next_key = max(known, default=-1) + 1
        self._requeue.extend(sorted(set(range(self._next_key)) - known))
        self._threads = [threading.Thread(target=self._produce, args=(w,), name=f"rollout-{w.name}", daemon=True)
                         for w in self.fleet.workers]
        for thread in self._threads:
            thread.start()

    def stop(self) -> list[int]:
        """Stop every producer; the draw keys still in flight (reserved, handed back or to re-queue)."""
        self._stop.set()
        self.queue.close()
        for thread in self._threads:
            thread.join(timeout=60)
        with self._claim_lock:
            return sorted(set(self.queue.reserved_keys()) | set(self._requeue) | set(self._handback))

    def _claim(self, limit: int | None = None, wait_s: float = 0.2) -> list[int]:
        """Up to ``limit`` (default ``chunk``) admitted keys, re-queued ones first; [] when none was admitted within
        ``wait_s`` or stopping.

        The claim lock is never held across more than one wait: while one
        producer waits at the admission gate, another whose worker died must
        be able to give its keys back (holding the lock through the wait
        deadlocked the two when the gate waited for exactly those keys).
        """
        keys: list[int] = []
        limit = self.chunk if limit is None else limit
        with self._claim_lock:
            while self._handback and len(keys) < limit:
                keys.append(self._handback.popleft())
            while len(keys) < limit and not self._stop.is_set():
                key = self._requeue[0] if self._requeue else self._next_key
                waited = time.monotonic()
                try:
                    self.queue.reserve(key, timeout=wait_s if not keys else 0.0)
                except QueueError:  # timed out, or closed: let go of the lock, so that a producer whose
                    self._waited(waited)  # worker died can give its keys back
                    break
                self._waited(waited)
                if self._requeue and self._requeue[0] == key:
                    self._requeue.popleft()
                else:
                    self._next_key += 1
                keys.append(key)
        return keys

    def _waited(self, since: float) -> None:
        with self.counters.lock:
            self.counters.rollout_wait_s += time.monotonic() - since

    def _produce(self, worker: RolloutWorker) -> None:
        loaded, failures = -1, 0
        try:
            while not self._stop.is_set():
                keys = self._claim()
                if not keys:
                    continue
                try:
                    if self._streams(worker):
                        loaded = self._stream(worker, keys, loaded)
                        continue
                    loaded, trajectories, latency = self._generate(worker, keys, loaded)
                except WorkerLost as err:
                    failures += 1
                    self._give_back(keys)
                    self._restart(worker, failures, err)
                    loaded = -1
                    continue
                except BaseException:
                    self._give_back(keys)
                    raise
                self._put(keys, trajectories, latency)
        except BaseException as err:  # surfaced on the learner thread
            if not self._stop.is_set():
                self.error = err
                self._stop.set()
                self.queue.close()

    def _generate(self, worker: RolloutWorker, keys: Sequence[int],
                  loaded: int) -> tuple[int, list[Trajectory], float]:
        """Load the newest weights if this worker has not (a restarted worker serves only current weights), then
        generate; (the weights' generation now loaded, trajectories, latency)."""
        with self.fleet.serving(worker):  # not while the periodic eval uses this worker (RolloutFleet.generate)
            loaded = self._load(worker, loaded)
            started = time.perf_counter()
            with self.beat("generate", "rollout"):
                trajectories = worker.generate([self.encode(self.roles.cursor.record_at(k)) for k in keys])
        return loaded, trajectories, time.perf_counter() - started

    def _streams(self, worker: RolloutWorker) -> bool:
        return self.spec.queue.continuous and hasattr(worker, "stream")

    def _load(self, worker: RolloutWorker, loaded: int) -> int:
        """Load the newest weights if this worker has not; the weights' generation it holds now."""
        generation, update = self.fleet.board.latest()
        if generation != loaded and update is not None:
            with self.beat("publish", "rollout"):
                worker.load_weights(update)
            loaded = generation
        return loaded

    def _stream(self, worker: RolloutWorker, keys: list[int], loaded: int) -> int:
        """One continuous call: each group is scored and queued as soon as it ends (``_flush_at`` at a time), more
        keys are claimed as slots free up, and newer weights are handed to the worker as they are published (its
        rows in flight finish on the weights they started with). It ends when nothing is admitted while the worker
        is idle, on stop, or when the periodic eval waits for this worker. ``keys`` always holds the keys claimed
        and not yet queued (what a failure hands back); returns the weights' generation the worker holds."""
        with self.fleet.serving(worker):
            loaded = self._load(worker, loaded)
            taken, since = list(keys), [time.perf_counter()] * len(keys)
            ready: list[tuple[int, list[Trajectory]]] = []
            held = loaded

            def flush() -> None:
                done = [taken[k] for k, _ in ready]
                self._put(done, [t for _, group in ready for t in group],
                          statistics.mean(time.perf_counter() - since[k] for k, _ in ready))
                for key in done:
                    keys.remove(key)
                ready.clear()

            def on_group(k: int, trajectories: list[Trajectory]) -> None:
                ready.append((k, trajectories))
                if len(ready) >= self._flush_at:
                    flush()

            def more(free: int, idle: bool) -> Any:
                nonlocal held
                if self._stop.is_set() or self.fleet.wanted(worker):
                    return None
                generation, update = self.fleet.board.latest()
                if generation != held and update is not None:
                    held = generation
                    return update  # new keys go to the new weights; the gate may have opened for them already
                new = self._claim(limit=max(1, free // self.spec.group_size), wait_s=0.2 if idle else 0.0)
                if new and self.fleet.board.latest()[0] != held:  # published while claiming: the gate opened
                    with self._claim_lock:  # for newer weights; these keys go out after the worker has them
                        self._handback.extendleft(sorted(new, reverse=True))
                    return []
                taken.extend(new)
                keys.extend(new)
                since.extend([time.perf_counter()] * len(new))
                return [self.encode(self.roles.cursor.record_at(k)) for k in new]

            with self.beat("generate", "rollout"):
                worker.stream([self.encode(self.roles.cursor.record_at(k)) for k in taken], on_group, more)
                if ready:
                    flush()
        return held

    def _restart(self, worker: RolloutWorker, failures: int, err: WorkerLost) -> None:
        with self.counters.lock:
            self.counters.worker_failures += 1
        if failures > self.spec.queue.max_worker_restarts:
            raise RoleError(f"rollout worker {worker.name} died {failures} times ({err})",
                            "see the worker's log; raise cluster.max_restarts if the failures are transient") from None
        time.sleep(min(5.0, 0.2 * failures))  # give a dying engine (server, actor) time to come back
        try:
            worker.restart()
        except WorkerLost:
            pass  # not back yet: the next call fails again and counts as one more failure

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
        now = time.time()
        groups = [Group(group_id=f"d{key}", key=key, put_at=now,
                        trajectories=tuple(t.updated(id=f"d{key}/{j}") for j, t in enumerate(scored[i * g:(i + 1) * g])))
                  for i, key in enumerate(keys)]
        self.queue.put_many(groups)
        with self.counters.lock:
            self.counters.generated_tokens += sum(t.num_policy_tokens for t in trajectories)
            self.counters.latencies.extend([latency] * len(keys))

    def _score(self, trajectories: Sequence[Trajectory]) -> list[Trajectory]:
        """Score on this producer thread, then re-score timed-out / crashed samples with a fresh in-process grader
        (not the pool, so retries never wait for the pool's lock)."""
        roles, spec = self.roles, self.spec
        pool = roles.reward_pool  # reward.workers > 1: processes (local) or actors (Ray)
        with self._score_lock if pool is not None else contextlib.nullcontext():  # one producer drives the pool
            scored, _ = score_all(trajectories, self.answers, roles.reward, spec.truncation_penalty, pool=pool)
        failed = sum(1 for t in scored if retryable(t.reward_error))
        scored, stats = rescore_failed(scored, self.answers, roles.reward_factory or (lambda: roles.reward),
                                       spec.verifier_retries, spec.truncation_penalty)
        with self.counters.lock:
            self.counters.scored_samples += len(scored)
            self.counters.verifier_failed += failed
            self.counters.verifier_retries += int(stats["verifier_retries"])
            self.counters.verifier_recovered += int(stats["verifier_recovered"])
        return scored
