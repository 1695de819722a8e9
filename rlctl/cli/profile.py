"""``rlctl profile CONFIG|RUN``: stage times, critical path, utilisation, tokens/s, latency, % of roofline, padding
waste, and a timeline chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, RegistryOpt, open_registry, rlctl_home


def profile(target: str = typer.Argument(..., help="A YAML config (trained for a few steps now) or a run id."),
            overrides: Optional[List[str]] = typer.Argument(None, help="Config overrides, e.g. train.steps=10."),
            compare: Optional[str] = typer.Option(None, "--compare", help="Placements to compare, e.g. "
                                                  "colocate,split or colocate,split:4+4 (split is estimated)."),
            out: Optional[Path] = typer.Option(None, "--out", help="Chart path (.png) or directory "
                                               "(default: the run directory)."),
            registry: Optional[str] = RegistryOpt, json_out: bool = JsonOpt) -> None:
    """Where a step's time goes: T_r, T_v, T_l, T_s against measured wall time; split placement as an estimate;
    rollout and learner as % of this machine's GEMM roofline, and their padding waste."""
    from rlctl.planning.profile import PROFILE_DEFAULTS, profile_config, profile_run

    placements = [p.strip() for p in (compare or "").split(",") if p.strip()]
    with open_registry(registry) as reg:
        if Path(target).is_file():
            from rlctl.config.load import load_config
            from rlctl.hooks.manager import load_plugins

            cfg = load_config(target, [*PROFILE_DEFAULTS, *(overrides or [])])
            report = profile_config(cfg, registry=reg, plugins=load_plugins(), home=rlctl_home(),
                                    compare=placements, out=out)
        else:
            if overrides:
                raise typer.BadParameter("overrides apply to a CONFIG, not to a stored run", param_hint="OVERRIDES")
            report = profile_run(target, registry=reg, compare=placements, out=out, home=rlctl_home())
    if json_out:
        _output.print_json(report_json(report))
    else:
        render(report)


def report_json(report: Any) -> dict[str, Any]:
    return {"run_id": report.run_id, "source": report.source, "wall_s": report.wall_s,
            "stage_totals_s": report.stage_totals, "tool_total_s": report.tool_total_s, "coverage": report.coverage,
            "tokens_per_s": report.tokens_per_s,
            "rollout_latency_s": report.latency, "chart": report.chart, "notes": list(report.notes),
            "roofline": [_output.to_jsonable(r) for r in report.roofline],
            "steps": [dict(_output.to_jsonable(s), stage_sum_s=s.stage_sum) for s in report.steps],
            "placements": [_output.to_jsonable(p) for p in report.placements]}


def render(report: Any) -> None:
    con = _output.console
    rows = [(s.step, f"{s.stages['T_r']:.4f}", f"{s.tool_s:.4f}",
             *(f"{s.stages[k]:.4f}" for k in ("T_v", "T_l", "T_s")), f"{s.stage_sum:.4f}",
             "" if s.wall_s is None else f"{s.wall_s:.4f}",
             "" if s.wall_s is None else f"{s.wall_s - s.stage_sum:+.4f}") for s in report.steps]
    totals, wall = report.stage_totals, report.wall_s
    rows.append(("total", f"{totals['T_r']:.4f}", f"{report.tool_total_s:.4f}",
                 *(f"{totals[k]:.4f}" for k in ("T_v", "T_l", "T_s")), f"{sum(totals.values()):.4f}",
                 "" if wall is None else f"{wall:.4f}", "" if wall is None else f"{wall - sum(totals.values()):+.4f}"))
    con.print(_output.table(f"stage times (s), {report.source}",
                            ["step", "T_r rollout", "T_tool (in T_r)", "T_v reward", "T_l learner", "T_s sync",
                             "stage sum", "wall (measured)", "other"], rows))
    if report.coverage is not None:
        con.print(f"stages cover {report.coverage:.1%} of the measured wall time ({wall:.3f}s); the rest is "
                  "logging / checkpoints between steps")
    con.print(_output.table("placements", ["placement", "mode", "measured?", "step s", "U_pipe", "gen tok/s",
                                           "critical path"],
                            [(p.placement, p.mode, "measured" if p.measured else "ESTIMATE", f"{p.step_s:.4f}",
                              f"{p.u_pipe:.0%}", f"{p.generated_tokens_per_s:,.0f}", p.critical_path)
                             for p in report.placements]))
    for p in report.placements:
        if p.note:
            con.print(f"{p.placement} {p.mode}: {p.note}")
    if report.roofline:
        con.print(_output.table("roofline (useful FLOPs / stage time / this machine's torch GEMM FLOP/s; the "
                                "learner's tokens are summed over its forwards)",
                                ["stage", "% roofline", "padding waste", "real tokens", "computed tokens",
                                 "useful GFLOP", "stage s"],
                                [(r.stage, f"{r.roofline_frac:.1%}", f"{r.padding_waste:.1%}", f"{r.real_tokens:,.0f}",
                                  f"{r.computed_tokens:,.0f}", f"{r.useful_flops / 1e9:.3f}", f"{r.seconds:.4f}")
                                 for r in report.roofline]))
    tps = ", ".join(f"{k} {v:,.0f}" for k, v in report.tokens_per_s.items())
    lat = report.latency
    con.print(f"tokens/s: {tps}")
    con.print(f"rollout latency (per sample = its batch's T_r): P50 {lat['p50_s']:.4f}s, P95 {lat['p95_s']:.4f}s, "
              f"P99 {lat['p99_s']:.4f}s")
    for note in report.notes:
        con.print(f"note: {note}")
    if report.chart:
        con.print(f"chart: {report.chart}")
