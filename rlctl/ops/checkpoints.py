"""Resume a run from its newest committed checkpoint, keep the registry's index true, export a checkpoint.

What this is: ``resume()``, the library function behind ``rlctl resume RUN``
and ``rlctl train --resume RUN``. Under the run directory's lock it removes
partial checkpoint directories, picks the newest committed checkpoint whose
every checksum verifies (falling back to older ones with a warning naming the
bad file), reconciles the registry's checkpoint rows with the directory,
refuses an incompatible resume (changed config outside the allowed list,
dataset, tokenizer, model shape) unless ``allow_config_change``, restores the
session (learner, cursor, shadow check, rollout weights, RNG), drops the
registry metrics of the steps about to be re-run, records a ``resumed`` event
and continues the same run id. ``export()`` resolves a checkpoint reference
and writes a plain Hugging Face directory.

What this is not: the store or the restore itself (rlctl.engine.checkpoint,
rlctl.engine.snapshot), or the loop bookkeeping (rlctl.ops.train.execute).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable, Iterable

from rlctl.config.load import apply_override, config_hash, load_config, validate
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.types import CheckpointState
from rlctl.hooks.manager import Plugins
from rlctl.ops.provenance import code_version
from rlctl.ops.train import RunLock, TrainCallbacks, TrainResult, run_warner, execute
from rlctl.registry.store import Registry

ALLOW_HINT = ("resume with the original config and data, or pass --allow-config-change to continue anyway "
              "(the run is then no longer a reproducible continuation)")


def resume(run_ref: str, *, registry: Registry, plugins: Plugins, home: Path, config_path: Path | None = None,
           overrides: Iterable[str] = (), allow_config_change: bool = False,
           callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Continue run ``run_ref`` from its newest verified checkpoint; see the module docstring."""
    from rlctl.engine.checkpoint import DiskCheckpointStore
    from rlctl.engine.session import build_session, load_task
    from rlctl.engine.snapshot import compatibility_problems, restore

    cb = callbacks or TrainCallbacks()
    started = time.perf_counter()
    run = registry.get_run(run_ref)
    directory = Path(run.run_dir)
    if not run.run_dir or not directory.is_dir():
        raise CheckpointError(f"run {run.id} has no run directory ({run.run_dir or 'none recorded'})",
                              "only runs whose directory still exists can be resumed")
    warn = run_warner(registry, run.id, cb)
    lock = RunLock.acquire(directory)
    session = None
    try:
        store = DiskCheckpointStore(directory / "checkpoints")
        removed = store.cleanup_partial()
        if removed:
            registry.add_event(run.id, "checkpoint_cleanup", f"removed uncommitted checkpoint directories: "
                               f"{', '.join(removed)}", {"removed": removed})
        path, state, skipped = store.load_latest()
        if state.run_id != run.id:
            raise CheckpointError(f"the checkpoints in {store.root} belong to run {state.run_id}, not {run.id}",
                                  f"resume {state.run_id} instead")
        for message in skipped:
            warn(message)
        if skipped:
            registry.add_event(run.id, "checkpoint_fallback", f"fell back to {Path(path).name}: {len(skipped)} newer "
                               f"checkpoint(s) failed verification", {"checkpoint": path, "step": state.step,
                                                                      "skipped": skipped, "num_skipped": len(skipped)})
        reconcile(registry, run.id, store)
        config = resume_config(state, config_path, overrides)
        if config.train.steps < state.step:
            raise CheckpointError(f"train.steps={config.train.steps} is below the {state.step} steps the newest "
                                  f"checkpoint already has", f"pass train.steps={state.step} or more")
        task = load_task(config, plugins)
        _refuse_or_warn(compatibility_problems(state, config=config.model_dump(mode="json"),
                                               dataset_version=task.version),
                        allow_config_change, warn)
        session = build_session(config, plugins, cache_root=home / "cache", progress=cb.warm_start, task=task)
        _refuse_or_warn(compatibility_problems(state, tokenizer_hash=session.tokenizer_hash),
                        allow_config_change, warn)
        if state.code_version != (now := code_version()):
            warn(f"the code changed since checkpoint step {state.step} ({state.code_version} -> {now})")
        report = restore(session, state, config.checkpoint.shadow_tolerance)
        for note in report.notes:
            warn(note)
        registry.delete_metrics_from(run.id, state.step)
        registry.update_run(run.id, status="running", clear_error=True)
        registry.add_event(run.id, "resumed", f"resumed at step {state.step} of {config.train.steps} from {path}", {
            "step": state.step, "checkpoint": path, "config_hash": config_hash(config),
            "shadow_max_abs_diff": report.shadow_max_abs_diff, "skipped": skipped,
        })
    except BaseException:
        if session is not None:
            session.rollout.close()
        lock.release()
        raise
    return execute(session, run, directory, registry=registry, plugins=plugins, callbacks=cb, started=started,
                   start_step=state.step, lock=lock, resumed_from=path)


def resume_config(state: CheckpointState, config_path: Path | None, overrides: Iterable[str]) -> RunConfig:
    """The config to continue with: the checkpoint's own (or ``config_path``), then ``overrides``."""
    if config_path is not None:
        return load_config(config_path, overrides)
    raw = copy.deepcopy(dict(state.config))
    for item in overrides:
        apply_override(raw, item)
    return validate(raw, source=f"the config of checkpoint step {state.step}")


def reconcile(registry: Registry, run_id: str, store: object) -> list[str]:
    """Make the registry's checkpoint rows match the committed directories (the directories are the truth)."""
    from rlctl.engine.checkpoint import manifest_sha256

    on_disk = {m.step: (path, m) for path, m in store.list_committed()}  # type: ignore[attr-defined]
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


def resolve_checkpoint(ref: str, open_registry: Callable[[], Registry]) -> tuple[Path, list[str]]:
    """A checkpoint directory for ``ref``: a checkpoint dir, a run dir or a run id (newest verified one)."""
    from rlctl.engine.checkpoint import COMMITTED, DiskCheckpointStore, verify

    path = Path(ref).expanduser()
    if (path / COMMITTED).is_file() or (path.is_dir() and path.name.startswith("step-")):
        return path, []
    if (path / "checkpoints").is_dir():
        root = path / "checkpoints"
    else:
        with open_registry() as registry:
            root = Path(registry.get_run(ref).run_dir) / "checkpoints"
    skipped = []
    for candidate, _ in reversed(DiskCheckpointStore(root).list_committed()):
        try:
            verify(candidate)
            return Path(candidate), skipped
        except CheckpointError as err:
            skipped.append(f"skipped {Path(candidate).name}: {err.message}")
    raise CheckpointError(f"no committed checkpoint in {root} verifies" + (f" ({'; '.join(skipped)})" if skipped else ""),
                          "pass a checkpoint directory, e.g. RUN_DIR/checkpoints/step-000020")


def export(ref: str, target: Path, open_registry: Callable[[], Registry]) -> tuple[Path, Path, list[str]]:
    """Export the model of checkpoint ``ref`` to ``target`` as a Hugging Face directory."""
    from rlctl.engine.checkpoint import export_hf

    source, skipped = resolve_checkpoint(ref, open_registry)
    return source, export_hf(source, target), skipped


def _refuse_or_warn(problems: list[str], allow: bool, warn: Callable[[str], None]) -> None:
    if problems and not allow:
        raise CheckpointError("cannot resume: " + "; ".join(problems), ALLOW_HINT)
    for problem in problems:
        warn(f"{problem} (allowed by --allow-config-change)")
