"""One run's lifecycle, for a new run and a resumed one alike.

What this is: ``Run``, which owns everything around the loop: the registry row
and its status (running -> succeeded / stopped / failed / interrupted), run events and
warnings, metric sinks, observer hooks (``on_run_start``, ``on_step_end``,
``on_run_end``), the checkpoint store with its registry index, the run
directory's lock (through ``RunDir``), and signal handling. ``Run.create``
records a new run, ``Run.reopen`` locks an existing one; both end in
``Run.execute``, which runs the loop and saves the final policy.

Rules it keeps:
- the run directory is locked for the whole run, so one run has one writer;
- SIGTERM is handled like Ctrl-C: the save in flight is finished (a second
  signal abandons it cleanly), and the run is marked ``interrupted`` with an
  event saying whether, and from which step, it can be resumed;
- a ``train.stop_rules`` rule that fires (rlctl.lifecycle.stop_rules) ends the
  loop after that step: the run saves as at a normal end, records a ``stopped``
  event naming the rule, the step and the best dev checkpoint, and is marked
  ``stopped``;
- any other failure marks the run ``failed`` with the error, and re-raises;
- the checkpoint directories are the truth: the registry's checkpoint rows
  are indexed after each commit and reconciled with the directory on resume.

What this is not: building roles (rlctl.placement), the loop
(rlctl.engine.loop) or what a resume may change (rlctl.lifecycle.resume).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from rlctl.config.load import config_hash
from rlctl.config.models import RunConfig, sink_specs
from rlctl.contracts.errors import CheckpointError, RlctlError
from rlctl.contracts.types import EvalRecord, RunRecord
from rlctl.contracts.checkpoints import CheckpointManifest, CheckpointState
from rlctl.engine.roles import START, ResumePoint
from rlctl.engine.rundir import RunDir, RunLock
from rlctl.hooks.manager import Plugins
from rlctl.lifecycle.provenance import code_version
from rlctl.registry.store import Registry

if TYPE_CHECKING:  # pragma: no cover
    from rlctl.engine.checkpoint import DiskCheckpointStore
    from rlctl.engine.roles import Roles
    from rlctl.placement import Placement


@dataclass
class TrainCallbacks:
    """Display hooks the CLI passes in; all optional."""

    warm_start: Callable[..., None] | None = None  # (step, total, loss), plus the dev accuracy after a dev check
    run_started: Callable[[RunRecord], None] | None = None
    step: Callable[[int, Mapping[str, float]], None] | None = None
    eval_progress: Callable[[str], None] | None = None
    start: Callable[[int, int, int], None] | None = None  # (first step, total steps, log_every), before the loop
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


class Run:
    """A run's registry row, directory, sinks, hooks and status; see the module docstring."""

    def __init__(self, record: RunRecord, directory: RunDir, *, registry: Registry, plugins: Plugins,
                 callbacks: TrainCallbacks | None, lock: RunLock | None = None, new: bool = False) -> None:
        self.record, self.dir, self.registry, self.plugins = record, directory, registry, plugins
        self.cb = callbacks or TrainCallbacks()
        self.started = time.perf_counter()
        self._lock, self._new = lock, new
        self._placement: "Placement | None" = None
        self._guard: Any = None  # rlctl.incidents.recovery.RunGuard while the loop runs
        self._dev_eval: Any = None  # rlctl.lifecycle.periodic_eval.DevEval while the loop runs
        self._sinks: list[Any] = []
        self._checkpointer: Any = None
        self._stop_rules: Any = None  # rlctl.lifecycle.stop_rules.StopRules when train.stop_rules is set
        self._stopped: Any = None  # the StopRun that ended the loop early

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def create(cls, placement: "Placement", *, registry: Registry, plugins: Plugins, home: Path,
               run_dir: Path | None, callbacks: TrainCallbacks | None, started: float) -> "Run":
        """Record a new run with its provenance; its directory is ``run_dir`` or ``<home>/runs/<id>``."""
        roles = placement.roles
        config = roles.config
        try:
            record = registry.create_run(
                name=config.run.name, config=config.model_dump(mode="json"), config_hash=config_hash(config),
                code_version=code_version(), dataset_version=roles.task.version,
                tokenizer_hash=roles.tokenizer_hash, seed=config.run.seed, run_dir=str(run_dir) if run_dir else "")
        except BaseException:
            placement.close()
            raise
        run = cls(record, RunDir(run_dir or home / "runs" / record.id), registry=registry, plugins=plugins,
                  callbacks=callbacks, new=True)
        run.started = started
        run.adopt(placement)
        return run

    @classmethod
    def reopen(cls, run_ref: str, *, registry: Registry, plugins: Plugins, callbacks: TrainCallbacks | None,
               started: float) -> "Run":
        """An existing run whose directory still exists, locked for this process."""
        record = registry.get_run(run_ref)
        if not record.run_dir or not Path(record.run_dir).is_dir():
            raise CheckpointError(f"run {record.id} has no run directory ({record.run_dir or 'none recorded'})",
                                  "only runs whose directory still exists can be resumed")
        directory = RunDir(record.run_dir)
        run = cls(record, directory, registry=registry, plugins=plugins, callbacks=callbacks, lock=directory.lock())
        run.started = started
        return run

    @contextlib.contextmanager
    def preparing(self) -> Iterator["Run"]:
        """Until ``execute``: a failure ends the adopted roles and releases the lock."""
        try:
            yield self
        except BaseException:
            if self._placement is not None:
                self._placement.close()
            if self._lock is not None:
                self._lock.release()
            raise

    def adopt(self, placement: "Placement") -> "Roles":
        """Own ``placement`` (the run closes it when it ends); its roles."""
        from rlctl.contracts.roles import RunDirAware

        self._placement = placement
        if isinstance(placement.roles.rollout, RunDirAware):  # e.g. launched engine servers' logs
            placement.roles.rollout.use_run_dir(str(self.dir.root))
        return placement.roles

    @property
    def placement(self) -> "Placement":
        assert self._placement is not None, "adopt a placement before execute"
        return self._placement

    @property
    def roles(self) -> "Roles":
        return self.placement.roles

    # -- events --------------------------------------------------------------------------------

    def warn(self, message: str) -> None:
        """Show a warning and record it as a run event (the event is best effort: the warning is not)."""
        if self.cb.warning:
            self.cb.warning(message)
        try:
            self.registry.add_event(self.record.id, "warning", message)
        except RlctlError:
            pass  # the registry itself may be what failed; the warning was shown

    def event(self, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        self.registry.add_event(self.record.id, kind, message, dict(data) if data is not None else None)

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_store(self, config: RunConfig) -> "DiskCheckpointStore":
        return checkpoint_store(self.dir.checkpoints, config, self.registry, self.record.id, self.warn, self.plugins)

    def load_newest_checkpoint(self) -> tuple[str, CheckpointState, list[str]]:
        """Drop partial checkpoints, load the newest that verifies, and reconcile the registry's rows."""
        from rlctl.engine.checkpoint import DiskCheckpointStore

        store = DiskCheckpointStore(self.dir.checkpoints)
        removed = store.cleanup_partial()
        if removed:
            self.event("checkpoint_cleanup", f"removed uncommitted checkpoint directories: {', '.join(removed)}",
                       {"removed": removed})
        path, state, skipped = store.load_latest()
        if state.run_id != self.record.id:
            raise CheckpointError(f"the checkpoints in {store.root} belong to run {state.run_id}, not "
                                  f"{self.record.id}", f"resume {state.run_id} instead")
        for message in skipped:
            self.warn(message)
        if skipped:
            self.event("checkpoint_fallback", f"fell back to {Path(path).name}: {len(skipped)} newer checkpoint(s) "
                       "failed verification", {"checkpoint": path, "step": state.step, "skipped": skipped,
                                              "num_skipped": len(skipped)})
        reconcile(self.registry, self.record.id, store)
        return path, state, skipped

    def mark_resumed(self, state: CheckpointState, path: str, config: RunConfig, data: Mapping[str, Any]) -> None:
        """Drop the metrics of the steps about to be re-run and record the ``resumed`` event."""
        self.registry.delete_metrics_from(self.record.id, state.step)
        self.registry.update_run(self.record.id, status="running", clear_error=True)
        self.event("resumed", f"resumed at step {state.step} of {config.train.steps} from {path}",
                   {"step": state.step, "checkpoint": path, "config_hash": config_hash(config), **data})

    # -- the run -------------------------------------------------------------------------------

    def execute(self, *, resume: ResumePoint = START, resumed_from: str | None = None) -> TrainResult:
        """Run the adopted roles' loop from ``resume`` to the end, then evaluate if configured."""
        roles = self.roles
        config, run_id = roles.config, self.record.id
        self._sinks, self._checkpointer = [], None
        status, last = "failed", {}
        with _sigterm_as_interrupt():
            try:
                last = self._train(roles, resume)
                status = "stopped" if self._stopped is not None else "succeeded"
            except KeyboardInterrupt:
                status = "interrupted"
                self._close_quietly(self._checkpointer)
                newest = self.dir.newest_step()
                where = (f"resume from step {newest} with `rlctl resume {run_id}`" if newest is not None
                         else "no committed checkpoint yet, so it cannot be resumed")
                self.event("interrupted", f"stopped by SIGINT/SIGTERM; {where}",
                           {"resumable": newest is not None, "checkpoint_step": newest})
                raise
            except BaseException as err:
                self._close_quietly(self._checkpointer)
                self.registry.update_run(run_id, status="failed", error=f"{type(err).__name__}: {err}")
                self.event("failed", f"{type(err).__name__}: {err}")
                raise
            finally:
                self._end(status)
        return self._finish(config, last, resume.step, resumed_from)

    def _train(self, roles: "Roles", resume: ResumePoint) -> dict[str, float]:
        """Sinks, checkpointer, hooks and the run's guard around the loop; the final save; the last metrics."""
        from rlctl.engine.drive import drive
        from rlctl.engine.snapshot import recover_newest
        from rlctl.engine.spec import LoopSpec, ignored_options
        from rlctl.incidents.recovery import RunGuard

        config, run_id = roles.config, self.record.id
        self._start_files(roles)
        if self.cb.run_started:
            self.cb.run_started(self.record)
        for note in ignored_options(config):
            self.warn(note)
        from rlctl.engine.samples import SampleLog

        self._sinks = [RegistrySink(self.registry, run_id), SampleLog(self.dir.root)] + [  # samples.jsonl
            self.plugins.build("metric_sink", name, options, f"train.metric_sinks.{i}.options",
                               run_dir=self.dir.root, run_id=run_id)
            for i, (name, options) in enumerate(sink_specs(config.train.metric_sinks))]
        if config.train.metrics_port is not None:  # Prometheus /metrics of the step metrics (rlctl.serve)
            from rlctl.serve.train_metrics import MetricsEndpoint

            self._sinks.append(MetricsEndpoint(config.train.metrics_port, run_id=run_id, run_dir=self.dir.root))
        checkpointer = self._checkpointer = self._make_checkpointer(roles)
        from rlctl.lifecycle.periodic_eval import DevEval
        from rlctl.lifecycle.stop_rules import StopRules, StopRun

        self._dev_eval = DevEval(roles, self.plugins, self.registry, run_id, self.warn)
        if self._dev_eval.enabled:  # the dev eval runs before the step's save: a new best dev score forces one
            checkpointer.prepare = self._dev_eval.prepare
        self._stop_rules = StopRules(config.train.stop_rules) if config.train.stop_rules else None
        self.plugins.pm.hook.on_run_start(run_id=run_id, config=self.record.config)
        # faults, recovery events, live alerts, NaN rollback, hang watchdog (rlctl.incidents.recovery)
        guard = self._guard = RunGuard(roles, run_id, self.dir.root, self.registry, self.plugins, self.warn,
                                       resume.step).start()
        if self.cb.start:
            self.cb.start(resume.step, config.train.steps, config.train.log_every)
        spec = LoopSpec.from_config(config)
        recover = partial(recover_newest, roles, checkpointer.store, config.checkpoint.shadow_tolerance)
        # the same guard in every mode: a NaN rollback re-enters the loop from the restored resume point
        try:
            last = guard.run(lambda point: drive(
                roles, spec, self._sinks, observer=self._on_step, resume=point, checkpoint=checkpointer,
                heartbeat=guard.heartbeat, directory=self.dir.root, recover=recover, store=checkpointer.store,
                evaluate=self._evaluate_dev if self._dev_eval.enabled else None),
                resume, checkpointer)
        except StopRun as stop:  # a stop rule fired: end as at the last step, then say which rule and where
            self._stopped, last = stop, stop.metrics
        with guard.heartbeat.phase("save", "checkpoint"):  # the last save, the final policy
            checkpointer.close()
            self.dir.write_model_dir(self.dir.final_policy, roles.learner.save_pretrained,
                                     roles.tokenizer.save_pretrained)
        if self._stopped is not None:
            self._record_stop(self._stopped.stop, checkpointer.store)
        return last

    def _record_stop(self, stop: Any, store: Any) -> None:
        """The ``stopped`` event: the rule, the step, and the checkpoint kept at the best dev score."""
        best = store.best_committed()
        kept = ""
        if best is not None:
            manifest = dict(store.list_committed())[best]
            kept = (f"; best checkpoint by {store.keep_best_metric} ({manifest.metrics[store.keep_best_metric]:.3g}"
                    f", step {manifest.step}) kept at {best}")
        if self.cb.warning:  # shown like a warning; recorded once, as the stopped event
            self.cb.warning(stop.message + kept)
        self.event("stopped", stop.message + kept, {**stop.to_json(), "best_checkpoint": best})

    def _end(self, status: str) -> None:
        """Whatever happened: stop the guard, close the sinks, record the status, end every role, unlock."""
        try:
            if self._guard is not None:
                self._guard.close()
            if self._dev_eval is not None:
                self._dev_eval.close()
            for sink in self._sinks:
                sink.close()
            if status != "failed":
                self.registry.update_run(self.record.id, status=status)
            self.plugins.pm.hook.on_run_end(run_id=self.record.id, status=status)
        finally:
            self.placement.close()
            if self._lock is not None:
                self._lock.release()

    def _start_files(self, roles: "Roles") -> None:
        """A new run records its directory and writes its files; then the directory is locked."""
        if self._new:
            if not self.record.run_dir:
                self.record = self.registry.update_run(self.record.id, run_dir=str(self.dir.root))
            r = self.record
            self.dir.write_run_files(roles.config.model_dump(mode="json"), {
                "run_id": r.id, "config_hash": r.config_hash, "code_version": r.code_version,
                "dataset_version": r.dataset_version, "tokenizer_hash": r.tokenizer_hash, "seed": r.seed,
                "initial_policy": str(roles.policy_dir)})
        self._lock = self._lock or self.dir.lock()

    def _on_step(self, step: int, metrics: Mapping[str, float]) -> None:
        self.plugins.pm.hook.on_step_end(run_id=self.record.id, step=step, metrics=metrics)
        if self.cb.step:
            self.cb.step(step, metrics)
        if self._guard is not None:
            self._guard.on_step_end(step, metrics)  # may raise NanRollback: the guard re-runs from a checkpoint
        stop = self._stop_rules.observe(step, metrics) if self._stop_rules is not None else None
        if stop is not None:
            from rlctl.lifecycle.stop_rules import StopRun

            raise StopRun(stop, metrics)

    def _evaluate_dev(self, step: int) -> Mapping[str, float] | None:
        """The step end's eval (rlctl.engine.loop.StepEnd): the dev eval due at ``step``, in the watchdog's eval
        phase."""
        if not self._dev_eval.due(step):
            return None
        beat = self._guard.heartbeat if self._guard is not None else None
        with beat.phase("eval", "rollout") if beat is not None else contextlib.nullcontext():
            return self._dev_eval(step)

    def _make_checkpointer(self, roles: "Roles") -> Any:
        from rlctl.engine.snapshot import Provenance, StepCheckpointer

        config = roles.config
        provenance = Provenance(run_id=self.record.id, config_hash=config_hash(config), code_version=code_version())
        return StepCheckpointer(roles, self.checkpoint_store(config), provenance,
                                every_steps=config.checkpoint.every_steps, total_steps=config.train.steps)

    def _close_quietly(self, checkpointer: Any) -> None:
        """Finish the save in flight while the run is already stopping; report, never mask, its failure."""
        if checkpointer is None:
            return
        try:
            checkpointer.close()
        except KeyboardInterrupt:
            self.warn("the checkpoint save in flight was abandoned by a second interrupt")
        except CheckpointError as err:
            self.warn(err.message)

    def _finish(self, config: RunConfig, last: Mapping[str, float], start_step: int,
                resumed_from: str | None) -> TrainResult:
        run_id = self.record.id
        wall = time.perf_counter() - self.started
        end = self._stopped.stop.step + 1 if self._stopped is not None else config.train.steps
        self.event("finished", f"{end - start_step} steps in {wall:.1f}s"
                   + (" (stopped by a stop rule)" if self._stopped is not None else ""),
                   {"wall_s": wall, "first_step": start_step, "last_step": end})
        result = TrainResult(run=self.registry.get_run(run_id), last_metrics=dict(last), wall_s=wall,
                             resumed_from=resumed_from, first_step=start_step)
        if config.eval.at_end:
            from rlctl.lifecycle.evaluate import evaluate_run

            result.eval, result.eval_details = evaluate_run(self.registry, self.plugins, run_id,
                                                            progress=self.cb.eval_progress)
        return result


def checkpoint_store(root: Path, config: RunConfig, registry: Registry, run_id: str, warn: Callable[[str], None],
                     plugins: Plugins | None = None) -> "DiskCheckpointStore":
    """A DiskCheckpointStore at ``root``: each committed checkpoint is indexed in the registry, then announced."""
    from rlctl.engine.checkpoint import DiskCheckpointStore, manifest_sha256

    def on_commit(path: str, manifest: CheckpointManifest) -> None:
        registry.add_checkpoint(run_id, manifest.step, path, manifest_sha256(manifest), manifest.metrics)
        if plugins is not None:
            plugins.pm.hook.on_checkpoint_saved(run_id=run_id, step=manifest.step, path=path, manifest=manifest)

    def on_delete(path: str, manifest: CheckpointManifest) -> None:
        registry.delete_checkpoint(run_id, manifest.step)

    c = config.checkpoint
    from rlctl.lifecycle.periodic_eval import best_checkpoint_metric

    best = best_checkpoint_metric(config)  # a run a stop rule may end keeps its best dev checkpoint
    mode = c.keep_best_mode if best == c.keep_best_metric else "max"
    return DiskCheckpointStore(root, keep_last=c.keep_last, keep_best_metric=best,
                               keep_best_mode=mode, async_save=c.async_save, on_commit=on_commit,
                               on_delete=on_delete, warn=warn)


def reconcile(registry: Registry, run_id: str, store: "DiskCheckpointStore") -> list[str]:
    """Make the registry's checkpoint rows match the committed directories (the directories are the truth)."""
    from rlctl.engine.checkpoint import manifest_sha256

    on_disk = {m.step: (path, m) for path, m in store.list_committed()}
    rows = {r.step: r for r in registry.checkpoints(run_id)}
    changes = []
    for step in sorted(set(rows) - set(on_disk)):
        registry.delete_checkpoint(run_id, step)
        changes.append(f"dropped the row of step {step} (no committed directory)")
    for step, (path, manifest) in sorted(on_disk.items()):
        sha = manifest_sha256(manifest)
        if step not in rows or (rows[step].manifest_sha256, rows[step].path) != (sha, path):
            registry.add_checkpoint(run_id, step, path, sha, manifest.metrics)
            changes.append(f"indexed {Path(path).name}")
    if changes:
        registry.add_event(run_id, "checkpoints_reconciled", "; ".join(changes), {"changes": changes})
    return changes


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM (preemption, ``kill``) into KeyboardInterrupt for the block's duration (main thread only)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
