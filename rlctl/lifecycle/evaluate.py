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
                 ks: Sequence[int] | None = None, samples: int | None = None) -> tuple[EvalRecord, dict[str, Any]]:
    return evaluate_runs(registry, plugins, [run_id], split, num_prompts, progress, ks, samples).evals[0]


def evaluate_runs(registry: Registry, plugins: Plugins, run_ids: Sequence[str], split: str | None = None,
                  num_prompts: int | None = None, progress: Callable[[str], None] | None = None,
                  ks: Sequence[int] | None = None, samples: int | None = None) -> GroupEval:
    """Grade each run's start and final policy on the same prompts; pooled over the runs when there are several."""
    from rlctl.lifecycle.grading import pooled_bootstrap

    if not run_ids:
        raise RegistryError("no runs to evaluate", "name at least one run id")
    runs = [registry.get_run(r) for r in run_ids]
    if len({r.id for r in runs}) != len(runs):
        raise RegistryError("a run is named twice", "name each run once")
    grader = _Grader(plugins, progress, ks, samples)
    out: list[tuple[EvalRecord, dict[str, Any]]] = []
    pairs, prompt_ids = [], None
    for run in runs:
        record, details, base, final, ids = grader.evaluate(run, split, num_prompts)
        if prompt_ids is not None and ids != prompt_ids:
            raise DataError(f"run {run.id} is evaluated on other prompts than {runs[0].id} (dataset, split or "
                            "eval.num_prompts differ), so their results cannot be pooled",
                            "evaluate runs of one config together, e.g. the seeds of one `rlctl train --seeds`")
        prompt_ids = ids
        pairs.append((base.correct, final.correct))
        registry.add_eval(record)
        calls = (f"; tool-call rate {base.tool_call_rate:.3f} -> {final.tool_call_rate:.3f}"
                 if final.tool_call_rate is not None else "")
        registry.add_event(run.id, "eval", f"{record.split} pass@1 {base.pass_at_1:.3f} -> {final.pass_at_1:.3f} "
                           f"(diff {record.diff:+.3f}, 95% CI [{record.ci_low:+.3f}, {record.ci_high:+.3f}]){calls}")
        out.append((record, details))
    result = GroupEval(evals=out, seeds=[r.seed for r in runs], wins=sum(d["wins"] for _, d in out),
                       losses=sum(d["losses"] for _, d in out))
    if len(runs) > 1:
        first = RunConfig.model_validate(runs[0].config)
        result.pooled = pooled_bootstrap(pairs, samples=first.eval.bootstrap_samples, seed=first.run.seed)
    return result


class _Grader:
    """Grades runs' policies, loading each task once and grading each (policy, decoding) once."""

    def __init__(self, plugins: Plugins, progress: Callable[[str], None] | None, ks: Sequence[int] | None = None,
                 samples: int | None = None) -> None:
        self.plugins, self.progress = plugins, progress
        self.ks, self.samples = list(ks or []), samples
        self.tasks: dict[str, Any] = {}
        self.graded: dict[tuple[str, str], Any] = {}  # (policy dir, decoding settings) -> PolicyScores

    def evaluate(self, run: Any, split: str | None, num_prompts: int | None) -> tuple[EvalRecord, dict, Any, Any,
                                                                                       list[str]]:
        """(record, details, start scores, final scores, prompt ids) of one run."""
        from rlctl.lifecycle.grading import paired_bootstrap

        config = RunConfig.model_validate(run.config)
        run_split = split or config.eval.split
        initial_dir, final_dir = _policy_dirs(run)
        records = self._task(run, config).split(run_split)
        limit = num_prompts if num_prompts is not None else config.eval.num_prompts
        records = records[:limit] if limit else records
        decoding = json.dumps([run_split, [r.id for r in records[:1]], len(records), config.eval.max_tokens,
                               config.rollout.backend, config.rollout.options, config.reward.model_dump(mode="json")],
                              sort_keys=True)
        base = self._grade("start", initial_dir, run, config, records, run_split, decoding)
        final = self._grade("final", final_dir, run, config, records, run_split, decoding)
        comp = paired_bootstrap(base.correct, final.correct, samples=config.eval.bootstrap_samples,
                                seed=config.run.seed)
        failures = [{"prompt": r.text, "answer": r.answer, "response": resp}
                    for r, ok, resp in zip(records, final.correct, final.responses) if not ok][:5]
        details = {"fixed_decoding": {"temperature": 0.0, "max_tokens": config.eval.max_tokens},
                   "failure_samples": failures, "wins": sum(f > b for b, f in zip(base.correct, final.correct)),
                   "losses": sum(f < b for b, f in zip(base.correct, final.correct)),
                   "baseline_dir": str(initial_dir), "candidate_dir": str(final_dir)}
        if final.tool_call_rate is not None:  # episodes: how often each policy called a tool
            details["tool_call_rate"] = {"start": base.tool_call_rate, "final": final.tool_call_rate}
        if final.apart is not None:  # eval.grader: pass@1 is its; the training reward on the same answers beside it
            details["eval_grader"] = {"start": base.apart, "final": final.apart}
        if self.ks:
            details["pass_at_k"] = self._pass_at_k(run, config, records, initial_dir, final_dir)
        record = EvalRecord(run_id=run.id, split=run_split, num_prompts=len(records), baseline_name="start",
                            candidate_name="final", baseline_pass_at_1=base.pass_at_1,
                            candidate_pass_at_1=final.pass_at_1, diff=comp.diff, ci_low=comp.ci_low,
                            ci_high=comp.ci_high, created_at=time.time(), details=details)
        return record, details, base, final, [r.id for r in records]

    def _pass_at_k(self, run: Any, config: RunConfig, records: Sequence[Any], initial_dir: Path,
                   final_dir: Path) -> dict[str, Any]:
        """pass@k of the start and the final policy: n sampled answers per prompt at rollout.temperature."""
        from rlctl.lifecycle.grading import sample_policy
        from rlctl.lifecycle.passk import samples_for, summarize

        n = samples_for(self.ks, self.samples, config.rollout.temperature)
        temperature = config.rollout.temperature if n > 1 else 0.0
        out: dict[str, Any] = {"n": n, "temperature": temperature, "ks": self.ks}
        for name, policy_dir in (("start", initial_dir), ("final", final_dir)):
            if self.progress:
                self.progress(f"sampling {n} answers per prompt from the {name} policy of run {run.id}")
            scores = sample_policy(policy_dir, config, self.plugins, self._task(run, config), records, n, temperature)
            out[name] = summarize(scores.counts, n, self.ks, [r.id for r in records],
                                  config.eval.bootstrap_samples, config.run.seed)
            if scores.grader is not None:  # eval.grader counted the correct samples: which one, which version
                out["grader"] = scores.grader
        return out

    def _task(self, run: Any, config: RunConfig) -> Any:
        from rlctl.placement.build import load_task

        key = json.dumps([config.task.model_dump(mode="json"), run.dataset_version], sort_keys=True)
        if key not in self.tasks:
            self.tasks[key] = load_task(config, self.plugins)
        task = self.tasks[key]
        if task.version != run.dataset_version:
            raise DataError(f"the task data changed since run {run.id} (dataset version {task.version} != "
                            f"{run.dataset_version})", "evaluate on the data the run trained with")
        return task

    def _grade(self, name: str, policy_dir: Path, run: Any, config: RunConfig, records: Sequence[Any],
               split: str, decoding: str) -> Any:
        from rlctl.lifecycle.grading import grade_policy

        key = (str(policy_dir.resolve()), decoding)
        if key not in self.graded:
            if self.progress:
                self.progress(f"grading the {name} policy of run {run.id} on {len(records)} {split} prompts")
            self.graded[key] = grade_policy(name, policy_dir, config, self.plugins, self._task(run, config), records)
        return self.graded[key]


def _policy_dirs(run: Any) -> tuple[Path, Path]:
    """(the run's starting policy, its final policy); RegistryError when the run did not finish."""
    run_dir = Path(run.run_dir)
    final_dir, info_path = run_dir / "policy" / "final", run_dir / "run.json"
    if not final_dir.is_dir() or not info_path.is_file():
        raise RegistryError(f"run {run.id} has no final policy in {final_dir} (status: {run.status})",
                            "evaluate a run that finished, or re-run it")
    return Path(json.loads(info_path.read_text())["initial_policy"]), final_dir
