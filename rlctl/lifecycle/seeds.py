"""Several RL seeds from one warm start, evaluated together: ``rlctl train --seeds N``.

What this is: ``train_seeds()``. It runs ``train()`` once per RL seed
(``run.seed``, ``run.seed + 1``, ...), each its own registry run with its own
run directory, all starting from the same cached warm start (the warm start's
seed is pinned to the first seed's, so only the first run builds it). Each
run joins a seed group (a ``seed_group`` event whose message is the group id,
so ``rlctl eval --group G`` finds them). At the end the group is evaluated at
once: the shared starting policy is graded once, each final policy once, each
seed gets its paired bootstrap CI and the group a pooled CI (hierarchical
bootstrap over seeds and prompts, rlctl.lifecycle.grading.pooled_bootstrap).

What this is not: a sweep (settings stay fixed; only the RL seed changes) or
parallel training (seeds run one after another in this process).
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rlctl.config.models import RunConfig
from rlctl.hooks.manager import Plugins
from rlctl.lifecycle.evaluate import GroupEval
from rlctl.lifecycle.train import TrainCallbacks, TrainResult
from rlctl.registry.store import Registry


@dataclass
class SeedsResult:
    group: str
    runs: list[TrainResult]
    evaluation: GroupEval | None
    wall_s: float
    times: dict[str, float] = field(default_factory=dict)  # warm_start_s, rl_s (all seeds), eval_s
    warm_start: dict[str, Any] | None = None  # where the warm start stopped (rlctl.models.warm_start)


def seed_configs(config: RunConfig, num_seeds: int) -> list[RunConfig]:
    """One config per RL seed: consecutive ``run.seed``, one pinned warm-start seed, evaluation left to the group."""
    from rlctl.models.warm_start import warm_start_seed

    base = config.model_dump(mode="json")
    base["model"]["warm_start"]["seed"] = warm_start_seed(config.model, config.run.seed)
    base["train"]["seeds"] = 1
    base["eval"]["at_end"] = False
    out = []
    for i in range(num_seeds):
        base["run"]["seed"] = config.run.seed + i
        out.append(RunConfig.model_validate(base))
    return out


def train_seeds(config: RunConfig, num_seeds: int, *, registry: Registry, plugins: Plugins, home: Path,
                run_dir: Path | None = None, callbacks: TrainCallbacks | None = None) -> SeedsResult:
    from rlctl.lifecycle.evaluate import evaluate_runs
    from rlctl.lifecycle.train import train

    cb = callbacks or TrainCallbacks()
    group = f"seeds-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    started = time.perf_counter()
    warm = {"first": None, "last": None}

    def on_warm(*args: Any) -> None:
        now = time.perf_counter()
        warm["first"] = warm["first"] or now
        warm["last"] = now
        if cb.warm_start:
            cb.warm_start(*args)

    results: list[TrainResult] = []
    for i, seed_config in enumerate(seed_configs(config, num_seeds)):

        def joined(run: Any, i: int = i, seed: int = seed_config.run.seed) -> None:
            registry.add_event(run.id, "seed_group", group, {"group": group, "index": i, "num_seeds": num_seeds,
                                                             "seed": seed})
            if cb.run_started:
                cb.run_started(run)

        seed_cb = replace(cb, warm_start=on_warm, run_started=joined)
        directory = run_dir / f"seed-{seed_config.run.seed}" if run_dir is not None else None
        results.append(train(seed_config, registry=registry, plugins=plugins, home=home, run_dir=directory,
                             callbacks=seed_cb))
    rl_done = time.perf_counter()
    evaluation = None
    if config.eval.at_end:
        evaluation = evaluate_runs(registry, plugins, [r.run.id for r in results], progress=cb.eval_progress)
        pooled = evaluation.pooled
        if pooled is not None:
            for r in results:
                registry.add_event(r.run.id, "group_eval", f"group {group}: pooled diff {pooled.diff:+.3f}, 95% CI "
                                   f"[{pooled.ci_low:+.3f}, {pooled.ci_high:+.3f}] over {num_seeds} seeds",
                                   {"group": group, "diff": pooled.diff, "ci_low": pooled.ci_low,
                                    "ci_high": pooled.ci_high})
    end = time.perf_counter()
    warm_s = (warm["last"] - started) if warm["last"] is not None else 0.0
    times = {"warm_start_s": warm_s, "rl_s": rl_done - started - warm_s, "eval_s": end - rl_done}
    return SeedsResult(group=group, runs=results, evaluation=evaluation, wall_s=end - started, times=times,
                       warm_start=_warm_start_info(results))


def _warm_start_info(results: list[TrainResult]) -> dict[str, Any] | None:
    import json

    from rlctl.models.warm_start import warm_start_info

    if not results:
        return None
    info_path = Path(results[0].run.run_dir) / "run.json"
    if not info_path.is_file():
        return None
    return warm_start_info(Path(json.loads(info_path.read_text())["initial_policy"]))
