"""``rlctl dryrun``: checks, the per-role memory ledger per device, a measured smoke step, or the capacity plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt, rlctl_home


def dryrun(config: Optional[Path] = typer.Argument(None, help="YAML config (not needed with --plan)."),
           overrides: Optional[List[str]] = typer.Argument(None, help="Dotted overrides, e.g. rollout.max_tokens=64."),
           gpus: Optional[int] = typer.Option(None, "--gpus", min=1, help="Devices to plan for (default: this CPU)."),
           gpu_mem: Optional[str] = typer.Option(None, "--gpu-mem", help="Memory per device, e.g. 80GiB."),
           placement: str = typer.Option("colocate", "--placement",
                                         help="colocate, split:R+L, or a comma list of both."),
           shape: Optional[str] = typer.Option(None, "--shape", help="Ledger for another model shape: a preset "
                                               "(0.5b 1.5b 7b 32b 72b) or a config.json / model directory."),
           zero_stage: Optional[int] = typer.Option(None, "--zero-stage", help="ZeRO / FSDP stage 0-3 "
                                                    "(default: the learner's; 0 for the torch learner)."),
           prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", min=1,
                                                       help="Prompt length (default: longest train prompt)."),
           no_smoke: bool = typer.Option(False, "--no-smoke", help="Skip the measured smoke step."),
           plan: bool = typer.Option(False, "--plan", help="Capacity plan for the 7B / 8-GPU recipe (estimates)."),
           json_out: bool = JsonOpt) -> None:
    """Validate a config, ledger its memory per role and device, and check the ledger with a smoke step."""
    from rlctl.planning.memory import GiB, parse_bytes

    capacity = _bytes_option(gpu_mem) if gpu_mem else (80 * GiB if (gpus or plan) else None)
    if plan:
        return _render_plan(capacity or parse_bytes("80GiB"), json_out)
    if config is None:
        raise typer.BadParameter("missing CONFIG (a YAML file), or pass --plan", param_hint="CONFIG")
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.planning.dryrun import DryrunOptions
    from rlctl.planning.dryrun import dryrun as run_dryrun

    options = DryrunOptions(devices=gpus or 1, device_memory_bytes=capacity, shape=shape, zero_stage=zero_stage,
                            placements=tuple(p.strip() for p in placement.split(",") if p.strip()),
                            prompt_tokens=prompt_tokens, smoke=not no_smoke)
    report = run_dryrun(load_config(config, overrides or []), load_plugins(), rlctl_home(), options)
    if json_out:
        _output.print_json(report_json(report))
    else:
        render(report)


def _bytes_option(text: str) -> int:
    from rlctl.contracts.errors import ConfigError
    from rlctl.planning.memory import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as err:
        raise ConfigError(str(err), "write sizes like 80GiB or 24G") from None


def device_json(dev: Any) -> dict[str, Any]:
    return {"device": dev.device, "count": dev.count, "fits": dev.fits, "peak_phase": dev.peak_phase,
            "peak_bytes": dev.peak_bytes, "headroom_bytes": dev.headroom_bytes, "required_bytes": dev.required_bytes,
            "capacity_bytes": dev.capacity_bytes, "largest": f"{dev.largest.role} {dev.largest.name}",
            "advice": list(dev.advice), "terms": [_output.to_jsonable(t) for t in dev.terms]}


def report_json(report: Any) -> dict[str, Any]:
    smoke = report.smoke
    out = {"checks": report.checks, "shape": report.shape, "num_params": report.shape.num_params,
           "workload": report.workload, "strategy": report.strategy.describe(), "fits": report.fits,
           "placements": {k: [device_json(d) for d in v] for k, v in report.placements.items()},
           "notes": list(report.notes), "smoke": None}
    if smoke is not None:
        out["smoke"] = {"steps": smoke.steps, "wall_s": smoke.wall_s, "meter": smoke.meter,
                        "untrained_policy": smoke.untrained_policy, "rss_peak_bytes": smoke.rss_peak_bytes,
                        "phases": [{"phase": p.phase, "ledger_bytes": p.ledger_bytes,
                                    "measured_bytes": p.measured_bytes, "error": p.error} for p in smoke.phases],
                        "peak": {"phase": smoke.peak.phase, "ledger_bytes": smoke.peak.ledger_bytes,
                                 "measured_bytes": smoke.peak.measured_bytes, "error": smoke.peak.error},
                        "within_tolerance": smoke.within_tolerance,
                        "persistent": {k: {"ledger_bytes": a, "measured_bytes": b}
                                       for k, (a, b) in smoke.persistent.items()}}
    if report.staleness is not None:
        out["staleness"] = {"prediction": _output.to_jsonable(report.staleness.prediction),
                            "inputs": _output.to_jsonable(report.staleness.params), "lengths": report.staleness.lengths}
    return out


def render(report: Any) -> None:
    from rlctl.planning.memory import fmt_bytes

    con = _output.console
    con.print(_output.table("checks", ["check", "ok", "detail"],
                            [(c.name, "yes" if c.ok else "NO", c.detail) for c in report.checks]))
    s = report.shape
    size = f"{s.num_params / 1e9:.3g}B" if s.num_params >= 1e9 else f"{s.num_params / 1e6:.3g}M"
    con.print(f"model {s.name} ({s.source}): {size} params, L={s.num_layers} h={s.hidden_size} "
              f"H={s.num_heads} H_kv={s.num_kv_heads} d={s.head_dim} V={s.vocab_size}; {report.strategy.describe()}")
    w = report.workload
    con.print(f"workload: {w.prompts_per_step} prompts x G={w.group_size}, {w.prompt_tokens}+{w.response_tokens} "
              f"tokens, micro-batch {w.micro_batch_size}, KL reference {'on' if w.kl_reference else 'off'}; "
              + "; ".join(report.notes))
    for label, devs in report.placements.items():
        for dev in devs:
            _render_device(label, dev, fmt_bytes)
    if report.smoke is not None:
        _render_smoke(report.smoke, fmt_bytes)
    if report.staleness is not None:
        _render_staleness(report.staleness)


def _render_staleness(run: Any) -> None:
    p, q = run.params, run.prediction
    _output.console.print(
        f"staleness ({p.mode}, bound {p.max_ahead}; simulated {p.steps} steps from the smoke timings, lengths "
        f"{run.lengths}, "
        + ("no contention" if p.cores is None else f"rollout and learner sharing {p.cores:g} core(s)")
        + f"): mean dv {q.staleness_mean:.2f}, P95 dv {q.staleness_p95:.0f}, drops {q.drop_rate:.1%}; "
        f"learner waits {q.learner_wait_share:.0%}, rollout waits {q.rollout_wait_share:.0%}; "
        f"utilisation {q.utilisation:.2f} (rollout demand / learner capacity)")


def _render_device(label: str, dev: Any, fmt_bytes: Any) -> None:
    con = _output.console
    rows = [(t.role, t.name, t.phase, fmt_bytes(t.bytes), t.formula) for t in dev.terms]
    title = f"{label}: {dev.device} device (x{dev.count}), capacity {fmt_bytes(dev.capacity_bytes)}"
    con.print(_output.table(title, ["role", "term", "phase", "bytes", "formula"], rows))
    verdict = "FITS" if dev.fits else "DOES NOT FIT"
    con.print(f"{verdict}: peak ({dev.peak_phase}) {fmt_bytes(dev.peak_bytes)} + {dev.headroom:.0%} fragmentation "
              f"headroom = {fmt_bytes(dev.required_bytes)} of {fmt_bytes(dev.capacity_bytes)}; largest term: "
              f"{dev.largest.role} {dev.largest.name} ({fmt_bytes(dev.largest.bytes)})")
    for tip in dev.advice:
        con.print(f"  change: {tip}")


def _render_smoke(smoke: Any, fmt_bytes: Any) -> None:
    con = _output.console
    rows = [(p.phase, fmt_bytes(p.ledger_bytes), fmt_bytes(p.measured_bytes), f"{p.error:+.1%}")
            for p in (*smoke.phases, smoke.peak)]
    rows += [(f"  {k}", fmt_bytes(a), fmt_bytes(b), f"{(a - b) / b:+.1%}" if b else "")
             for k, (a, b) in smoke.persistent.items()]
    policy = "untrained built-in policy (warm start not cached)" if smoke.untrained_policy else "run's policy"
    title = f"smoke: {smoke.steps} sync steps in {smoke.wall_s:.1f}s, {policy}; measured = {smoke.meter}"
    con.print(_output.table(title, ["phase / term", "ledger", "measured", "ledger error"], rows))
    ok = "within" if smoke.within_tolerance else "OUTSIDE"
    con.print(f"ledger vs measured peak: {smoke.peak.error:+.1%} ({ok} the stated +-25%); process RSS peak "
              f"{fmt_bytes(smoke.rss_peak_bytes)} (includes the Python runtime and libraries, not in the ledger)")


def _render_plan(capacity: int, json_out: bool) -> None:
    from rlctl.planning.plan import Hardware, Recipe, plan

    from rlctl.hooks.manager import load_plugins
    from rlctl.planning.dryrun import sharding_learners

    rows, hw, recipe = plan(capacity), Hardware(), Recipe()
    learners = sharding_learners(load_plugins(), 3)
    if json_out:
        _output.print_json({"estimate": True, "hardware": hw, "recipe": recipe, "num_params": recipe.shape.num_params,
                            "zero3_learners": learners,
                            "rows": [dict(_output.to_jsonable(r), shares=r.shares) for r in rows]})
        return
    title = (f"ESTIMATES (not measured): {recipe.shape.name} ({recipe.shape.num_params / 1e9:.2f}B), "
             f"{recipe.devices} x {capacity / (1 << 30):.0f} GiB, G={recipe.group_size}, {recipe.prompt_tokens}+"
             f"{recipe.response_tokens} tokens, bf16 + ZeRO-3/FSDP + checkpointing, KL reference; {hw.name}")
    table = [(r.placement, r.mode, r.prompts_per_step, "yes" if r.fits else "NO", r.memory, r.largest,
              f"{r.step_s:.1f}", " ".join(f"{k} {v:.0%}" for k, v in r.shares.items()), f"{r.u_pipe:.0%}",
              f"{r.generated_tokens_per_s:,.0f}") for r in rows]
    _output.console.print(_output.table(title, ["placement", "mode", "prompts", "fits", "memory per device",
                                                "largest term", "step s (est)", "time shares (est)", "U_pipe (est)",
                                                "gen tok/s (est)"], table))
    _output.console.print(f"assumptions: {hw.bf16_flops / 1e12:.0f} TFLOP/s bf16, HBM {hw.hbm_bytes_per_s / 1e12:.2f}"
                          f" TB/s, train MFU {hw.train_mfu:.0%}, decode at {hw.decode_bw_eff:.0%} of HBM bandwidth, "
                          f"responses at max length, reward time not modelled; see rlctl/planning/plan.py")
    _output.console.print("learner assumed: ZeRO-3 / FSDP full shard; installed learner(s) that shard so: "
                          + (", ".join(learners) if learners else "NONE (no installed learner plugin shards at "
                             "ZeRO-3: this plan cannot run here as is)"))
