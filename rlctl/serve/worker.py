"""The engine thread of ``rlctl serve rollout``: request batching and weight updates, one at a time.

What this is: one thread owns the rollout backend. HTTP handler threads put
jobs on its queue and wait. Generate jobs that arrive within ``max_wait_s`` of
each other are run as one batch (grouped by sampling config, because one
engine call samples one distribution); a weight update is a job too, so it
runs between batches: a batch sees the old weights or the new ones, never a
mix, and every response carries the weight version it was sampled under.

What this is not: continuous batching (a request that arrives while a batch
runs waits for the next one).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlctl.contracts.types import RolloutRequest, Trajectory
from rlctl.serve.sglang_api import Row


@dataclass
class _Generate:
    rows: Sequence[Row]
    future: Future = field(default_factory=Future)


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    future: Future = field(default_factory=Future)


_STOP = object()


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    rows: int = 0
    largest_batch_rows: int = 0
    largest_batch_requests: int = 0


class EngineWorker:
    """Serialises every use of ``engine`` on one thread and batches concurrent generate calls."""

    def __init__(self, engine: Any, *, weight_version: str, max_wait_s: float = 0.005,
                 max_batch_rows: int = 512) -> None:
        self.engine = engine
        self.weight_version = weight_version  # changed only on the worker thread, with the weights
        self.max_wait_s, self.max_batch_rows = max_wait_s, max_batch_rows
        self.stats = BatchStats()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="rlctl-engine", daemon=True)
        self._thread.start()

    # -- called from handler threads ---------------------------------------------

    def generate(self, rows: Sequence[Row], timeout_s: float | None = None) -> tuple[list[Trajectory], str]:
        """Trajectories for ``rows`` (in order) and the weight version they were sampled under."""
        job = _Generate(rows=rows)
        self._queue.put(job)
        return job.future.result(timeout=timeout_s)

    def call(self, fn: Callable[[Any], Any], timeout_s: float | None = None) -> Any:
        """Run ``fn(engine)`` on the engine thread between batches (weight updates)."""
        job = _Call(fn=fn)
        self._queue.put(job)
        return job.future.result(timeout=timeout_s)

    def close(self) -> None:
        self._queue.put(_STOP)
        self._thread.join(timeout=30)

    # -- the engine thread -------------------------------------------------------

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if isinstance(job, _Call):
                self._run_call(job)
                continue
            batch, after = self._collect(job)
            self._run_batch(batch)
            for extra in after:
                if extra is _STOP:
                    return
                self._run_call(extra)

    def _collect(self, first: _Generate) -> tuple[list[_Generate], list[Any]]:
        batch, rows = [first], len(first.rows)
        deadline = time.monotonic() + self.max_wait_s
        while rows < self.max_batch_rows:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                nxt = self._queue.get(timeout=remaining)
            except queue.Empty:
                break
            if not isinstance(nxt, _Generate):
                return batch, [nxt]  # an update or stop ends the batch; it runs right after it
            batch.append(nxt)
            rows += len(nxt.rows)
        return batch, []

    def _run_call(self, job: _Call) -> None:
        try:
            job.future.set_result(job.fn(self))
        except BaseException as err:  # noqa: BLE001 - handed to the waiting handler thread
            job.future.set_exception(err)

    def _run_batch(self, batch: list[_Generate]) -> None:
        version = self.weight_version
        flat = [(j, i, row) for j, job in enumerate(batch) for i, row in enumerate(job.rows)]
        s = self.stats
        s.batches += 1
        s.requests += len(batch)
        s.rows += len(flat)
        s.largest_batch_rows = max(s.largest_batch_rows, len(flat))
        s.largest_batch_requests = max(s.largest_batch_requests, len(batch))
        results: list[list[Trajectory | None]] = [[None] * len(job.rows) for job in batch]
        failed: dict[int, BaseException] = {}
        groups: dict[Any, list[tuple[int, int, Row]]] = {}
        for item in flat:
            groups.setdefault(item[2].sampling, []).append(item)
        for sampling, items in groups.items():
            requests = [RolloutRequest(prompt_id=row.rid, prompt_tokens=row.input_ids, group_size=1,
                                       sampling=sampling, dataset_version="serve") for _, _, row in items]
            try:
                trajectories = self.engine.generate(requests)
            except BaseException as err:  # noqa: BLE001 - each waiting request gets the error
                for j, _, _ in items:
                    failed[j] = err
                continue
            for (j, i, _), traj in zip(items, trajectories):
                results[j][i] = traj
        for j, job in enumerate(batch):
            if j in failed:
                job.future.set_exception(failed[j])
            else:
                job.future.set_result((results[j], version))
