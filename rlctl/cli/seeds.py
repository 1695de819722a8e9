"""``rlctl train --seeds N`` and ``rlctl eval RUN1 RUN2 ... | --group G``: several RL seeds, one table."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rlctl.cli import _output
from rlctl.cli._options import open_registry, rlctl_home


def run_seeds(cfg: Any, num_seeds: int, plugins: Any, run_dir: Optional[Path], registry: Optional[str],
              json_out: bool) -> None:
    from rlctl.cli._display import TrainDisplay
    from rlctl.lifecycle.seeds import train_seeds

    with open_registry(registry) as reg, TrainDisplay(cfg.train.steps, _output.err_console) as display:
        callbacks = display.callbacks()
        show_run = callbacks.run_started

        def run_started(run: Any) -> None:
            display.line(f"RL seed {run.seed} ({run.seed - cfg.run.seed + 1} of {num_seeds}), "
                         "from the shared warm start")
            if show_run:
                show_run(run)

        callbacks.run_started = run_started
        try:
            result = train_seeds(cfg, num_seeds, registry=reg, plugins=plugins, home=rlctl_home(), run_dir=run_dir,
                                 callbacks=callbacks)
        except KeyboardInterrupt:
            if display.run_id:
                display.line(f"interrupted: run {display.run_id} is marked 'interrupted'; "
                             f"continue it with `rlctl resume {display.run_id}`")
            raise
    if json_out:
        _output.print_json({"group": result.group, "runs": [r.run for r in result.runs], "wall_s": result.wall_s,
                            "times": result.times, "warm_start": result.warm_start,
                            "evals": [e for e, _ in result.evaluation.evals] if result.evaluation else [],
                            "pooled": _pooled_json(result.evaluation)})
        return
    ws = result.warm_start
    if ws and ws.get("dev_accuracy") is not None:
        _output.console.print(f"warm start: {ws['steps']} SFT steps, dev accuracy {ws['dev_accuracy']:.1%} "
                              f"(target {ws['target']:.0%}{'' if ws.get('reached') else ', NOT reached'})")
    t = result.times
    _output.console.print(f"{num_seeds} seeds (group {result.group}) in {result.wall_s:.1f}s: warm start "
                          f"{t['warm_start_s']:.1f}s, RL {t['rl_s']:.1f}s, eval {t['eval_s']:.1f}s")
    if result.evaluation is not None:
        render_group(result.evaluation, result.group)


def eval_group(runs: list[str], group: Optional[str], split: Optional[str], num_prompts: Optional[int],
               registry: Optional[str], json_out: bool) -> None:
    from rlctl.contracts.errors import RegistryError
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.evaluate import evaluate_runs

    with open_registry(registry) as reg:
        ids = list(runs)
        if group is not None:
            members = reg.runs_in_group(group)
            if not members:
                raise RegistryError(f"no runs in seed group {group!r}",
                                    "`rlctl runs show RUN` lists a run's seed_group event with its group id")
            ids += [m for m in members if m not in ids]
        evaluation = evaluate_runs(reg, load_plugins(), ids, split=split, num_prompts=num_prompts)
    if json_out:
        _output.print_json({"evals": [e for e, _ in evaluation.evals], "pooled": _pooled_json(evaluation)})
    else:
        render_group(evaluation, group)


def render_group(evaluation: Any, group: Optional[str]) -> None:
    first = evaluation.evals[0][0]
    rows = []
    for (record, details), seed in zip(evaluation.evals, evaluation.seeds):
        rows.append((f"{record.run_id} (seed {seed})", f"{record.baseline_pass_at_1 * 100:.1f}",
                     f"{record.candidate_pass_at_1 * 100:.1f}", f"{record.diff * 100:+.1f}",
                     f"[{record.ci_low * 100:+.1f}, {record.ci_high * 100:+.1f}]",
                     f"{details.get('wins', '?')}/{details.get('losses', '?')}"))
    pooled = evaluation.pooled
    if pooled is not None:
        starts = sum(r.baseline_pass_at_1 for r, _ in evaluation.evals) / len(evaluation.evals)
        afters = sum(r.candidate_pass_at_1 for r, _ in evaluation.evals) / len(evaluation.evals)
        rows.append((f"pooled, {len(evaluation.evals)} seeds (mean)", f"{starts * 100:.1f}", f"{afters * 100:.1f}",
                     f"{pooled.diff * 100:+.1f}", f"[{pooled.ci_low * 100:+.1f}, {pooled.ci_high * 100:+.1f}]",
                     f"{evaluation.wins}/{evaluation.losses}"))
    title = (f"{first.split} pass@1, greedy, {first.num_prompts} prompts"
             + (f", seed group {group}" if group else ""))
    _output.console.print(_output.table(title, ["run (RL seed)", "warm start (%)", "after RL (%)", "gain (points)",
                                                "paired bootstrap 95% CI", "wins/losses"], rows))
    rates = [d["tool_call_rate"] for _, d in evaluation.evals if "tool_call_rate" in d]
    if rates:  # episodes: the share of prompts on which the greedy policy called a tool
        start, final = (sum(r[k] for r in rates) / len(rates) for k in ("start", "final"))
        _output.console.print(f"tool-call rate (mean over runs): start {start:.1%} -> final {final:.1%}")
    positive = sum(r.diff > 0 for r, _ in evaluation.evals)
    line = f"gain positive in {positive} of {len(evaluation.evals)} seeds"
    if pooled is not None:
        excludes = pooled.ci_low > 0 or pooled.ci_high < 0
        line += ("; pooled CI (hierarchical bootstrap over seeds and prompts) "
                 + ("excludes 0" if excludes else "includes 0: no significant difference"))
    _output.console.print(line)


def _pooled_json(evaluation: Any) -> Optional[dict[str, float]]:
    if evaluation is None or evaluation.pooled is None:
        return None
    p = evaluation.pooled
    return {"diff": p.diff, "ci_low": p.ci_low, "ci_high": p.ci_high, "num_prompts": p.num_prompts,
            "num_seeds": len(evaluation.evals), "method": "hierarchical bootstrap over seeds and prompts"}
