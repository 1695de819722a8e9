"""Evaluate runs: hidden-split greedy pass@1 of each final policy vs its starting policy.

What this is: ``evaluate_run()``, behind ``rlctl eval RUN`` and the end of
``rlctl train``, and ``evaluate_runs()`` for several runs at once (the RL
seeds of ``rlctl train --seeds``, ``rlctl eval RUN1 RUN2 ...``). It reloads
each run's task and refuses if its content hash no longer matches the run's
dataset version, grades both policies on the same prompts with fixed greedy
decoding (a starting policy shared by several runs is graded once), computes
a paired bootstrap 95% CI of each difference and, for several runs, a pooled
CI (hierarchical bootstrap over seeds and prompts), and stores each run's
result in the registry.

What this is not: grading logic (rlctl.lifecycle.grading).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import DataError, RegistryError
from rlctl.contracts.types import EvalRecord
from rlctl.hooks.manager import Plugins
from rlctl.registry.store import Registry


@dataclass
class GroupEval:
    """Per-run evals of several runs on the same prompts, and their pooled difference (None for one run)."""

    evals: list[tuple[EvalRecord, dict[str, Any]]]
    seeds: list[int]  # each run's run.seed, in the order of evals
    pooled: Any = None  # rlctl.lifecycle.grading.Comparison
    wins: int = 0
    losses: int = 0


def evaluate_run(registry: Registry, plugins: Plugins, run_id: str, split: str | None = None,
                 num_prompts: int | None = None, progress: Callable[[str], None] | None = None,
                 ) -> tuple[EvalRecord, dict[str, Any]]:
    return evaluate_runs(registry, plugins, [run_id], split, num_prompts, progress).evals[0]


def evaluate_runs(registry: Registry, plugins: Plugins, run_ids: Sequence[str], split: str | None = None,
                  num_prompts: int | None = None, progress: Callable[[str], None] | None = None) -> GroupEval:
    from rlctl.lifecycle.grading import grade_policy, paired_bootstrap, pooled_bootstrap
    from rlctl.placement.build import load_task

    if not run_ids:
        raise RegistryError("no runs to evaluate", "name at least one run id")
    runs = [registry.get_run(r) for r in run_ids]
    if len({r.id for r in runs}) != len(runs):
        raise RegistryError("a run is named twice", "name each run once")
    tasks: dict[str, Any] = {}
    graded: dict[tuple[str, str], Any] = {}  # (policy dir, decoding settings) -> PolicyScores
    out: list[tuple[EvalRecord, dict[str, Any]]] = []
    pairs, prompt_ids = [], None
    for run in runs:
        config = RunConfig.model_validate(run.config)
        run_split = split or config.eval.split
        run_dir = Path(run.run_dir)
        final_dir = run_dir / "policy" / "final"
        info_path = run_dir / "run.json"
        if not final_dir.is_dir() or not info_path.is_file():
            raise RegistryError(f"run {run.id} has no final policy in {final_dir} (status: {run.status})",
                                "evaluate a run that finished, or re-run it")
        initial_dir = Path(json.loads(info_path.read_text())["initial_policy"])
        task_key = json.dumps([config.task.model_dump(mode="json"), run.dataset_version], sort_keys=True)
        if task_key not in tasks:
            tasks[task_key] = load_task(config, plugins)
        task = tasks[task_key]
        if task.version != run.dataset_version:
            raise DataError(f"the task data changed since run {run.id} (dataset version {task.version} != "
                            f"{run.dataset_version})", "evaluate on the data the run trained with")
        records = task.split(run_split)
        limit = num_prompts if num_prompts is not None else config.eval.num_prompts
        if limit:
            records = records[:limit]
        ids = [r.id for r in records]
        if prompt_ids is not None and ids != prompt_ids:
            raise DataError(f"run {run.id} is evaluated on other prompts than {runs[0].id} (dataset, split or "
                            "eval.num_prompts differ), so their results cannot be pooled",
                            "evaluate runs of one config together, e.g. the seeds of one `rlctl train --seeds`")
        prompt_ids = ids
        decoding = json.dumps([run_split, ids[:1], len(ids), config.eval.max_tokens, config.rollout.backend,
                               config.rollout.options, config.reward.model_dump(mode="json")], sort_keys=True)

        def grade(name: str, policy_dir: Path) -> Any:
            key = (str(policy_dir.resolve()), decoding)
            if key not in graded:
                if progress:
                    progress(f"grading the {name} policy of run {run.id} on {len(records)} {run_split} prompts")
                graded[key] = grade_policy(name, policy_dir, config, plugins, task, records)
            return graded[key]

        base, final = grade("start", initial_dir), grade("final", final_dir)
        comp = paired_bootstrap(base.correct, final.correct, samples=config.eval.bootstrap_samples,
                                seed=config.run.seed)
        pairs.append((base.correct, final.correct))
        failures = [{"prompt": r.text, "answer": r.answer, "response": resp}
                    for r, ok, resp in zip(records, final.correct, final.responses) if not ok][:5]
        details = {"fixed_decoding": {"temperature": 0.0, "max_tokens": config.eval.max_tokens},
                   "failure_samples": failures, "wins": sum(f > b for b, f in zip(base.correct, final.correct)),
                   "losses": sum(f < b for b, f in zip(base.correct, final.correct)),
                   "baseline_dir": str(initial_dir), "candidate_dir": str(final_dir)}
        record = EvalRecord(run_id=run.id, split=run_split, num_prompts=len(records), baseline_name="start",
                            candidate_name="final", baseline_pass_at_1=base.pass_at_1,
                            candidate_pass_at_1=final.pass_at_1, diff=comp.diff, ci_low=comp.ci_low,
                            ci_high=comp.ci_high, created_at=time.time(), details=details)
        registry.add_eval(record)
        registry.add_event(run.id, "eval", f"{run_split} pass@1 {base.pass_at_1:.3f} -> {final.pass_at_1:.3f} "
                           f"(diff {comp.diff:+.3f}, 95% CI [{comp.ci_low:+.3f}, {comp.ci_high:+.3f}])")
        out.append((record, details))
    result = GroupEval(evals=out, seeds=[r.seed for r in runs], wins=sum(d["wins"] for _, d in out), losses=sum(d["losses"] for _, d in out))
    if len(runs) > 1:
        first = RunConfig.model_validate(runs[0].config)
        result.pooled = pooled_bootstrap(pairs, samples=first.eval.bootstrap_samples, seed=first.run.seed)
    return result
