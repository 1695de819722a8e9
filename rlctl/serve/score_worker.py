"""The model thread of ``rlctl serve reward``: concurrent /score requests batched into shared forward passes.

What this is: ``ScoreWorker`` owns the reward model on one thread. Requests
that arrive within ``max_wait_s`` of each other share forward passes of at
most ``max_batch_rows`` sequences; a request larger than that is split
across passes. When a shared pass fails, each request is re-run alone, so
only the one that fails gets the error. A request whose client left (or
every request, on shutdown) is dropped before its next forward pass.

What this is not: the model's forward function (rlctl.serve.reward passes
it in) or HTTP.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.serve.http_common import Cancelled, await_job, fail_queued


@dataclass(eq=False)
class _Job:
    rows: Sequence[Sequence[int]]
    future: Future = field(default_factory=Future)
    cancelled: threading.Event = field(default_factory=threading.Event)


_STOP = object()


@dataclass
class ScoreStats:
    batches: int = 0  # forward passes
    requests: int = 0
    rows: int = 0
    largest_batch_rows: int = 0
    largest_batch_requests: int = 0
    retried_alone: int = 0  # requests re-run alone after a shared forward pass failed
    cancelled: int = 0
    engine_seconds: float = 0.0  # time spent in forward passes


class ScoreWorker:
    """Owns the model on one thread; concurrent requests share forward passes of at most ``max_batch_rows`` rows.

    ``forward(rows) -> scores`` runs one padded batch. Requests are taken in
    arrival order; a request larger than ``max_batch_rows`` is split across
    forward passes.
    """

    def __init__(self, forward: Callable[[list[Sequence[int]]], list[float]], *, max_wait_s: float = 0.005,
                 max_batch_rows: int = 64, observe: Callable[[int, float], None] | None = None) -> None:
        """``observe(rows, seconds)`` is called on the model thread after every forward pass (metrics)."""
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.forward, self.max_wait_s, self.max_batch_rows = forward, max_wait_s, max_batch_rows
        self._observe = observe
        self.stats = ScoreStats()
        self._queue: queue.Queue = queue.Queue()
        self._closing = threading.Event()
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlctl-reward-model", daemon=True)
        self._thread.start()

    # -- handler threads -------------------------------------------------------------------

    def score(self, rows: Sequence[Sequence[int]], timeout_s: float | None = None,
              gone: Callable[[], bool] | None = None) -> list[float]:
        """Scores of ``rows`` in order.

        ``Cancelled`` once ``gone()`` (the client left), TimeoutError past ``timeout_s``.
        """
        job = _Job(rows=rows)
        if self._closing.is_set():
            raise Cancelled("the server is shutting down", "retry on another server")
        self._queue.put(job)
        return await_job(job, gone=gone, timeout_s=timeout_s, what="scoring")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def idle(self) -> bool:
        return not self._busy.is_set() and self._queue.empty()

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    @property
    def queue_depth(self) -> int:
        return self._queue.qsize()

    def cancel_all(self) -> None:
        """Shutdown has begun: queued work is failed, new work refused."""
        self._closing.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._closing.set()
        self._queue.put(_STOP)
        self._thread.join(timeout=timeout_s)

    # -- the model thread ------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing.is_set():
            jobs = self._take()
            if jobs is None:
                break
            self._busy.set()
            try:
                self._run([j for j in jobs if not self._drop_cancelled(j)])
            finally:
                self._busy.clear()
        self._fail_all()

    def _take(self) -> list[_Job] | None:
        """The next batch's jobs: the first waiting one, plus those arriving within ``max_wait_s``."""
        first = self._queue.get()
        if first is _STOP:
            return None
        jobs, rows = [first], len(first.rows)
        deadline = time.monotonic() + self.max_wait_s
        while rows < self.max_batch_rows:
            try:
                nxt = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if nxt is _STOP:
                self._queue.put(_STOP)
                break
            jobs.append(nxt)
            rows += len(nxt.rows)
        return jobs

    def _drop_cancelled(self, job: _Job, force: bool = False) -> bool:
        if force or job.cancelled.is_set() or self._closing.is_set():
            self.stats.cancelled += 1
            job.future.set_exception(Cancelled("the server is shutting down" if self._closing.is_set()
                                               else "the request was cancelled", "retry"))
            return True
        return False

    def _run(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        s = self.stats
        s.requests += len(jobs)
        s.largest_batch_requests = max(s.largest_batch_requests, len(jobs))
        try:
            results = self._forward([row for job in jobs for row in job.rows], jobs)
        except Cancelled:
            for job in jobs:
                self._drop_cancelled(job, force=True)
            return
        except BaseException as err:  # noqa: BLE001 - isolate: re-run each request alone
            if len(jobs) == 1:
                jobs[0].future.set_exception(err)
                return
            s.retried_alone += len(jobs)
            for job in jobs:
                try:
                    job.future.set_result(self._forward(list(job.rows), [job]))
                except BaseException as alone:  # noqa: BLE001 - this request's own failure
                    if not job.future.done():
                        job.future.set_exception(alone)
            return
        at = 0
        for job in jobs:
            job.future.set_result(results[at:at + len(job.rows)])
            at += len(job.rows)

    def _forward(self, rows: list[Sequence[int]], jobs: list[_Job]) -> list[float]:
        out: list[float] = []
        for start in range(0, len(rows), self.max_batch_rows):
            if self._closing.is_set() or all(j.cancelled.is_set() for j in jobs):
                raise Cancelled("the request was cancelled", "retry")
            chunk = rows[start:start + self.max_batch_rows]
            started = time.perf_counter()
            scores = self.forward(chunk)
            seconds = time.perf_counter() - started
            self.stats.engine_seconds += seconds
            if self._observe is not None:
                self._observe(len(chunk), seconds)
            if len(scores) != len(chunk):
                raise RoleError(f"the reward model returned {len(scores)} scores for {len(chunk)} sequences",
                                "a reward-model bug; report it")
            s = self.stats
            s.batches += 1
            s.rows += len(chunk)
            s.largest_batch_rows = max(s.largest_batch_rows, len(chunk))
            out += scores
        return out

    def _fail_all(self) -> None:
        err = Cancelled("the server is shutting down", "retry on another server")
        fail_queued(self._queue, _STOP, err)
