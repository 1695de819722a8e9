"""Placement of the roles: in this process (``local``) or as Ray actors (``ray``).

What this is: ``run_overlapped``, which builds the rollout workers (and, for
Ray, the learner actor) for a session and runs the overlapped loop
(rlctl.engine.async_loop) with them. rlctl.dist.ray and rlctl.dist.ray_ranks
(a sharded learner's ranks as actors) are the only modules in rlctl that
import ray; they are imported only when ``cluster.backend`` is ray.
rlctl.dist.ranks holds the process-group plumbing local and Ray ranks share.

What this is not: the loop itself or run bookkeeping (rlctl.ops.train).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from rlctl.contracts.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.engine.heartbeat import Heartbeat


def needs_overlap(config: Any) -> bool:
    """Whether a run goes through the overlapped driver rather than the plain synchronous loop."""
    return config.mode != "sync" or config.cluster.backend == "ray"


def run_overlapped(session: Any, plugins: Any, directory: Path, sinks: Sequence[Any],
                   observer: Callable[[int, Mapping[str, float]], None] | None = None, start_step: int = 0,
                   checkpoint: Any = None, store: Any = None,
                   heartbeat: "Heartbeat | None" = None) -> dict[str, float]:
    """Run ``session`` with the placement its config names; ``store`` lets a lost learner be restored in-run.

    ``heartbeat`` (rlctl.engine.heartbeat) is told of the placement's start and
    of the driver's and producers' phases, whatever placement stands behind the
    session's roles.
    """
    from rlctl.engine.async_loop import AsyncDriver, AsyncSpec, WorkerPool
    from rlctl.engine.heartbeat import NO_HEARTBEAT

    config = session.config
    rounds = session.estimator.max_sample_rounds
    if rounds > 1:
        raise ConfigError(
            f"algo.name={config.algo.name} refills filtered groups (up to {rounds} sampling rounds per step), which "
            "overlapped training cannot do: a refill needs prompts beyond the step's batch, and the trajectory "
            "queue admits a prompt only while its batch index is within staleness.max_staleness of the learner's "
            "version, so the learner would wait for groups no worker may generate",
            "set algo.options.max_sample_rounds=1 (groups without signal are dropped, counted in "
            "ds_dropped_groups, and the step trains on the rest), or train with mode=sync cluster.backend=local")
    spec = AsyncSpec.from_config(config)
    heartbeat = heartbeat or NO_HEARTBEAT
    with heartbeat.phase("start", "placement"):  # a Ray cluster, its placement group and actors coming up
        placement = _placement(session, plugins)
    try:
        workers = placement.workers()
        driver = AsyncDriver(session, spec, workers, directory / "queue",
                             recover=_recover(session, store) if store is not None else None, store=store,
                             heartbeat=heartbeat)
        local_rollout = session.rollout
        session.rollout = WorkerPool(workers, driver.board)
        try:
            return driver.run(sinks, observer, start_step=start_step, checkpoint=checkpoint)
        finally:
            session.rollout = local_rollout
            session.queue = None
    finally:
        placement.close()


def _placement(session: Any, plugins: Any) -> Any:
    if session.config.cluster.backend == "ray":
        from rlctl.dist.ray import RayPlacement

        return RayPlacement(session, plugins)
    from rlctl.dist.local import LocalPlacement

    return LocalPlacement(session, plugins)


def _recover(session: Any, store: Any) -> Callable[[], int]:
    """Restore the newest committed checkpoint into a restarted learner; 0 when there is none yet."""

    def recover() -> int:
        from rlctl.engine.snapshot import restore

        from rlctl.contracts.errors import CheckpointError

        try:
            store.wait()  # a save in flight either commits or is not a checkpoint
        except CheckpointError:
            pass
        committed = store.list_committed()
        if not committed:
            session.queue_cursor = None
            accept = getattr(session.learner, "accept_initial_state", None)  # Ray: a restarted actor waits for this
            if accept is not None:
                accept()
            session.rollout.update_weights(session.learner.export_weights())
            return 0
        path, _ = committed[-1]
        state = store.load(path)
        restore(session, state, session.config.checkpoint.shadow_tolerance)
        return state.step

    return recover
