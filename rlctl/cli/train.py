"""``rlctl train`` and ``rlctl sft``: run a config, with dotted overrides (``--resume`` continues a run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry, rlctl_home

ConfigArg = typer.Argument(..., help="YAML config, e.g. configs/quickstart.yaml.")
OverridesArg = typer.Argument(None, help="Dotted overrides, e.g. algo.group_size=8 train.steps=20.")
AllowChangeOpt = typer.Option(False, "--allow-config-change",
                              help="Resume even if the config (beyond steps, logging, eval and retention), the "
                              "dataset or the tokenizer changed since the checkpoint.")


def train(config: Optional[Path] = typer.Argument(None, help="YAML config, e.g. configs/quickstart.yaml "
                                                  "(optional with --resume: the checkpoint's config is used)."),
          overrides: Optional[List[str]] = OverridesArg,
          run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Where the run's files go."),
          resume: Optional[str] = typer.Option(None, "--resume", help="Continue this run (id or unique prefix) "
                                               "from its newest committed checkpoint instead of starting a new one."),
          allow_config_change: bool = AllowChangeOpt,
          seeds: Optional[int] = typer.Option(None, "--seeds", min=1, max=32, help="Run N RL seeds from the same "
                                              "warm start and report them together (default: train.seeds)."),
          registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt,
          supervise: bool = typer.Option(False, "--supervise", help="Run training in a child process and restart "
                                         "it from the newest committed checkpoint if it crashes "
                                         "(up to faults.max_restarts times).")) -> None:
    """Train a policy: rollout -> reward -> advantage -> update -> weight sync, for train.steps steps."""
    if resume is not None:
        if run_dir is not None:
            raise typer.BadParameter("--run-dir cannot be combined with --resume (a run keeps its directory)")
        if seeds is not None:
            raise typer.BadParameter("--seeds cannot be combined with --resume (resume continues one run)")
        if config is not None and "=" in config.name and not config.exists():  # `train --resume RUN k=v`
            config, overrides = None, [str(config), *(overrides or [])]
        run_resume(resume, config, overrides or [], allow_config_change, registry, json_out)
        return
    if config is None:
        raise typer.BadParameter("missing CONFIG (a YAML file), or pass --resume RUN", param_hint="CONFIG")
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train as run_train

    cfg = load_config(config, overrides or [])
    if supervise:
        _supervised(config, overrides or [], cfg.faults.max_restarts, run_dir, registry, json_out)
        return
    plugins = load_plugins()
    num_seeds = seeds if seeds is not None else cfg.train.seeds
    if num_seeds > 1:
        from rlctl.cli.seeds import run_seeds

        run_seeds(cfg, num_seeds, plugins, run_dir, registry, json_out)
        return
    run_and_render(cfg.train.steps, registry, json_out, lambda reg, cb: run_train(
        cfg, registry=reg, plugins=plugins, home=rlctl_home(), run_dir=run_dir, callbacks=cb))


def run_resume(run: str, config: Optional[Path], overrides: List[str], allow_config_change: bool,
               registry: Optional[str], json_out: bool) -> None:
    """``rlctl resume`` / ``rlctl train --resume``: continue a run from its newest committed checkpoint."""
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.resume import resume

    plugins = load_plugins()
    run_and_render(0, registry, json_out, lambda reg, cb: resume(
        run, registry=reg, plugins=plugins, home=rlctl_home(), config_path=config, overrides=overrides,
        allow_config_change=allow_config_change, callbacks=cb))


def run_and_render(total_steps: int, registry: Optional[str], json_out: bool, go: Callable[[Any, Any], Any]) -> None:
    """Run ``go(registry, callbacks)`` under the live display, then print the result."""
    from rlctl.cli._display import TrainDisplay
    from rlctl.cli.eval import render_eval

    with open_registry(registry) as reg, TrainDisplay(total_steps, _output.err_console) as display:
        try:
            result = go(reg, display.callbacks())
        except KeyboardInterrupt:
            if display.run_id:
                display.line(f"interrupted: run {display.run_id} is marked 'interrupted'; "
                             f"continue it with `rlctl resume {display.run_id}`")
            raise
    if json_out:
        _output.print_json({"run": result.run, "last_metrics": result.last_metrics, "wall_s": result.wall_s,
                            "eval": result.eval, "resumed_from": result.resumed_from, "first_step": result.first_step})
        return
    _output.console.print(f"run {result.run.id} {result.run.status} in {result.wall_s:.1f}s"
                          + (f" (resumed at step {result.first_step})" if result.resumed_from else ""))
    if result.eval is not None:
        render_eval(result.eval, result.eval_details)


def sft(config: Path = ConfigArg, overrides: Optional[List[str]] = OverridesArg, json_out: bool = JsonOpt) -> None:
    """Build and warm-start (SFT) the built-in model for a config, and print its cached directory."""
    from rlctl.cli._display import TrainDisplay
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError
    from rlctl.placement.build import load_task, resolve_policy_dir
    from rlctl.hooks.manager import load_plugins

    cfg = load_config(config, overrides or [])
    if not cfg.model.builtin:
        raise ConfigError("rlctl sft warm-starts the built-in model only", "set model.path=builtin:tiny")
    task = load_task(cfg, load_plugins())
    with TrainDisplay(0, _output.err_console) as display:
        path = resolve_policy_dir(cfg, task, rlctl_home() / "cache", display.warm_start)
    if json_out:
        _output.print_json({"policy_dir": str(path), "dataset_version": task.version})
    else:
        _output.console.print(f"warm-started policy: {path}")


def _supervised(config: Path, overrides: List[str], max_restarts: int, run_dir: Optional[Path],
                registry: Optional[str], json_out: bool) -> None:
    """``train --supervise``: the child trains; a crash is resumed from the newest committed checkpoint."""
    import time

    from rlctl.lifecycle.supervise import supervise

    directory = run_dir or rlctl_home() / "runs" / f"supervised-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6}"
    env = {"RLCTL_REGISTRY_URL": registry} if registry else {}
    result = supervise([str(config), *overrides, *(["--json"] if json_out else [])], directory,
                       max_restarts=max_restarts, open_registry=lambda: open_registry(registry), env=env,
                       say=lambda m: _output.err_console.print(m, markup=False, highlight=False))
    if not json_out:
        _output.console.print(f"supervisor: run {result.run_id} exit {result.exit_code} after {result.restarts} "
                              f"restart(s) in {result.wall_s:.1f}s")
    if result.exit_code and result.crashes and result.exit_code >= 128:  # killed again after the last restart
        import sys

        rid = result.run_id or "RUN"
        print(f"error: run {rid} cannot recover: training {result.crashes[-1]['cause']} again after "
              f"{result.restarts} restart(s) (faults.max_restarts={max_restarts})", file=sys.stderr)
        print(f"hint: see `rlctl runs show {rid}` and `rlctl diagnose {rid}`; a process killed again and again is "
              "most often the kernel's OOM killer: `rlctl runbook show oom`", file=sys.stderr)
    if result.exit_code:
        raise typer.Exit(result.exit_code)
