"""Resume a run from its newest committed checkpoint, keep the registry's index true, export a checkpoint.

What this is: ``resume()``, the library function behind ``rlctl resume RUN``
and ``rlctl train --resume RUN``. Under the run directory's lock it removes
partial checkpoint directories, picks the newest committed checkpoint whose
every checksum verifies (falling back to older ones with a warning naming the
bad file), reconciles the registry's checkpoint rows with the directory,
refuses an incompatible resume (changed config outside the allowed list,
dataset, tokenizer, model shape) unless ``allow_config_change``, restores the
roles (learner, cursor, shadow check, rollout weights, RNG), drops the
registry metrics of the steps about to be re-run, records a ``resumed`` event
and continues the same run id. ``export()`` resolves a checkpoint reference
and writes a plain Hugging Face directory.

What this is not: the store or the restore itself (rlctl.engine.checkpoint,
rlctl.engine.snapshot), or the run lifecycle (rlctl.lifecycle.run.Run).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Callable, Iterable

from rlctl.config.load import apply_override, load_config, validate
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.checkpoints import CheckpointState
from rlctl.engine.faults import drain_recoveries
from rlctl.hooks.manager import Plugins
from rlctl.lifecycle.provenance import code_version
from rlctl.lifecycle.run import Run, TrainCallbacks, TrainResult, reconcile
from rlctl.registry.store import Registry

__all__ = ["export", "reconcile", "resolve_checkpoint", "resume", "resume_config"]

ALLOW_HINT = ("resume with the original config and data, or pass --allow-config-change to continue anyway "
              "(the run is then no longer a reproducible continuation)")


def resume(run_ref: str, *, registry: Registry, plugins: Plugins, home: Path, config_path: Path | None = None,
           overrides: Iterable[str] = (), allow_config_change: bool = False,
           callbacks: TrainCallbacks | None = None) -> TrainResult:
    """Continue run ``run_ref`` from its newest verified checkpoint; see the module docstring."""
    from rlctl.engine.snapshot import compatibility_problems, restore
    from rlctl.placement import place
    from rlctl.placement.build import load_task

    run = Run.reopen(run_ref, registry=registry, plugins=plugins, callbacks=callbacks, started=time.perf_counter())
    with run.preparing():
        path, state, skipped = run.load_newest_checkpoint()
        config = resume_config(state, config_path, overrides)
        if config.train.steps < state.step:
            raise CheckpointError(f"train.steps={config.train.steps} is below the {state.step} steps the newest "
                                  f"checkpoint already has", f"pass train.steps={state.step} or more")
        task = load_task(config, plugins)
        check = lambda problems: _refuse_or_warn(problems, allow_config_change, run.warn)  # noqa: E731
        check(compatibility_problems(state, config=config.model_dump(mode="json"), dataset_version=task.version))
        drain_recoveries()  # reports from roles built before this run in this process are not this run's
        roles = run.adopt(place(config, plugins, cache_root=home / "cache", task=task, progress=run.cb.warm_start))
        check(compatibility_problems(state, tokenizer_hash=roles.tokenizer_hash))
        if state.code_version != (now := code_version()):
            run.warn(f"the code changed since checkpoint step {state.step} ({state.code_version} -> {now})")
        report = restore(roles, state, config.checkpoint.shadow_tolerance)
        for note in report.notes:
            run.warn(note)
        run.mark_resumed(state, path, config, {"shadow_max_abs_diff": report.shadow_max_abs_diff,
                                               "skipped": skipped})
    return run.execute(resume=report.resume, resumed_from=path)


def resume_config(state: CheckpointState, config_path: Path | None, overrides: Iterable[str]) -> RunConfig:
    """The config to continue with: the checkpoint's own (or ``config_path``), then ``overrides``."""
    if config_path is not None:
        return load_config(config_path, overrides)
    raw = copy.deepcopy(dict(state.config))
    for item in overrides:
        apply_override(raw, item)
    return validate(raw, source=f"the config of checkpoint step {state.step}")


def resolve_checkpoint(ref: str, open_registry: Callable[[], Registry]) -> tuple[Path, list[str]]:
    """A checkpoint directory for ``ref``: a checkpoint dir, a run dir or a run id (newest verified one)."""
    from rlctl.engine.checkpoint import COMMITTED, verify
    from rlctl.engine.rundir import RunDir

    path = Path(ref).expanduser()
    if (path / COMMITTED).is_file() or (path.is_dir() and path.name.startswith("step-")):
        return path, []
    if RunDir(path).checkpoints.is_dir():
        run_dir = RunDir(path)
    else:
        with open_registry() as registry:
            run_dir = RunDir(registry.get_run(ref).run_dir)
    root = run_dir.checkpoints
    skipped = []
    for candidate, _ in reversed(run_dir.committed()):
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
