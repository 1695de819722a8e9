"""``rlctl train`` and ``rlctl sft``: run a config, with dotted overrides."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry, rlctl_home

ConfigArg = typer.Argument(..., help="YAML config, e.g. configs/quickstart.yaml.")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. algo.group_size=8 train.steps=20.")


def train(config: Path = ConfigArg, overrides: Optional[List[str]] = OverridesArg,
          run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the run's files go."),
          registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Train a policy: rollout -> reward -> advantage -> update -> weight sync, for train.steps steps."""
    from rlctl.cli._display import TrainDisplay
    from rlctl.cli.eval import render_eval
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.ops.train import train as run_train

    cfg = load_config(config, overrides or [])
    plugins = load_plugins()
    with open_registry(registry) as reg, TrainDisplay(cfg.train.steps, _output.err_console) as display:
        result = run_train(cfg, registry=reg, plugins=plugins, home=rlctl_home(), run_dir=run_dir,
                           callbacks=display.callbacks())
    if json_out:
        _output.print_json({"run": result.run, "last_metrics": result.last_metrics, "wall_s": result.wall_s,
                            "eval": result.eval})
        return
    _output.console.print(f"run {result.run.id} {result.run.status} in {result.wall_s:.1f}s")
    if result.eval is not None:
        render_eval(result.eval, result.eval_details)


def sft(config: Path = ConfigArg, overrides: Optional[List[str]] = OverridesArg, json_out: bool = JsonOpt) -> None:
    """Build and warm-start (SFT) the built-in model for a config, and print its cached directory."""
    from rich.progress import Progress

    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError
    from rlctl.engine.session import load_task, resolve_policy_dir
    from rlctl.hooks.manager import load_plugins

    cfg = load_config(config, overrides or [])
    if not cfg.model.builtin:
        raise ConfigError("rlctl sft warm-starts the built-in model only", "set model.path=builtin:tiny")
    task = load_task(cfg, load_plugins())
    with Progress(console=_output.err_console) as progress:
        bar = progress.add_task("warm start (SFT)", total=cfg.model.warm_start.steps)
        path = resolve_policy_dir(cfg, task, rlctl_home() / "cache",
                                  lambda step, total, loss: progress.update(bar, completed=step))
    if json_out:
        _output.print_json({"policy_dir": str(path), "dataset_version": task.version})
    else:
        _output.console.print(f"warm-started policy: {path}")
