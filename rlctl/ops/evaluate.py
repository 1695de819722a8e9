"""Evaluate a run: hidden-split greedy pass@1 of its final policy vs its starting policy.

What this is: ``evaluate_run()``, behind ``rlctl eval RUN`` and the end of
``rlctl train``. It reloads the run's task and refuses if its content hash no
longer matches the run's dataset version, grades both policies on the same
prompts with fixed greedy decoding, computes a paired bootstrap 95% CI of the
difference, and stores the result in the registry.

What this is not: grading logic (rlctl.engine.eval).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import DataError, RegistryError
from rlctl.contracts.types import EvalRecord
from rlctl.hooks.manager import Plugins
from rlctl.registry.store import Registry


def evaluate_run(registry: Registry, plugins: Plugins, run_id: str, split: str | None = None,
                 num_prompts: int | None = None, progress: Callable[[str], None] | None = None,
                 ) -> tuple[EvalRecord, dict[str, Any]]:
    from rlctl.engine.eval import grade_policy, paired_bootstrap
    from rlctl.engine.session import load_task

    run = registry.get_run(run_id)
    config = RunConfig.model_validate(run.config)
    split = split or config.eval.split
    run_dir = Path(run.run_dir)
    final_dir = run_dir / "policy" / "final"
    info_path = run_dir / "run.json"
    if not final_dir.is_dir() or not info_path.is_file():
        raise RegistryError(f"run {run.id} has no final policy in {final_dir} (status: {run.status})",
                            "evaluate a run that finished, or re-run it")
    initial_dir = Path(json.loads(info_path.read_text())["initial_policy"])
    task = load_task(config, plugins)
    if task.version != run.dataset_version:
        raise DataError(f"the task data changed since run {run.id} (dataset version {task.version} != "
                        f"{run.dataset_version})", "evaluate on the data the run trained with")
    records = task.split(split)
    limit = num_prompts if num_prompts is not None else config.eval.num_prompts
    if limit:
        records = records[:limit]
    if progress:
        progress(f"grading the starting policy on {len(records)} {split} prompts")
    base = grade_policy("start", initial_dir, config, plugins, task, records)
    if progress:
        progress(f"grading the final policy on {len(records)} {split} prompts")
    final = grade_policy("final", final_dir, config, plugins, task, records)
    comp = paired_bootstrap(base.correct, final.correct, samples=config.eval.bootstrap_samples, seed=config.run.seed)
    failures = [{"prompt": r.text, "answer": r.answer, "response": resp}
                for r, ok, resp in zip(records, final.correct, final.responses) if not ok][:5]
    details = {"fixed_decoding": {"temperature": 0.0, "max_tokens": config.eval.max_tokens},
               "failure_samples": failures, "wins": sum(f > b for b, f in zip(base.correct, final.correct)),
               "losses": sum(f < b for b, f in zip(base.correct, final.correct)),
               "baseline_dir": str(initial_dir), "candidate_dir": str(final_dir)}
    record = EvalRecord(run_id=run.id, split=split, num_prompts=len(records), baseline_name="start",
                        candidate_name="final", baseline_pass_at_1=base.pass_at_1,
                        candidate_pass_at_1=final.pass_at_1, diff=comp.diff, ci_low=comp.ci_low,
                        ci_high=comp.ci_high, created_at=time.time(), details=details)
    registry.add_eval(record)
    registry.add_event(run.id, "eval", f"{split} pass@1 {base.pass_at_1:.3f} -> {final.pass_at_1:.3f} "
                       f"(diff {comp.diff:+.3f}, 95% CI [{comp.ci_low:+.3f}, {comp.ci_high:+.3f}])")
    return record, details
