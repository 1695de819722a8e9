"""``rlctl inject --fault KIND`` and ``rlctl drill``: thin renderers over rlctl.incidents.inject / drill."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry, rlctl_home


def inject(fault: str = typer.Option(..., "--fault", help="Fault kind: nan, oom, verifier-timeout, verifier-error, tool-timeout, tool-error, "
                                     "bad-checkpoint, learner-crash, slow-rollout, slow-learner, worker-crash, "
                                     "network-partition, weight-sync-failure (`rlctl plugins list`)."),
           config: Optional[Path] = typer.Argument(None, help="Start a new run of this config with the fault."),
           overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides, e.g. train.steps=20."),
           run: Optional[str] = typer.Option(None, "--run", help="Inject into this run instead: armed at its next "
                                             "step if it is training now, else the run is resumed with the fault."),
           at_step: Optional[int] = typer.Option(None, "--at-step", help="First step the fault fires at."),
           count: Optional[int] = typer.Option(None, "--count", help="Steps in a row it fires for."),
           rate: Optional[float] = typer.Option(None, "--rate", help="Fraction of samples (verifier faults) or episode tool calls (tool faults) hit."),
           target: Optional[str] = typer.Option(None, "--target", help="Role to hit (default: the kind's own; tool faults: a tool name)."),
           option: Optional[List[str]] = typer.Option(None, "--option", help="Fault option key=value (repeatable)."),
           supervise: bool = typer.Option(False, "--supervise", help="Restart the run if the fault kills it."),
           run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Run directory of a new run."),
           registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Inject a real fault into a new, stopped or running run and watch the recovery (events in `rlctl runs show`)."""
    from rlctl.cli.train import run_resume, train as train_cmd
    from rlctl.hooks.manager import load_plugins
    from rlctl.incidents.inject import fault_override, inject_running, is_running, make_spec

    spec = make_spec(fault, at_step=at_step, count=count, rate=rate, target=target, options=option or [],
                     plugins=load_plugins())
    if run is not None and config is not None and "=" in config.name and not config.exists():
        config, overrides = None, [str(config), *(overrides or [])]  # `inject --run RUN k=v`
    if (run is None) == (config is None):
        raise typer.BadParameter("pass either CONFIG (a new run) or --run RUN")
    if run is None:
        train_cmd(config=config, overrides=[*(overrides or []), fault_override(spec)], run_dir=run_dir, resume=None,
                  allow_config_change=False, seeds=None, registry=registry, json_out=json_out, supervise=supervise)
        return
    with open_registry(registry) as reg:
        rec = reg.get_run(run)
    if rec.run_dir and is_running(Path(rec.run_dir)):
        path = inject_running(Path(rec.run_dir), spec)
        if json_out:
            _output.print_json({"run_id": rec.id, "armed_from": str(path), "fault": spec.model_dump(mode="json")})
        else:
            _output.console.print(f"run {rec.id} is training: {fault} is armed at its next step ({path})")
        return
    existing = ((rec.config.get("faults") or {}).get("inject") or [])
    run_resume(rec.id, None, [*(overrides or []), fault_override(spec, existing)], False, registry, json_out)


def drill(config: Optional[Path] = typer.Argument(None, help="Config to drill (default: the built-in defaults); "
                                                  "the drill makes it tiny and deterministic."),
          overrides: Optional[List[str]] = typer.Argument(None, help="Extra dotted overrides."),
          only: Optional[List[str]] = typer.Option(None, "--only", help="Run only these drills (repeatable)."),
          registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Inject each fault into a tiny real run and check its recovery: a pass/fail table (stored in the registry)."""
    import time

    from rlctl.incidents.drill import run_drills
    from rlctl.registry.db import default_url

    started = time.perf_counter()
    url = registry or default_url()
    results = run_drills(config, overrides or [], url, home=rlctl_home(), only=only or [],
                         say=lambda m: _output.err_console.print(m, markup=False, highlight=False))
    wall = time.perf_counter() - started
    if json_out:
        _output.print_json({"drills": [r.to_json() for r in results], "wall_s": wall,
                            "passed": all(r.passed for r in results)})
    else:
        rows = [(r.drill, "PASS" if r.passed else "FAIL", r.recovered,
                 None if r.time_to_recover_s is None else f"{r.time_to_recover_s:.2f}s", r.steps_lost,
                 r.trajectories_lost, r.trajectories_duplicated, "yes" if r.metric_continuity else "NO", r.run_id)
                for r in results]
        _output.console.print(_output.table(f"rlctl drill ({wall:.0f}s)", ["drill", "result", "recovered",
                              "time to recover", "steps lost", "traj. lost", "traj. dup.", "metric continuity",
                              "run"], rows))
    if not all(r.passed for r in results):
        raise typer.Exit(1)
