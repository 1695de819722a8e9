"""The engine thread of ``rlctl serve rollout``: fair batching, isolation, cancellation, weight updates.

What this is: one thread owns the rollout backend. HTTP handler threads
submit jobs and wait on them. Rules:

- Fair scheduling: every engine batch holds at most ``max_batch_rows`` rows,
  shared evenly among the requests waiting (round robin), so a request at the
  size limit is served in slices while small requests that arrive meanwhile
  go into the next batch instead of waiting for the big one to finish. Rows
  are grouped by sampling config, because one engine call samples one
  distribution.
- Isolation: when an engine call fails for a batch holding several
  requests, each request is retried alone, so only the one that fails gets
  the error.
- Cancellation: a job whose client went away (or every job, on shutdown) is
  cancelled; the engine checks between decode steps (backends whose
  ``generate`` takes ``cancelled=``) and stops its rows, so no core keeps
  working for nobody.
- Weight updates are jobs too and run between batches: a batch sees the old
  weights or the new ones, never a mix, and every row carries the weight
  version it was sampled under (a request served in several slices may
  straddle an update; each answer says which version produced it).

What this is not: continuous batching (a request that arrives while a batch
runs waits for that batch, whose length ``max_new_tokens`` bounds); that is
continuous.py's ContinuousWorker, the default where the engine can run it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.contracts.roles import CancellableRollout
from rlctl.contracts.types import RolloutRequest, Trajectory
from rlctl.serve.http_common import Cancelled, await_job, fail_queued
from rlctl.serve.sglang_api import Row


@dataclass(eq=False)
class _Generate:
    rows: Sequence[Row]
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)
    scheduled: int = 0  # rows handed to the engine so far
    results: list = field(default_factory=list)  # (Trajectory, weight version) per row, None until sampled
    aborted: bool = False  # its rows were told to stop (continuous scheduler)

    def __post_init__(self) -> None:
        self.results = [None] * len(self.rows)

    @property
    def left(self) -> int:
        return len(self.rows) - self.scheduled


@dataclass(eq=False)
class _Call:
    fn: Callable[[Any], Any]
    future: Future = field(default_factory=Future)


_STOP = object()


def accepts_ignore_eos(engine: Any) -> bool:
    """Whether the engine's generate takes ``ignore_eos`` (the local engine does)."""
    import inspect

    try:
        return "ignore_eos" in inspect.signature(engine.generate).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    rows: int = 0
    largest_batch_rows: int = 0
    largest_batch_requests: int = 0
    retried_alone: int = 0  # requests re-run alone after a shared batch failed
    cancelled: int = 0
    engine_seconds: float = 0.0  # time spent in engine batches


class EngineWorker:
    """Serialises every use of ``engine`` on one thread and batches concurrent generate calls fairly."""

    def __init__(self, engine: Any, *, weight_version: str, max_wait_s: float = 0.005,
                 max_batch_rows: int = 256, observe: Callable[[int, float], None] | None = None) -> None:
        """``observe(rows, seconds)`` is called on the engine thread after every batch (metrics)."""
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.engine, self._observe = engine, observe
        self.weight_version = weight_version  # changed only on the worker thread, with the weights
        self.max_wait_s, self.max_batch_rows = max_wait_s, max_batch_rows
        self.stats = BatchStats()
        self._queue: queue.Queue = queue.Queue()
        self._active: deque[_Generate] = deque()
        self._closing = threading.Event()
        self._busy = threading.Event()  # set while the engine runs a batch or a call
        self._cancellable = isinstance(engine, CancellableRollout)
        self._thread = threading.Thread(target=self._loop, name="rlctl-engine", daemon=True)
        self._thread.start()

    # -- called from handler threads ---------------------------------------------

    def submit(self, rows: Sequence[Row]) -> _Generate:
        """Queue ``rows``; the job's future yields (trajectories, weight version per row)."""
        job = _Generate(rows=rows)
        if self._closing.is_set():
            job.future.set_exception(Cancelled("the server is shutting down", "retry on another server"))
            return job
        self._queue.put(job)
        return job

    def generate(self, rows: Sequence[Row], timeout_s: float | None = None,
                 gone: Callable[[], bool] | None = None) -> tuple[list[Trajectory], list[str]]:
        """Trajectories for ``rows`` (in order) and the weight version each was sampled under.

        ``gone()`` is polled while waiting; once it is true (the client left)
        the job is cancelled and ``Cancelled`` raised. Past ``timeout_s`` the
        job is cancelled too and TimeoutError raised.
        """
        job = self.submit(rows)
        return await_job(job, gone=gone, timeout_s=timeout_s, what="generation")

    def call(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> Any:
        """Run ``fn(worker)`` on the engine thread between batches (weight updates)."""
        job = _Call(fn=fn)
        if self._closing.is_set():
            raise Cancelled("the server is shutting down", "retry on another server")
        self._queue.put(job)
        return job.future.result(timeout=timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def cancel_all(self) -> None:
        """Shutdown has begun: running generations stop at their next decode step, new work is refused."""
        self._closing.set()

    @property
    def idle(self) -> bool:
        """Nothing queued, nothing running."""
        return not self._busy.is_set() and not self._active and self._queue.empty()

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for or in a batch (read without a lock: a snapshot for metrics)."""
        return self._queue.qsize() + len(self._active)

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel every job (running generations stop at their next decode step) and stop the thread."""
        self._closing.set()
        self._queue.put(_STOP)
        self._thread.join(timeout=timeout_s)

    # -- the engine thread -------------------------------------------------------

    def _loop(self) -> None:
        while True:
            if not self._take(block=not self._active):
                break
            if self._closing.is_set():
                break
            if self._active:
                self._run_batch(self._schedule())
        self._fail_all()

    def _take(self, block: bool) -> bool:
        """Move queued jobs into the active set and run queued calls; False once told to stop."""
        started = False
        while True:
            try:
                job = self._queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if job is _STOP:
                return False
            if isinstance(job, _Call):
                self._run_call(job)
                continue
            if not self._active and not started:  # a new batch starts: give concurrent requests a moment
                started = True
                deadline = time.monotonic() + self.max_wait_s
                self._active.append(job)
                while sum(j.left for j in self._active) < self.max_batch_rows:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        nxt = self._queue.get(timeout=remaining)
                    except queue.Empty:
                        break
                    if nxt is _STOP:
                        return False
                    if isinstance(nxt, _Call):
                        self._run_call(nxt)
                        break  # the update is in; sample the waiting jobs under it
                    self._active.append(nxt)
                continue
            self._active.append(job)

    def _schedule(self) -> list[tuple[_Generate, int, int]]:
        """Slices (job, start, stop) for the next batch: an even share of max_batch_rows per waiting job."""
        for job in list(self._active):
            if job.cancelled.is_set():
                self._active.remove(job)
                self.stats.cancelled += 1
                job.future.set_exception(Cancelled("the request was cancelled", "nothing to do"))
        budget, slices = self.max_batch_rows, {}
        while budget > 0:
            waiting = [j for j in self._active if j.left > 0]
            if not waiting:
                break
            share = max(1, budget // len(waiting))
            for job in waiting:
                take = min(share, job.left, budget)
                if take <= 0:
                    break
                start, _ = slices.get(id(job), (job.scheduled, job.scheduled))
                slices[id(job)] = (start, job.scheduled + take)
                job.scheduled += take
                budget -= take
        by_id = {id(j): j for j in self._active}
        return [(by_id[key], start, stop) for key, (start, stop) in slices.items()]

    def _run_call(self, job: _Call) -> None:
        self._busy.set()
        try:
            job.future.set_result(job.fn(self))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting handler thread
            job.future.set_exception(err)
        finally:
            self._busy.clear()

    def _engine_generate(self, requests: list[RolloutRequest], jobs: list[_Generate],
                         ignore_eos: bool = False) -> list[Trajectory]:
        extra = {"ignore_eos": True} if ignore_eos else {}  # only asked of engines that take it (accepts_ignore_eos)
        if not self._cancellable:
            return self.engine.generate(requests, **extra)

        def cancelled() -> list[int]:
            if self._closing.is_set():
                return list(range(len(jobs)))
            return [k for k, job in enumerate(jobs) if job.cancelled.is_set()]

        return self.engine.generate_cancellable(requests, cancelled, **extra)

    def _run_batch(self, slices: list[tuple[_Generate, int, int]]) -> None:
        if not slices:
            return
        self._busy.set()
        started = time.perf_counter()
        try:
            self._run_slices(slices)
        finally:
            self._busy.clear()
            seconds = time.perf_counter() - started
            self.stats.engine_seconds += seconds
            if self._observe is not None:
                self._observe(sum(stop - start for _, start, stop in slices), seconds)
        for job in list(self._active):
            if job.future.done():
                self._active.remove(job)
            elif job.left == 0 and all(r is not None for r in job.results):
                self._active.remove(job)
                if job.cancelled.is_set() or self._closing.is_set():  # its rows were cut short
                    self.stats.cancelled += 1
                    job.future.set_exception(Cancelled("the server is shutting down" if self._closing.is_set()
                                                       else "the request was cancelled", "retry"))
                else:
                    job.future.set_result(([r[0] for r in job.results], [r[1] for r in job.results]))

    def _run_slices(self, slices: list[tuple[_Generate, int, int]]) -> None:
        version = self.weight_version
        items = [(job, i) for job, start, stop in slices for i in range(start, stop)]
        s = self.stats
        s.batches += 1
        s.requests += sum(1 for job, start, _ in slices if start == 0)
        s.rows += len(items)
        s.largest_batch_rows = max(s.largest_batch_rows, len(items))
        s.largest_batch_requests = max(s.largest_batch_requests, len(slices))
        groups: dict[Any, list[tuple[_Generate, int]]] = {}
        for job, i in items:
            groups.setdefault((job.rows[i].sampling, job.rows[i].ignore_eos), []).append((job, i))
        for group in groups.values():
            jobs = {id(job): job for job, _ in group}
            try:
                self._sample(group, version)
            except BaseException as err:  # noqa: BLE001 - isolate: retry each request alone
                if len(jobs) == 1:
                    next(iter(jobs.values())).future.set_exception(err)
                    continue
                s.retried_alone += len(jobs)
                for job in jobs.values():
                    try:
                        self._sample([(j, i) for j, i in group if j is job], version)
                    except BaseException as alone:  # noqa: BLE001 - this request's own failure
                        job.future.set_exception(alone)

    def _sample(self, group: list[tuple[_Generate, int]], version: str) -> None:
        requests = []
        for job, i in group:
            row = job.rows[i]
            requests.append(RolloutRequest(prompt_id=row.rid, prompt_tokens=row.input_ids, group_size=1,
                                           sampling=row.sampling, dataset_version="serve"))
        first, i = group[0]
        trajectories = self._engine_generate(requests, [job for job, _ in group], first.rows[i].ignore_eos)
        if len(trajectories) != len(group):
            raise RoleError(f"the engine returned {len(trajectories)} trajectories for {len(group)} rows",
                            "a rollout backend bug; report it")
        for (job, i), traj in zip(group, trajectories):
            job.results[i] = (traj, version)

    def _fail_all(self) -> None:
        err = Cancelled("the server is shutting down", "retry on another server")
        fail_queued(self._queue, _STOP, err)
        for job in self._active:
            if not job.future.done():
                job.future.set_exception(err)
        self._active.clear()
