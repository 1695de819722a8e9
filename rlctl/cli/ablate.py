"""``rlctl ablate``: run a matrix of config cells x seeds at an equal budget (tokens or seconds) and print the comparison."""

from __future__ import annotations

from pathlib import Path
from typing import List, Mapping, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry, rlctl_home


def ablate(config: Path = typer.Argument(..., help="YAML config, e.g. configs/quickstart.yaml."),
           overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides applied to every cell, "
                                                           "e.g. train.steps=20."),
           axis: List[str] = typer.Option(..., "--axis", help="KEY=v1,v2[,...]: one axis of the matrix (repeat "
                                          "for more); the first value of every axis is the baseline cell."),
           seeds: int = typer.Option(3, "--seeds", help="Seeds per cell (run.seed, run.seed+1, ...)."),
           budget_tokens: Optional[int] = typer.Option(None, "--budget-tokens", min=1, help="Generated response "
                                                       "tokens per run (default: what the baseline cell's first "
                                                       "seed generates in train.steps steps)."),
           budget: Optional[str] = typer.Option(None, "--budget", help="tokens, wall-seconds or device-seconds, "
                                                "optionally =N: every run gets the same generated tokens, RL "
                                                "wall-clock seconds, or RL seconds x the devices its learner and "
                                                "rollout use (default amount: what the baseline cell's first seed "
                                                "spends in train.steps steps). Default: tokens."),
           old_set: Optional[List[str]] = typer.Option(None, "--set", hidden=True),
           registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Compare config choices honestly: same warm start, same budget (generated tokens, or RL seconds with
    --budget), several seeds, paired bootstrap CIs on the hidden split. Re-running the same command continues an interrupted ablation."""
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle import ablate as ops

    if old_set:  # the one override syntax of every command that takes a config: positional, after CONFIG
        raise ConfigError("rlctl ablate takes overrides after the config, not as --set",
                          f"rlctl ablate {config} {' '.join(old_set)} --axis ...")
    home = rlctl_home()
    p = ops.plan(load_config(config, overrides or []), axis, seeds, budget_tokens, budget)
    plugins = load_plugins()
    with open_registry(registry) as reg:
        with _Display(len(p.cells) * len(p.seeds)) as display:
            ablation = ops.run_ablation(p, name=f"{p.base.run.name}-ablate", registry=reg, plugins=plugins,
                                        home=home, callbacks=display.callbacks())
        rep = ops.report(reg, ablation.id, samples=p.base.eval.bootstrap_samples)
        rep.plot = str(ops.plot_curves(reg, rep, home / "ablations" / ablation.id / "curves.png"))
    if json_out:
        _output.print_json(ops.as_json(rep))
        return
    render(rep, ops.summary_rows(rep))


def render(rep, rows) -> None:
    from rlctl.lifecycle.ablate import COST_COLUMNS, cost_rows

    budget = (f"{rep.budget_tokens} generated tokens" if rep.budget_kind == "tokens"
              else f"{rep.budget_seconds:.1f} {rep.budget_kind}" if rep.budget_seconds is not None
              else f"{rep.budget_kind} (not set yet)")
    _output.console.print(f"ablation {rep.ablation.id} ({rep.ablation.status}): budget {budget} per run; hidden "
                          f"split {rep.num_prompts} prompts, warm start pass@1 {rep.warm_start_pass_at_1:.3f}")
    _output.console.print(_output.table(
        None, ["cell", "seeds", "pass@1", "gain vs warm start [95% CI]", f"vs {rep.baseline} pooled [95% CI]",
               "vs baseline per seed", "tokens mean (min-max)", "wall s"], rows))
    _output.console.print(_output.table("cost per run: mean (min-max) over seeds", COST_COLUMNS, cost_rows(rep)))
    if rep.missing:
        _output.console.print(f"not finished: {', '.join(rep.missing)}")
    _output.console.print(f"learning curves: {rep.plot}")


class _Display:
    """One bar over the runs of the matrix and one over the steps of the current run."""

    def __init__(self, total_runs: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                 console=_output.err_console)
        self.runs = self.progress.add_task("ablation", total=total_runs, info="")
        self.steps = None

    def __enter__(self) -> "_Display":
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def callbacks(self):
        from rlctl.lifecycle.ablate import AblateCallbacks
        from rlctl.lifecycle.train import TrainCallbacks

        return AblateCallbacks(run_start=self.run_start, run_end=self.run_end, skipped=self.skipped,
                               note=self.progress.console.print,
                               train=TrainCallbacks(step=self.step, warning=self.progress.console.print))

    def run_start(self, cell: str, seed: int, index: int, total: int) -> None:
        if self.steps is not None:
            self.progress.remove_task(self.steps)
        self.steps = self.progress.add_task(f"{cell} seed {seed}", total=None, info="")

    def run_end(self, cell: str, seed: int, status: str, wall_s: float) -> None:
        self.progress.console.print(f"{cell} seed {seed}: {status} in {wall_s:.0f}s")
        self.progress.advance(self.runs)

    def skipped(self, cell: str, seed: int) -> None:
        self.progress.console.print(f"{cell} seed {seed}: done earlier, skipped")
        self.progress.advance(self.runs)

    def step(self, step: int, metrics: Mapping[str, float]) -> None:
        reward, tokens = metrics.get("reward_mean", float("nan")), metrics.get("generated_tokens_total", 0.0)
        info = f"reward {reward:.3f}  tokens {tokens:.0f}"
        self.progress.update(self.steps, completed=step + 1, info=info)
