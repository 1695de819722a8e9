"""The engine thread of ``rlctl serve rollout --scheduler continuous``: continuous batching across requests.

What this is: ``ContinuousWorker``, an EngineWorker whose thread keeps one engine session (the local engine's
``open_session``: a fixed number of decode slots) and runs it one decode step at a time. A request that arrives
while others decode joins at the next step: its rows take the slots that rows of other requests freed. A row that
ends is answered at once; a request is answered when its last row ends. Rules kept from EngineWorker:

- Weight updates run between steps, never under a live row: once one is queued, no new rows are admitted, the
  rows in flight finish under the old weights (each answer names the version that produced it), the update runs,
  and the waiting requests start under the new weights on a new session.
- Cancellation: a job whose client left (or every job, on shutdown) has its rows ended at the next step.
- Fair admission: ``max_batch_rows`` is the number of slots; free slots are shared evenly among the requests
  with rows left (round robin), so a request of many rows cannot hold a small one back.

What this is not: isolation by retry. A batch scheduler can re-run each request of a failed batch alone; here a
failed step fails the requests in flight (parse_generate refuses bad rows before they reach the engine, so a step
fails only on an engine fault), and the next request starts on a fresh session.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from typing import Any, Callable

from rlctl.contracts.types import RolloutRequest
from rlctl.serve.http_common import Cancelled, fail_queued
from rlctl.serve.worker import _STOP, EngineWorker, _Call, _Generate


def can_serve_continuously(engine: Any) -> bool:
    """The backend opens sessions and this model can run on one (``supports_sessions()``)."""
    check = getattr(engine, "supports_sessions", None)
    return callable(check) and bool(check())


class ContinuousWorker(EngineWorker):
    """EngineWorker over an engine session: requests join and leave the decode batch between steps."""

    def __init__(self, engine: Any, *, weight_version: str, max_batch_rows: int = 256,
                 observe: Callable[[int, float], None] | None = None) -> None:
        self._session: Any = None
        self._rows: dict[int, tuple[_Generate, int]] = {}  # session row -> (job, row index in the job)
        self._waiting: deque[_Generate] = deque()  # jobs not admitted yet (a weight update is pending)
        self._calls: deque[_Call] = deque()
        super().__init__(engine, weight_version=weight_version, max_wait_s=0.0, max_batch_rows=max_batch_rows,
                         observe=observe)

    @property
    def idle(self) -> bool:
        return super().idle and not self._waiting and not self._calls

    @property
    def queue_depth(self) -> int:
        return super().queue_depth + len(self._waiting)

    # -- the engine thread -------------------------------------------------------

    def _loop(self) -> None:
        try:
            while self._collect(block=not self._busy_rows and not self._calls):
                if self._closing.is_set():
                    break
                if self._calls and not self._decoding:  # the rows in flight are done: the update runs now
                    self._session = None  # its decoder holds the old weights
                    while self._calls:
                        self._run_call(self._calls.popleft())
                if not self._calls:
                    while self._waiting:
                        self._admit(self._waiting.popleft())
                    self._feed()
                self._cancel()
                self._finish_jobs()
                if self._decoding:
                    self._step()
        finally:
            self._fail_all()

    @property
    def _decoding(self) -> bool:
        return self._session is not None and not self._session.idle

    @property
    def _busy_rows(self) -> bool:
        """Rows decoding or waiting to be fed to the session."""
        return self._decoding or any(job.left > 0 and not job.aborted for job in self._active)

    def _collect(self, block: bool) -> bool:
        """Move everything queued into _waiting / _calls (waiting for the first item when ``block``);
        False once told to stop."""
        while True:
            try:
                item = self._queue.get(block=block)
            except queue.Empty:
                return True
            block = False
            if item is _STOP:
                return False
            (self._calls if isinstance(item, _Call) else self._waiting).append(item)

    def _admit(self, job: _Generate) -> None:
        if job.cancelled.is_set():
            self.stats.cancelled += 1
            job.future.set_exception(Cancelled("the request was cancelled", "nothing to do"))
            return
        self._active.append(job)
        self.stats.requests += 1
        self.stats.largest_batch_requests = max(self.stats.largest_batch_requests, len(self._active))

    def _feed(self) -> None:
        """Rows of the admitted requests into the session while it has free slots, shared evenly among the
        requests with rows left (round robin), so a request of many rows cannot hold a small one back."""
        jobs = [job for job in self._active if job.left > 0 and not job.aborted]
        if not jobs:
            return
        if self._session is None:
            self._session = self.engine.open_session(self.max_batch_rows)
        free = self.max_batch_rows - self._session.live - self._session.queued
        while free > 0 and jobs:
            share = max(1, free // len(jobs))
            for job in jobs:
                take = min(share, job.left, free)
                if take > 0 and self._add(job, take):
                    free -= take
            jobs = [job for job in jobs if job.left > 0 and not job.future.done()]

    def _add(self, job: _Generate, count: int) -> bool:
        """The job's next ``count`` rows into the session; False (the job failed) if the engine refused one."""
        try:
            for i in range(job.scheduled, job.scheduled + count):
                row = job.rows[i]
                request = RolloutRequest(prompt_id=row.rid, prompt_tokens=row.input_ids, group_size=1,
                                         sampling=row.sampling, dataset_version="serve")
                (sid,) = self._session.add(request, ignore_eos=row.ignore_eos)
                self._rows[sid] = (job, i)
                job.scheduled += 1
                self.stats.rows += 1
        except BaseException as err:  # noqa: BLE001 - this request's own failure (a fault, a bad row)
            self._abort_job(job)
            self._active.remove(job)
            job.future.set_exception(err)
            return False
        return True

    def _abort_job(self, job: _Generate) -> None:
        rows = [sid for sid, (owner, _) in self._rows.items() if owner is job]
        if rows and self._session is not None:
            self._session.abort(rows)

    def _cancel(self) -> None:
        """End the rows of jobs whose client left (all of them on shutdown)."""
        for job in self._active:
            if (job.cancelled.is_set() or self._closing.is_set()) and not job.aborted:
                job.aborted = True
                self._abort_job(job)

    def _step(self) -> None:
        self._busy.set()
        started = time.perf_counter()
        live = self._session.live
        try:
            finished = self._session.step()
        except BaseException as err:  # noqa: BLE001 - the requests in flight get the engine's error
            self._session = None
            for job in self._active:  # rows not fed yet fail with them
                if not job.future.done():
                    job.future.set_exception(err)
            self._active.clear()
            self._rows.clear()
            return
        finally:
            self._busy.clear()
            seconds = time.perf_counter() - started
            self.stats.engine_seconds += seconds
            self.stats.batches += 1
            self.stats.largest_batch_rows = max(self.stats.largest_batch_rows, live)
            if self._observe is not None:
                self._observe(live, seconds)
        for sid, trajectory in finished:
            job, i = self._rows.pop(sid)
            job.results[i] = (trajectory, self.weight_version)
        self._finish_jobs()

    def _finish_jobs(self) -> None:
        """Answer every request whose rows are all back (those fed, for a cancelled one)."""
        for job in [j for j in self._active if (j.left == 0 or j.aborted)
                    and all(r is not None for r in j.results[:j.scheduled])]:
            self._active.remove(job)
            if job.future.done():
                continue
            if job.cancelled.is_set() or self._closing.is_set():  # its rows were cut short
                self.stats.cancelled += 1
                job.future.set_exception(Cancelled("the server is shutting down" if self._closing.is_set()
                                                   else "the request was cancelled", "retry"))
            else:
                job.future.set_result(([r[0] for r in job.results], [r[1] for r in job.results]))

    def _fail_all(self) -> None:
        err = Cancelled("the server is shutting down", "retry on another server")
        fail_queued(self._queue, _STOP, err)
        for job in [*self._active, *self._waiting, *self._calls]:
            if not job.future.done():
                job.future.set_exception(err)
        self._active.clear()
        self._waiting.clear()
        self._calls.clear()
        self._rows.clear()
