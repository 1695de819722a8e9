"""Local placement: every role is built on this machine; rollout workers are threads or child processes.

What this is: ``LocalPlacement``. In ``mode: sync`` the run's one rollout
engine is the rollout role itself. In the overlapped modes the rollout role is
a RolloutFleet of ``cluster.num_rollout_workers`` workers, each a backend
instance built from the same plugin and options with its own seed (worker 0
with the run's seed), served by its own producer thread. The backend lives in
that thread's process (``LocalWorker``: an HTTP engine's client waits on
sockets, and torch releases the GIL inside its kernels) or in a child process
(``ProcessWorker``, rlctl.placement.processes: the built-in engine on a small
model is Python-bound and would hold the GIL against the learner); see
``cluster.rollout_workers``.
A sharded learner starts its ranks as local processes (no rank launcher).

What this is not: a process supervisor. A local worker whose backend raises
RuntimeError / OSError / RolloutUnavailable (its engine died, e.g. every
SGLang server behind the ``sglang`` plugin is down) is rebuilt in place
(``restart``) up to ``cluster.max_restarts`` times.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError, RolloutUnavailable, WorkerLost
from rlctl.contracts.roles import ClosableLearner, RolloutBackend, RunDirAware
from rlctl.contracts.types import RolloutRequest, TaskData, Trajectory, WeightUpdate
from rlctl.engine.faults import on_publish
from rlctl.engine.producers import RolloutFleet, stream_backend
from rlctl.engine.roles import Roles
from rlctl.engine.spec import overlapped
from rlctl.hooks.manager import Plugins
from rlctl.placement.build import build_common, build_critic, build_reward_pool, learner_context
from rlctl.placement.processes import ProcessWorker, refuse_worker_sites, use_processes

# Model loading goes through process-global state (default device / init contexts in transformers):
# two threads building a backend at once can leave one model with meta tensors. Builds take turns.
_BUILD_LOCK = threading.Lock()


class LocalWorker:
    """A rollout backend in this process, served by one producer thread; RolloutWorker for the overlapped driver."""

    def __init__(self, name: str, build: Callable[[], RolloutBackend]) -> None:
        self.name, self._build = name, build
        with _BUILD_LOCK:
            self.backend = build()
        self._dead: list[RolloutBackend] = []

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        try:
            return self.backend.generate(requests)
        except (RuntimeError, OSError, RolloutUnavailable) as err:  # rebuild the backend, regenerate the prompts
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def stream(self, requests: Sequence[RolloutRequest], on_group: Callable[[int, list[Trajectory]], None],
               more: Callable[[int, bool], Sequence[RolloutRequest] | None] | None = None) -> None:
        """Continuous generation (rlctl.engine.producers.stream_backend); failures as ``generate``."""
        try:
            stream_backend(self.backend, requests, on_group, more)
        except (RuntimeError, OSError, RolloutUnavailable) as err:
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def load_weights(self, update: WeightUpdate) -> None:
        try:
            self.backend.update_weights(update)
        except RolloutUnavailable as err:
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def restart(self) -> None:
        """A new backend instance (it starts from the run's initial model; the driver loads current weights next)."""
        try:
            with _BUILD_LOCK:
                backend = self._build()
        except RolloutUnavailable as err:  # its engine is not back yet: counted as one more failure
            raise WorkerLost(f"{type(err).__name__}: {err}") from err
        self._dead.append(self.backend)  # closed with the worker, never while a call may still be in it
        self.backend = backend

    def use_run_dir(self, run_dir: str) -> None:
        if isinstance(self.backend, RunDirAware):  # e.g. launched engine servers' logs
            self.backend.use_run_dir(run_dir)

    def close(self) -> None:
        for backend in [*self._dead, self.backend]:
            backend.close()


class LocalPlacement:
    """Builds every role of a run in this process; ``roles`` are ready once it is constructed."""

    def __init__(self, config: RunConfig, plugins: Plugins, cache_root: Path,
                 progress: Callable[[int, int, float], None] | None = None, task: TaskData | None = None,
                 fleet: bool = False) -> None:
        common = build_common(config, plugins, cache_root, progress, task)
        self._closers: list[Callable[[], None]] = []
        try:
            processes = (fleet or overlapped(config)) and use_processes(config)
            if processes and config.faults.inject:
                raise ConfigError("cluster.rollout_workers=processes cannot carry injected faults into the "
                                  "worker processes", "set cluster.rollout_workers=threads (or auto), or "
                                  "cluster.backend=ray, whose actors arm the run's faults")
            if processes:  # a fault injected into the running run at a backend site: refused, not silently dead
                self._closers.append(on_publish(refuse_worker_sites))
            worker = (lambda i: ProcessWorker(f"local-{i}", config.rollout, common.rollout_context(i),  # starts
                                              config.faults.verifier_retries, wait=False)) if processes else \
                (lambda i: LocalWorker(f"local-{i}", lambda: common.build_rollout(plugins, i)))
            if fleet or overlapped(config):  # worker 0 now, the others once the learner is built (the order seeds follow)
                first: Any = worker(0)
            else:
                first = common.build_rollout(plugins, 0)
            self._closers.append(first.close)
            learner = plugins.build("learner_backend", config.train.learner, config.train.learner_options,
                                    "train.learner_options", ctx=learner_context(config, common.estimator,
                                                                                 common.policy_dir))
            if isinstance(learner, ClosableLearner):  # a sharded learner's local rank processes
                self._closers.append(learner.close)
            critic = build_critic(config, plugins, common.policy_dir) if common.estimator.needs_critic else None
            pool = build_reward_pool(config)
            if pool is not None:
                self._closers.append(pool.close)
            rollout = first
            if isinstance(first, (LocalWorker, ProcessWorker)):
                workers = [first]
                for i in range(1, config.cluster.num_rollout_workers):
                    workers.append(worker(i))
                    self._closers.append(workers[-1].close)
                for each in workers:  # the children import and build side by side while the learner builds
                    if isinstance(each, ProcessWorker):
                        each.ready()
                rollout = RolloutFleet(workers)
            self.roles: Roles = common.roles(plugins, rollout=rollout, learner=learner, critic=critic,
                                             reward_pool=pool)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close every role built here (idempotent)."""
        closers, self._closers = self._closers, []
        for close in reversed(closers):
            close()
