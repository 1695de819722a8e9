"""In-process placement: each rollout worker is a backend instance served by its own thread.

What this is: ``LocalPlacement``. Worker 0 reuses the session's rollout
backend; the others are built from the same plugin and options with their own
seed. Threads overlap generation with training because torch releases the
GIL inside its kernels.

What this is not: a process supervisor. A local worker whose backend raises
RuntimeError / OSError / RolloutUnavailable (its engine died, e.g. every
SGLang server behind the ``sglang`` plugin is down) is rebuilt in place
(``restart``) up to ``cluster.max_restarts`` times.
"""

from __future__ import annotations

import threading
from typing import Any, Sequence

from rlctl.contracts.errors import RolloutUnavailable
from rlctl.contracts.types import RolloutContext, RolloutRequest, Trajectory, WeightUpdate
from rlctl.engine.async_loop import WorkerLost


# Model loading goes through process-global state (default device / init contexts in transformers):
# two threads building a backend at once can leave one model with meta tensors. Builds take turns.
_BUILD_LOCK = threading.Lock()


class LocalWorker:
    def __init__(self, name: str, build: Any, backend: Any = None) -> None:
        self.name, self._build = name, build
        if backend is None:
            with _BUILD_LOCK:
                backend = build()
        self.backend = backend

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        try:
            return self.backend.generate(requests)
        except (RuntimeError, OSError, RolloutUnavailable) as err:  # rebuild the backend, regenerate the prompts
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
        self.backend = backend  # the dead one is left to the run's close (worker 0's is the session's own)

    def close(self) -> None:
        self.backend.close()


class LocalPlacement:
    def __init__(self, session: Any, plugins: Any) -> None:
        self.session, self.plugins = session, plugins
        self._workers: list[LocalWorker] = []

    def _builder(self, index: int) -> Any:
        config, s = self.session.config, self.session

        def build() -> Any:
            ctx = RolloutContext(model_dir=str(s.policy_dir), tokenizer_hash=s.tokenizer_hash,
                                 seed=config.run.seed + 1000 * index)
            return self.plugins.build("rollout_backend", config.rollout.backend, config.rollout.options,
                                      "rollout.options", ctx=ctx)

        return build

    def workers(self) -> list[LocalWorker]:
        n = self.session.config.cluster.num_rollout_workers
        self._workers = [LocalWorker("local-0", self._builder(0), backend=self.session.rollout)]
        self._workers += [LocalWorker(f"local-{i}", self._builder(i)) for i in range(1, n)]
        return self._workers

    def close(self) -> None:
        for worker in self._workers[1:]:  # worker 0 is the session's own backend; the run closes it
            worker.close()

