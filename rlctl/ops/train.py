"""Train a run end to end with its bookkeeping: registry row, run dir, final policy.

What this is: ``train()``, the library function behind ``rlctl train``. It
builds every role first (so bad config, plugins, data or model fail before a
run row exists), then records the run with its provenance (config hash, code
version, dataset version, tokenizer hash, seed), runs the loop with
checkpoints (``execute``, shared with resume in rlctl.ops.checkpoints), saves
the final policy, and marks the run succeeded / failed / interrupted.

What this is not: the loop (rlctl.engine.loop) or its display (the CLI).
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from rlctl.config.load import config_hash
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import CheckpointError, RlctlError
from rlctl.contracts.types import EvalRecord, RunRecord
from rlctl.hooks.manager import Plugins
from rlctl.ops.provenance import code_version
from rlctl.registry.store import Registry


@dataclass
class TrainCallbacks:
    """Display hooks the CLI passes in; all optional."""

    warm_start: Callable[[int, int, float], None] | None = None
    run_started: Callable[[RunRecord], None] | None = None
    step: Callable[[int, Mapping[str, float]], None] | None = None
    eval_progress: Callable[[str], None] | None = None
    start: Callable[[int, int], None] | None = None  # (first step, total steps), just before the loop
    warning: Callable[[str], None] | None = None


@dataclass
class TrainResult:
    run: RunRecord
    last_metrics: dict[str, float]
    wall_s: float
    eval: EvalRecord | None = None
    eval_details: dict[str, Any] = field(default_factory=dict)
    resumed_from: str | None = None  # the checkpoint directory a resume started from
    first_step: int = 0


class RegistrySink:
    """MetricSink that writes each logged step into the registry's metrics table."""

    def __init__(self, registry: Registry, run_id: str) -> None:
        self.registry, self.run_id = registry, run_id

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        self.registry.log_metrics(self.run_id, step, metrics)

    def close(self) -> None:
        pass


def train(config: RunConfig, *, registry: Registry, plugins: Plugins, home: Path, run_dir: Path | None = None,
          callbacks: TrainCallbacks | None = None) -> TrainResult:
    from rlctl.engine.session import build_session

    cb = callbacks or TrainCallbacks()
    started = time.perf_counter()
    if run_dir is not None:
        _refuse_foreign_checkpoints(run_dir)
    session = build_session(config, plugins, cache_root=home / "cache", progress=cb.warm_start)
    run = registry.create_run(
        name=config.run.name, config=config.model_dump(mode="json"), config_hash=config_hash(config),
        code_version=code_version(), dataset_version=session.task.version, tokenizer_hash=session.tokenizer_hash,
        seed=config.run.seed, run_dir=str(run_dir) if run_dir else "",
    )
    directory = run_dir or home / "runs" / run.id

    def setup() -> RunRecord:
        record = run if run_dir else registry.update_run(run.id, run_dir=str(directory))
        _write_run_files(directory, config, record, session.policy_dir)
        return record

    return execute(session, run, directory, registry=registry, plugins=plugins, callbacks=cb, started=started,
                   setup=setup)


def execute(session: Any, run: RunRecord, directory: Path, *, registry: Registry, plugins: Plugins,
            callbacks: TrainCallbacks, started: float, start_step: int = 0,
            setup: Callable[[], RunRecord] | None = None, lock: "RunLock | None" = None,
            resumed_from: str | None = None) -> TrainResult:
    """Run the loop from ``start_step`` with sinks, checkpoints and run status (for train and resume).

    The run directory is locked for the whole run. SIGTERM is handled like
    Ctrl-C: the save in flight is finished (a second signal abandons it
    cleanly), and the run is marked ``interrupted`` and resumable from its
    newest committed checkpoint.
    """
    from rlctl.engine.loop import run_sync

    config, cb = session.config, callbacks
    sinks: list[Any] = []
    checkpointer = None
    status, last = "failed", {}
    with _sigterm_as_interrupt():
        try:
            if setup is not None:
                run = setup()
            lock = lock or RunLock.acquire(directory)
            if cb.run_started:
                cb.run_started(run)
            sinks = _sinks(config, registry, plugins, run, directory)
            checkpointer = _checkpointer(session, run, directory, registry, plugins, cb)
            plugins.pm.hook.on_run_start(run_id=run.id, config=run.config)

            def on_step(step: int, metrics: Mapping[str, float]) -> None:
                plugins.pm.hook.on_step_end(run_id=run.id, step=step, metrics=metrics)
                if cb.step:
                    cb.step(step, metrics)

            if cb.start:
                cb.start(start_step, config.train.steps)
            from rlctl.dist import needs_overlap, run_overlapped

            if needs_overlap(config):
                last = run_overlapped(session, plugins, directory, sinks, on_step, start_step=start_step,
                                      checkpoint=checkpointer, store=checkpointer.store)
            else:
                last = run_sync(session, sinks, on_step, start_step=start_step, checkpoint=checkpointer)
            checkpointer.close()
            _save_policy(session, directory / "policy" / "final")
            status = "succeeded"
        except KeyboardInterrupt:
            status = "interrupted"
            _close_quietly(checkpointer, run_warner(registry, run.id, cb))
            _record_interrupt(registry, run.id, directory)
            raise
        except BaseException as err:
            _close_quietly(checkpointer, run_warner(registry, run.id, cb))
            registry.update_run(run.id, status="failed", error=f"{type(err).__name__}: {err}")
            registry.add_event(run.id, "failed", f"{type(err).__name__}: {err}")
            raise
        finally:
            for sink in sinks:
                sink.close()
            if status != "failed":
                registry.update_run(run.id, status=status)
            plugins.pm.hook.on_run_end(run_id=run.id, status=status)
            session.rollout.close()
            if lock is not None:
                lock.release()
    wall = time.perf_counter() - started
    done = config.train.steps - start_step
    registry.add_event(run.id, "finished", f"{done} steps in {wall:.1f}s", {"wall_s": wall, "first_step": start_step})
    result = TrainResult(run=registry.get_run(run.id), last_metrics=dict(last), wall_s=wall, resumed_from=resumed_from,
                         first_step=start_step)
    if config.eval.at_end:
        from rlctl.ops.evaluate import evaluate_run

        result.eval, result.eval_details = evaluate_run(registry, plugins, run.id, progress=cb.eval_progress)
    return result


def _refuse_foreign_checkpoints(directory: Path) -> None:
    """A new run never writes into a directory that holds another run's checkpoints (they are immutable)."""
    from rlctl.engine.checkpoint import DiskCheckpointStore

    committed = DiskCheckpointStore(directory / "checkpoints").list_committed()
    if committed:
        owner = committed[-1][1].run_id
        raise CheckpointError(f"run directory {directory} already holds checkpoints of run {owner}",
                              f"pass a new --run-dir, or continue that run with `rlctl resume {owner}`")


def _sinks(config: RunConfig, registry: Registry, plugins: Plugins, run: RunRecord, directory: Path) -> list[Any]:
    return [RegistrySink(registry, run.id)] + [
        plugins.build("metric_sink", name, {}, f"train.metric_sinks.{i}", run_dir=directory, run_id=run.id)
        for i, name in enumerate(config.train.metric_sinks)
    ]


def _record_interrupt(registry: Registry, run_id: str, directory: Path) -> None:
    """The ``interrupted`` event says whether, and from which step, the run can be resumed."""
    newest = _newest_checkpoint(directory)
    where = (f"resume from step {newest} with `rlctl resume {run_id}`" if newest is not None
             else "no committed checkpoint yet, so it cannot be resumed")
    registry.add_event(run_id, "interrupted", f"stopped by SIGINT/SIGTERM; {where}",
                       {"resumable": newest is not None, "checkpoint_step": newest})


class RunLock:
    """An exclusive lock on a run directory: two processes never train or resume one run at once.

    Held with fcntl.flock on ``<run_dir>/.lock``, so a killed process releases it.
    """

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @classmethod
    def acquire(cls, directory: Path) -> "RunLock":
        import fcntl
        import os

        directory.mkdir(parents=True, exist_ok=True)
        handle = (directory / ".lock").open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown pid"
            handle.close()
            raise CheckpointError(f"run directory {directory} is in use by another rlctl process ({holder})",
                                  "wait for that process to finish, or stop it; one run has one writer") from None
        handle.truncate(0)
        handle.write(f"pid {os.getpid()}\n")
        handle.flush()
        return cls(handle)

    def release(self) -> None:
        import fcntl

        if not self._handle.closed:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()


def checkpoint_store(directory: Path, config: RunConfig, registry: Registry, run_id: str,
                     warn: Callable[[str], None], plugins: Plugins | None = None) -> Any:
    """The run's DiskCheckpointStore: each committed checkpoint is indexed in the registry, then announced."""
    from rlctl.engine.checkpoint import DiskCheckpointStore, manifest_sha256

    def on_commit(path: str, manifest: Any) -> None:
        registry.add_checkpoint(run_id, manifest.step, path, manifest_sha256(manifest), manifest.metrics)
        if plugins is not None:
            plugins.pm.hook.on_checkpoint_saved(run_id=run_id, step=manifest.step, path=path, manifest=manifest)

    def on_delete(path: str, manifest: Any) -> None:
        registry.delete_checkpoint(run_id, manifest.step)

    c = config.checkpoint
    return DiskCheckpointStore(directory / "checkpoints", keep_last=c.keep_last, keep_best_metric=c.keep_best_metric,
                               keep_best_mode=c.keep_best_mode, async_save=c.async_save, on_commit=on_commit,
                               on_delete=on_delete, warn=warn)


def _checkpointer(session: Any, run: RunRecord, directory: Path, registry: Registry, plugins: Plugins,
                  cb: TrainCallbacks) -> Any:
    from rlctl.engine.snapshot import Provenance, StepCheckpointer

    config = session.config
    store = checkpoint_store(directory, config, registry, run.id, run_warner(registry, run.id, cb), plugins)
    provenance = Provenance(run_id=run.id, config_hash=config_hash(config), code_version=code_version())
    return StepCheckpointer(session, store, provenance, every_steps=config.checkpoint.every_steps,
                            total_steps=config.train.steps)


def run_warner(registry: Registry, run_id: str, cb: TrainCallbacks) -> Callable[[str], None]:
    """Show a warning and record it as a run event (the event is best effort: the warning is not)."""

    def warn(message: str) -> None:
        if cb.warning:
            cb.warning(message)
        try:
            registry.add_event(run_id, "warning", message)
        except RlctlError:
            pass  # the registry itself may be what failed; the warning was shown

    return warn


def _close_quietly(checkpointer: Any, warn: Callable[[str], None]) -> None:
    """Finish the save in flight while the run is already stopping; report, never mask, its failure."""
    if checkpointer is None:
        return
    try:
        checkpointer.close()
    except KeyboardInterrupt:
        warn("the checkpoint save in flight was abandoned by a second interrupt")
    except CheckpointError as err:
        warn(err.message)


def _newest_checkpoint(directory: Path) -> int | None:
    from rlctl.engine.checkpoint import DiskCheckpointStore

    committed = DiskCheckpointStore(directory / "checkpoints").list_committed()
    return committed[-1][1].step if committed else None


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (preemption, ``kill``) into KeyboardInterrupt for the block's duration (main thread only)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _write_run_files(directory: Path, config: RunConfig, run: RunRecord, policy_dir: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2, sort_keys=True))
    info = {"run_id": run.id, "config_hash": run.config_hash, "code_version": run.code_version,
            "dataset_version": run.dataset_version, "tokenizer_hash": run.tokenizer_hash, "seed": run.seed,
            "initial_policy": str(policy_dir)}
    (directory / "run.json").write_text(json.dumps(info, indent=2, sort_keys=True))


def _save_policy(session: Any, target: Path) -> None:
    """Write the final policy as a plain Hugging Face directory (temp dir, then rename)."""
    import os
    import shutil

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    session.learner.save_pretrained(str(tmp))
    session.tokenizer.save_pretrained(str(tmp))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)
