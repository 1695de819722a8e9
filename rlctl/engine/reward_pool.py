"""Parallel reward workers: score trajectories in N processes with deadlines and retries.

What this is: ``ProcessRewardPool``, N spawned worker processes, each building
the reward function once from a picklable factory and scoring one sample at a
time. Per sample: a deadline (past it the worker is killed and replaced, and
the sample gets ``error_code="timeout"``), and up to ``retries`` new attempts
on infrastructure errors (the worker died, or the grader returned one of
``INFRA_ERRORS``). Results come back in input order. No sample ever turns into
a silent zero: every failure is an ``error_code`` the engine excludes.

What this is not: the reward function, or a Ray actor pool. A Ray pool
implements the same ``RewardPool`` protocol (``score`` + ``close``).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable, Protocol, Sequence

from rlctl.contracts.roles import RewardFunction
from rlctl.contracts.types import RewardResult, Trajectory

INFRA_ERRORS = frozenset({"sandbox_error", "worker_crashed"})


class RewardPool(Protocol):
    """Scores many samples at once; result i belongs to sample i."""

    def score(self, trajectories: Sequence[Trajectory], references: Sequence[str]) -> list[RewardResult]: ...

    def close(self) -> None: ...


def _serve(factory: Callable[[], RewardFunction], conn: Connection) -> None:
    """Worker loop: build the reward once, then answer (trajectory, reference) with a RewardResult."""
    reward = factory()
    conn.send(("ready", reward.version))
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        traj, ref = item
        started = time.perf_counter()
        try:
            result = reward.score(traj, ref)
        except Exception as err:  # reported as an error code, never a zero
            result = RewardResult(total=0.0, components={}, grader_version=reward.version,
                                  error_code=f"grader_error:{type(err).__name__}",
                                  latency_s=time.perf_counter() - started, log=str(err)[:500])
        conn.send(("result", result))


class _Worker:
    def __init__(self, ctx: Any, factory: Callable[[], RewardFunction], startup_s: float) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(factory, child), daemon=True, name="rlctl-reward-worker")
        self.proc.start()
        child.close()
        self.startup_s = startup_s

    def wait_ready(self) -> "_Worker":
        startup_s = self.startup_s
        if not self.conn.poll(startup_s):
            self.kill()
            raise RuntimeError(f"a reward worker did not start within {startup_s:.0f}s")
        try:
            tag, self.version = self.conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"a reward worker died while building the reward (exit {self.proc.exitcode}); "
                               "run with reward.workers=1 to see the error") from None
        return self

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ProcessRewardPool:
    """``workers`` processes scoring with ``factory()``; see the module docstring."""

    def __init__(self, factory: Callable[[], RewardFunction], workers: int, *, timeout_s: float = 60.0,
                 retries: int = 1, startup_s: float = 120.0) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.factory, self.timeout_s, self.retries, self.startup_s = factory, timeout_s, retries, startup_s
        self._ctx = multiprocessing.get_context("spawn")  # no fork: the parent may hold torch threads
        started = [_Worker(self._ctx, factory, startup_s) for _ in range(workers)]  # start all, then wait
        self._workers = [worker.wait_ready() for worker in started]
        self.version = self._workers[0].version

    def score(self, trajectories: Sequence[Trajectory], references: Sequence[str]) -> list[RewardResult]:
        if len(trajectories) != len(references):
            raise ValueError("one reference per trajectory")
        results: list[RewardResult | None] = [None] * len(trajectories)
        next_index = iter(range(len(trajectories)))
        lock = threading.Lock()

        def drive(slot: int) -> None:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                results[i] = self._one(slot, trajectories[i], references[i])

        threads = [threading.Thread(target=drive, args=(k,), daemon=True) for k in range(len(self._workers))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [r if r is not None else self._error("worker_crashed", 0.0, "no result") for r in results]

    def _one(self, slot: int, traj: Trajectory, ref: str) -> RewardResult:
        started = time.perf_counter()
        last = None
        for attempt in range(self.retries + 1):
            worker = self._workers[slot]
            try:
                worker.conn.send((traj, ref))
                if not worker.conn.poll(self.timeout_s):
                    self._replace(slot)
                    return self._error("timeout", started, f"no result within reward.timeout_s={self.timeout_s}s; "
                                       "the worker was killed and replaced")
                _, result = worker.conn.recv()
            except (EOFError, OSError, BrokenPipeError) as err:
                last = self._error("worker_crashed", started,
                                   f"reward worker died (exit {worker.proc.exitcode}): {type(err).__name__}")
                self._replace(slot)
                continue
            if result.error_code in INFRA_ERRORS and attempt < self.retries:
                last = result
                continue
            if attempt:
                result = RewardResult(total=result.total, components=result.components,
                                      grader_version=result.grader_version, error_code=result.error_code,
                                      latency_s=result.latency_s, log=f"{result.log} (attempt {attempt + 1})")
            return result
        assert last is not None
        return last

    def _replace(self, slot: int) -> None:
        self._workers[slot].kill()
        self._workers[slot] = _Worker(self._ctx, self.factory, self.startup_s).wait_ready()

    def _error(self, code: str, started: float, log: str) -> RewardResult:
        return RewardResult(total=0.0, components={}, grader_version=self.version, error_code=code,
                            latency_s=time.perf_counter() - started, log=log)

    def close(self) -> None:
        for worker in self._workers:
            try:
                worker.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            worker.proc.join(2)
            worker.kill()
        self._workers = []

    def __enter__(self) -> "ProcessRewardPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
