"""Train a run end to end with its bookkeeping: registry row, run dir, final policy.

What this is: ``train()``, the library function behind ``rlctl train``. It
builds every role first (so bad config, plugins, data or model fail before a
run row exists), then records the run with its provenance (config hash, code
version, dataset version, tokenizer hash, seed), runs the loop, saves the final
policy, and marks the run succeeded / failed / interrupted.

What this is not: the loop (rlctl.engine.loop) or its display (the CLI).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from rlctl.config.load import config_hash
from rlctl.config.models import RunConfig
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


@dataclass
class TrainResult:
    run: RunRecord
    last_metrics: dict[str, float]
    wall_s: float
    eval: EvalRecord | None = None
    eval_details: dict[str, Any] = field(default_factory=dict)


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
    from rlctl.engine.loop import run_sync
    from rlctl.engine.session import build_session

    cb = callbacks or TrainCallbacks()
    started = time.perf_counter()
    session = build_session(config, plugins, cache_root=home / "cache", progress=cb.warm_start)
    run = registry.create_run(
        name=config.run.name, config=config.model_dump(mode="json"), config_hash=config_hash(config),
        code_version=code_version(), dataset_version=session.task.version, tokenizer_hash=session.tokenizer_hash,
        seed=config.run.seed, run_dir=str(run_dir) if run_dir else "",
    )
    directory = run_dir or home / "runs" / run.id
    sinks: list[Any] = []
    status = "failed"
    try:
        if not run_dir:
            run = registry.update_run(run.id, run_dir=str(directory))
        _write_run_files(directory, config, run, session.policy_dir)
        if cb.run_started:
            cb.run_started(run)
        sinks = [RegistrySink(registry, run.id)] + [
            plugins.build("metric_sink", name, {}, f"train.metric_sinks.{i}", run_dir=directory, run_id=run.id)
            for i, name in enumerate(config.train.metric_sinks)
        ]
        plugins.pm.hook.on_run_start(run_id=run.id, config=run.config)

        def on_step(step: int, metrics: Mapping[str, float]) -> None:
            plugins.pm.hook.on_step_end(run_id=run.id, step=step, metrics=metrics)
            if cb.step:
                cb.step(step, metrics)

        last = run_sync(session, sinks, on_step)
        _save_policy(session, directory / "policy" / "final")
        status = "succeeded"
    except KeyboardInterrupt:
        status = "interrupted"
        registry.add_event(run.id, "interrupted", "stopped by the user (SIGINT)")
        raise
    except BaseException as err:
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
    wall = time.perf_counter() - started
    registry.add_event(run.id, "finished", f"{config.train.steps} steps in {wall:.1f}s", {"wall_s": wall})
    result = TrainResult(run=registry.get_run(run.id), last_metrics=dict(last), wall_s=wall)
    if config.eval.at_end:
        from rlctl.ops.evaluate import evaluate_run

        result.eval, result.eval_details = evaluate_run(registry, plugins, run.id, progress=cb.eval_progress)
    return result


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
