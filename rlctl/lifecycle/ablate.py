"""``rlctl ablate``: a matrix of config cells x seeds, trained at an equal generated-token budget and compared.

What this is: ``plan`` (parse ``--axis KEY=v1,v2`` into cells, validate every
cell's config before anything runs), ``run_ablation`` (train every (cell, seed)
from ONE shared warm-start policy, each run stopping once its generated
response tokens reach the budget, grade its final policy on the hidden split,
and record the run, its eval and its place in the ablation in the registry;
an interrupted ablation continues where it stopped: finished runs are
skipped) and ``report`` (per cell: hidden pass@1, the gain over the warm
start, the paired bootstrap 95% CI of the difference to the baseline cell,
pooled over seeds and per seed, tokens and wall time; plus a PNG of the
learning curves with seed bands).

The baseline cell is the first value of every axis. Without ``--budget-tokens``
the budget is what the baseline cell's first seed generates in train.steps
steps; every other run then stops at the first step whose running total
reaches it, so token counts agree within one batch.

``--budget wall-seconds|device-seconds`` compares at equal time instead: every
run stops after the step at which its training loop's wall-clock seconds
(``train.max_wall_seconds``, metric ``rl_seconds_total``) reach the budget --
for device-seconds the budget divided by the devices the run's learner and
rollout use (``devices_used``: learner processes plus rollout engines), so
a cell on more devices gets fewer seconds. Without an amount the budget is
what the baseline cell's first seed spends in train.steps steps. The tables
show what each run spent: RL seconds, device-seconds, generated tokens and
the seconds its hidden-split grading took.

What this is not: the training loop (rlctl.lifecycle.train) or the bootstrap maths
(rlctl.lifecycle.grading).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rlctl.config.load import apply_override, validate
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError
from rlctl.contracts.types import AblationRecord, EvalRecord
from rlctl.engine.spec import overlapped
from rlctl.hooks.manager import Plugins
from rlctl.registry.store import Registry

EVAL_NAME = "ablation"  # baseline_name of the eval rows ablate writes (the warm start vs the run's final policy)
BUDGET_KINDS = ("tokens", "wall-seconds", "device-seconds")
SECONDS_STEPS_FACTOR = 100  # a run on a seconds budget may take this many times train.steps steps to spend it


@dataclass(frozen=True, slots=True)
class Axis:
    key: str
    values: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Cell:
    """One point of the matrix: ``overrides`` are ``key=value`` strings, ``key`` names the cell."""

    overrides: tuple[str, ...]

    @property
    def key(self) -> str:
        return " ".join(self.overrides)


@dataclass(frozen=True, slots=True)
class Plan:
    base: RunConfig
    axes: tuple[Axis, ...]
    cells: tuple[Cell, ...]
    seeds: tuple[int, ...]
    budget_tokens: int | None
    budget_kind: str = "tokens"  # BUDGET_KINDS
    budget_seconds: float | None = None  # wall-seconds or device-seconds per run; None: the baseline's first seed's

    @property
    def baseline(self) -> Cell:
        return self.cells[0]

    def spec(self) -> dict[str, Any]:
        spec = {"base_config": self.base.model_dump(mode="json"),
                "axes": [[a.key, list(a.values)] for a in self.axes], "cells": [c.key for c in self.cells],
                "seeds": list(self.seeds), "budget_tokens": self.budget_tokens, "baseline": self.baseline.key}
        if self.budget_kind != "tokens":  # a token-budget ablation keeps the spec (and hash) it always had
            spec.update(budget_kind=self.budget_kind, budget_seconds=self.budget_seconds)
        return spec

    def spec_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.spec(), sort_keys=True).encode()).hexdigest()[:32]


def parse_axis(text: str) -> Axis:
    """``KEY=v1,v2[,...]`` -> Axis; values are YAML scalars, as in ``key=value`` overrides."""
    key, sep, values = text.partition("=")
    items = tuple(v.strip() for v in values.split(",")) if sep else ()
    if not key.strip() or not items or any(not v for v in items):
        raise ConfigError(f"--axis {text!r} is not KEY=v1,v2", "e.g. --axis algo.name=grpo,rloo")
    if len(set(items)) != len(items):
        raise ConfigError(f"--axis {text!r} lists a value twice", "list each value once")
    return Axis(key=key.strip(), values=items)


def parse_budget(text: str | None, budget_tokens: int | None) -> tuple[str, float | None]:
    """``--budget KIND[=N]`` (and ``--budget-tokens N``) -> (kind, amount or None); ConfigError naming the fix."""
    if text is None:
        return "tokens", budget_tokens
    kind, sep, amount = text.partition("=")
    kind = kind.strip()
    if kind not in BUDGET_KINDS:
        raise ConfigError(f"--budget {text!r}: the kind must be one of {', '.join(BUDGET_KINDS)}",
                          "e.g. --budget wall-seconds=120, or --budget device-seconds (the baseline's first seed "
                          "sets the amount)")
    value: float | None = None
    if sep:
        try:
            value = float(amount)
        except ValueError:
            value = -1.0
        if not value > 0 or not math.isfinite(value):
            raise ConfigError(f"--budget {text!r}: the amount must be a positive number",
                              f"e.g. --budget {kind}=120")
    if budget_tokens is not None and (kind != "tokens" or (value is not None and value != budget_tokens)):
        raise ConfigError(f"--budget {text} and --budget-tokens {budget_tokens} name two budgets",
                          "give one of them")
    if kind == "tokens":
        return kind, int(value) if value is not None else budget_tokens
    return kind, value


def devices_used(config: RunConfig) -> int:
    """Devices (or processes) a run's learner and rollout hold for its RL time: the learner's ranks
    (train.learner_options.world_size, else 1) plus its rollout engines (1 in a local mode: sync run, else
    cluster.num_rollout_workers). device-seconds = RL wall seconds x this."""
    ranks = int(config.train.learner_options.get("world_size", 1) or 1)
    return ranks + (config.cluster.num_rollout_workers if overlapped(config) else 1)


def plan(base: RunConfig, axes: Sequence[str], seeds: int, budget_tokens: int | None,
         budget: str | None = None) -> Plan:
    """Every cell of the matrix, each one's config validated now (a bad axis fails before any training);
    ``budget`` is ``--budget KIND[=N]`` (default: tokens, ``budget_tokens``)."""
    kind, amount = parse_budget(budget, budget_tokens)
    parsed = tuple(parse_axis(a) for a in axes)
    if not parsed:
        raise ConfigError("rlctl ablate needs at least one --axis", "e.g. --axis algo.name=grpo,rloo")
    keys = [a.key for a in parsed]
    if len(set(keys)) != len(keys):
        raise ConfigError(f"--axis names {sorted(k for k in keys if keys.count(k) > 1)[0]} twice",
                          "give each key one --axis with all its values")
    if seeds < 1:
        raise ConfigError(f"--seeds must be >= 1 (got {seeds})", "use --seeds 3 for confidence intervals")
    cells = tuple(Cell(tuple(f"{a.key}={v}" for a, v in zip(parsed, combo)))
                  for combo in itertools.product(*(a.values for a in parsed)))
    for cell in cells:
        cell_config(base, cell, seed=base.run.seed)
    return Plan(base=base, axes=parsed, cells=cells, seeds=tuple(base.run.seed + i for i in range(seeds)),
                budget_tokens=int(amount) if kind == "tokens" and amount is not None else None, budget_kind=kind,
                budget_seconds=amount if kind != "tokens" else None)


def cell_config(base: RunConfig, cell: Cell, seed: int, extra: Sequence[str] = ()) -> RunConfig:
    raw = base.model_dump(mode="json")
    for item in (*cell.overrides, f"run.seed={seed}", *extra):
        apply_override(raw, item)
    return validate(raw, source=f"ablation cell {cell.key!r}")


# -- running -------------------------------------------------------------------------------------


@dataclass
class AblateCallbacks:
    """Display hooks (all optional): a run starts / ends, and the nested train callbacks."""

    run_start: Callable[[str, int, int, int], None] | None = None  # (cell, seed, index, total)
    run_end: Callable[[str, int, str, float], None] | None = None  # (cell, seed, status, wall_s)
    skipped: Callable[[str, int], None] | None = None
    note: Callable[[str], None] | None = None
    train: Any = None  # TrainCallbacks for each run


def run_ablation(p: Plan, *, name: str, registry: Registry, plugins: Plugins, home: Path,
                 callbacks: AblateCallbacks | None = None) -> AblationRecord:
    """Train and grade every (cell, seed) not yet done; return the ablation (status succeeded)."""
    from rlctl.registry.ablations import AblationStore

    from rlctl.placement.build import build_estimator

    cb = callbacks or AblateCallbacks()
    for cell in p.cells:  # plugin names and options of every cell, before any training
        build_estimator(cell_config(p.base, cell, p.base.run.seed), plugins)
    store = AblationStore(registry)
    ablation, new = store.find_or_create(name, p.spec_hash(), p.spec())
    if not new and cb.note:
        cb.note(f"continuing ablation {ablation.id}")
    store.update(ablation.id, status="running")
    warm_dir, records = _warm_start(p.base, plugins, home)
    spec = dict(ablation.spec)
    if "warm_start_correct" not in spec:
        spec.update(warm_start_dir=str(warm_dir), warm_start_correct=_grade(p.base, warm_dir, plugins, records))
        ablation = store.update(ablation.id, spec=spec)
    done = {(r.cell, r.seed) for r in store.runs(ablation.id) if r.status == "succeeded"}
    order = [(c, s) for s in p.seeds for c in p.cells]
    order.sort(key=lambda cs: (cs[0] != p.baseline or cs[1] != p.seeds[0]))  # the budget-setting run first
    try:
        for index, (cell, seed) in enumerate(order):
            if (cell.key, seed) in done:
                if cb.skipped:
                    cb.skipped(cell.key, seed)
                continue
            spec = _run_one(p, ablation.id, spec, cell, seed, warm_dir, records, store, registry, plugins, home,
                            cb, index, len(order))
    except KeyboardInterrupt:
        store.update(ablation.id, status="interrupted")
        raise
    except BaseException:
        store.update(ablation.id, status="failed")
        raise
    return store.update(ablation.id, status="succeeded")


def _run_one(p: Plan, ablation_id: str, spec: dict[str, Any], cell: Cell, seed: int, warm_dir: Path,
             records: Sequence[Any], store: Any, registry: Registry, plugins: Plugins, home: Path,
             cb: AblateCallbacks, index: int, total: int) -> dict[str, Any]:
    """Train one (cell, seed) at the budget, grade it, record it; returns the (possibly updated) spec."""
    from rlctl.lifecycle.train import TrainCallbacks, train

    base = p.base
    extra = [f"model.path={warm_dir}", "eval.at_end=false", f"run.name={base.run.name}/{cell.key}/seed{seed}"]
    devices = devices_used(cell_config(base, cell, seed))
    if p.budget_kind == "tokens":
        budget = spec.get("resolved_budget_tokens") or p.budget_tokens
        per_step = base.algo.prompts_per_step * base.algo.group_size
        if budget:  # one generated token per sequence per step at the least: this many steps always reach it
            extra += [f"train.max_generated_tokens={budget}", f"train.steps={math.ceil(budget / per_step) + 1}"]
    else:
        budget = spec.get("resolved_budget_seconds") or p.budget_seconds
        if budget:  # no step count bounds a time budget: a generous cap (the table shows the seconds spent)
            wall = budget if p.budget_kind == "wall-seconds" else budget / devices
            extra += [f"train.max_wall_seconds={wall!r}", f"train.steps={base.train.steps * SECONDS_STEPS_FACTOR}"]
    config = cell_config(base, cell, seed, extra)
    if cb.run_start:
        cb.run_start(cell.key, seed, index, total)
    tcb = cb.train or TrainCallbacks()
    started = tcb.run_started

    def on_start(run: Any) -> None:
        store.set_run(ablation_id, cell.key, seed, status="running", run_id=run.id)
        if started:
            started(run)

    tcb.run_started = on_start
    try:
        result = train(config, registry=registry, plugins=plugins, home=home, callbacks=tcb)
    except KeyboardInterrupt:
        store.set_run(ablation_id, cell.key, seed, status="interrupted")
        raise
    except BaseException:
        store.set_run(ablation_id, cell.key, seed, status="failed")
        raise
    finally:
        tcb.run_started = started
    run_dir = Path(result.run.run_dir)
    graded = time.perf_counter()
    correct = _grade(config, run_dir / "policy" / "final", plugins, records)
    cost = {"grade_s": time.perf_counter() - graded, "devices": devices}
    _store_eval(registry, result.run.id, config, spec["warm_start_correct"], correct, ablation_id, cost)
    store.set_run(ablation_id, cell.key, seed, status="succeeded", run_id=result.run.id, wall_s=result.wall_s)
    if cb.run_end:
        cb.run_end(cell.key, seed, "succeeded", result.wall_s)
    if not budget:
        last = registry.last_metrics(result.run.id)
        if p.budget_kind == "tokens":
            spec = dict(spec, resolved_budget_tokens=int(last.get("generated_tokens_total", (0, 0.0))[1]))
        else:
            seconds = last.get("rl_seconds_total", (0, 0.0))[1]
            spec = dict(spec, resolved_budget_seconds=seconds * (devices if p.budget_kind == "device-seconds" else 1))
        store.update(ablation_id, spec=spec)
    return spec


def _warm_start(base: RunConfig, plugins: Plugins, home: Path) -> tuple[Path, Sequence[Any]]:
    """The one starting policy of every run, and the hidden-split prompts every run is graded on."""
    from rlctl.placement.build import load_task, resolve_policy_dir

    task = load_task(base, plugins)
    records = task.split("hidden")
    if base.eval.num_prompts:
        records = records[:base.eval.num_prompts]
    return resolve_policy_dir(base, task, home / "cache"), records


def _grade(config: RunConfig, policy_dir: Path, plugins: Plugins, records: Sequence[Any]) -> list[int]:
    from rlctl.lifecycle.grading import grade_policy
    from rlctl.placement.build import load_task

    return list(grade_policy("policy", policy_dir, config, plugins, load_task(config, plugins), records).correct)


def _store_eval(registry: Registry, run_id: str, config: RunConfig, warm: Sequence[int], correct: Sequence[int],
                ablation_id: str, cost: Mapping[str, float]) -> None:
    from rlctl.lifecycle.grading import paired_bootstrap

    comp = paired_bootstrap(warm, correct, samples=config.eval.bootstrap_samples, seed=config.run.seed)
    registry.add_eval(EvalRecord(
        run_id=run_id, split="hidden", num_prompts=len(correct), baseline_name=EVAL_NAME, candidate_name="final",
        baseline_pass_at_1=sum(warm) / len(warm), candidate_pass_at_1=sum(correct) / len(correct), diff=comp.diff,
        ci_low=comp.ci_low, ci_high=comp.ci_high, created_at=time.time(),
        details={"ablation_id": ablation_id, "correct": list(correct), "baseline_correct": list(warm),
                 "fixed_decoding": {"temperature": 0.0, "max_tokens": config.eval.max_tokens}, **cost}))


# -- report --------------------------------------------------------------------------------------


@dataclass
class CellReport:
    cell: str
    seeds: list[int]
    run_ids: list[str]
    pass_at_1: list[float]  # per seed, hidden split
    tokens: list[float]  # generated tokens per seed
    wall_s: list[float]
    rl_s: list[float] = field(default_factory=list)  # the training loop's seconds per seed (rl_seconds_total)
    device_s: list[float] = field(default_factory=list)  # rl_s x devices_used per seed
    grade_s: list[float] = field(default_factory=list)  # seconds grading the final policy on hidden, per seed
    gain: dict[str, float] = field(default_factory=dict)  # vs the warm start, pooled over seeds
    vs_baseline: dict[str, float] = field(default_factory=dict)  # pooled over seeds
    vs_baseline_per_seed: list[dict[str, float]] = field(default_factory=list)

    @property
    def pass_at_1_mean(self) -> float:
        return sum(self.pass_at_1) / len(self.pass_at_1) if self.pass_at_1 else float("nan")


@dataclass
class AblationReport:
    ablation: AblationRecord
    baseline: str
    budget_tokens: int | None
    warm_start_pass_at_1: float
    num_prompts: int
    cells: list[CellReport]
    missing: list[str]  # "cell seed N" not finished yet
    plot: str | None = None
    budget_kind: str = "tokens"
    budget_seconds: float | None = None  # wall- or device-seconds per run, with a seconds budget


def report(registry: Registry, ablation_id: str, samples: int = 2000) -> AblationReport:
    """Statistics of every finished run of the ablation, read back from the registry."""
    from rlctl.lifecycle.grading import paired_bootstrap, pooled_bootstrap
    from rlctl.registry.ablations import AblationStore

    store = AblationStore(registry)
    ablation = store.get(ablation_id)
    spec = ablation.spec
    warm = list(spec.get("warm_start_correct", []))
    rows = {(r.cell, r.seed): r for r in store.runs(ablation_id)}
    scores: dict[str, dict[int, list[int]]] = {}
    cells, missing = [], []
    for cell in spec["cells"]:
        rep = CellReport(cell=cell, seeds=[], run_ids=[], pass_at_1=[], tokens=[], wall_s=[])
        scores[cell] = {}
        for seed in spec["seeds"]:
            row = rows.get((cell, seed))
            if row is None or row.status != "succeeded" or row.run_id is None:
                missing.append(f"{cell} seed {seed}")
                continue
            details = _ablation_eval(registry, row.run_id, ablation_id)
            correct = [int(x) for x in details["correct"]]
            last = registry.last_metrics(row.run_id)
            scores[cell][seed] = correct
            rep.seeds.append(seed)
            rep.run_ids.append(row.run_id)
            rep.pass_at_1.append(sum(correct) / len(correct))
            rep.tokens.append(last.get("generated_tokens_total", (0, float("nan")))[1])
            rep.wall_s.append(row.wall_s or 0.0)
            rep.rl_s.append(last.get("rl_seconds_total", (0, float("nan")))[1])  # nan: a run from before the metric
            rep.device_s.append(rep.rl_s[-1] * details.get("devices", float("nan")))
            rep.grade_s.append(details.get("grade_s", float("nan")))
        if rep.seeds:
            gain = pooled_bootstrap([(warm, scores[cell][s]) for s in rep.seeds], samples=samples)
            rep.gain = {"diff": gain.diff, "ci_low": gain.ci_low, "ci_high": gain.ci_high}
        cells.append(rep)
    base = spec["baseline"]
    for rep in cells:
        shared = [s for s in rep.seeds if s in scores[base]]
        if rep.cell == base or not shared:
            continue
        pooled = pooled_bootstrap([(scores[base][s], scores[rep.cell][s]) for s in shared], samples=samples)
        rep.vs_baseline = {"diff": pooled.diff, "ci_low": pooled.ci_low, "ci_high": pooled.ci_high,
                           "num_seeds": len(shared)}
        for s in shared:
            one = paired_bootstrap(scores[base][s], scores[rep.cell][s], samples=samples, seed=s)
            rep.vs_baseline_per_seed.append({"seed": s, "diff": one.diff, "ci_low": one.ci_low,
                                             "ci_high": one.ci_high})
    return AblationReport(ablation=ablation, baseline=base,
                          budget_tokens=spec.get("budget_tokens") or spec.get("resolved_budget_tokens"),
                          warm_start_pass_at_1=sum(warm) / len(warm) if warm else float("nan"),
                          num_prompts=len(warm), cells=cells, missing=missing,
                          budget_kind=spec.get("budget_kind", "tokens"),
                          budget_seconds=spec.get("budget_seconds") or spec.get("resolved_budget_seconds"))


def _ablation_eval(registry: Registry, run_id: str, ablation_id: str) -> Mapping[str, Any]:
    """The details of the run's ablation eval: correct per prompt, grading seconds, devices."""
    for record in reversed(registry.evals(run_id)):
        if record.baseline_name == EVAL_NAME and record.details.get("ablation_id") == ablation_id:
            return record.details
    raise ConfigError(f"run {run_id} of ablation {ablation_id} has no ablation eval in the registry",
                      "re-run the same rlctl ablate command: it re-grades unfinished runs")


def plot_curves(registry: Registry, rep: AblationReport, path: Path, metric: str = "reward_mean") -> Path:
    """PNG of ``metric`` against generated tokens per cell: the seed mean and a min-max band over seeds."""
    import numpy as np

    from rlctl.lifecycle.curves import pyplot, save_png

    fig, ax = pyplot().subplots(figsize=(8, 5))
    for cell in rep.cells:
        curves = []
        for run_id in cell.run_ids:
            points = _curve(registry, run_id, metric)
            if len(points) >= 2:
                curves.append(points)
        if not curves:
            continue
        end = min(float(c[-1][0]) for c in curves)
        grid = np.linspace(max(float(c[0][0]) for c in curves), end, 50)
        ys = np.stack([np.interp(grid, [x for x, _ in c], [y for _, y in c]) for c in curves])  # [seeds, 50]
        line = ax.plot(grid, ys.mean(0), label=f"{cell.cell} (n={len(curves)})")[0]
        ax.fill_between(grid, ys.min(0), ys.max(0), alpha=0.2, color=line.get_color())
    ax.set_xlabel("generated tokens")
    ax.set_ylabel(f"{metric} (train)")
    ax.set_title(f"ablation {rep.ablation.id}: seed mean, band = min..max over seeds")
    ax.legend(fontsize="small")
    return save_png(fig, path, bbox_inches="tight")


def _curve(registry: Registry, run_id: str, metric: str) -> list[tuple[float, float]]:
    from rlctl.lifecycle.curves import series

    points = series(registry, run_id, [metric, "generated_tokens_total"])
    tokens = dict(points["generated_tokens_total"])
    return [(tokens[step], value) for step, value in points[metric] if step in tokens]


def as_json(rep: AblationReport) -> dict[str, Any]:
    return {"ablation_id": rep.ablation.id, "status": rep.ablation.status, "baseline": rep.baseline,
            "budget_tokens": rep.budget_tokens, "budget_kind": rep.budget_kind,
            "budget_seconds": rep.budget_seconds, "warm_start_pass_at_1": rep.warm_start_pass_at_1,
            "num_prompts": rep.num_prompts, "missing": rep.missing, "plot": rep.plot,
            "cells": [{"cell": c.cell, "seeds": c.seeds, "run_ids": c.run_ids, "pass_at_1": c.pass_at_1,
                       "pass_at_1_mean": c.pass_at_1_mean, "gain_vs_warm_start": c.gain,
                       "vs_baseline": c.vs_baseline, "vs_baseline_per_seed": c.vs_baseline_per_seed,
                       "tokens": c.tokens, "wall_s": c.wall_s, "rl_s": c.rl_s, "device_s": c.device_s,
                       "grade_s": c.grade_s} for c in rep.cells]}


def summary_rows(rep: AblationReport) -> list[list[Any]]:
    """One row per cell for the CLI table."""
    rows = []
    for c in rep.cells:
        def ci(d: Mapping[str, float]) -> str:
            return f"{d['diff']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]" if d else "-"

        per_seed = "  ".join(f"s{d['seed']} {d['diff']:+.3f} [{d['ci_low']:+.3f},{d['ci_high']:+.3f}]"
                             for d in c.vs_baseline_per_seed) or ("baseline" if c.cell == rep.baseline else "-")
        rows.append([c.cell, f"{len(c.seeds)}", f"{c.pass_at_1_mean:.3f}" if c.seeds else "-", ci(c.gain),
                     ci(c.vs_baseline) if c.cell != rep.baseline else "baseline", per_seed, _spread(c.tokens, 0),
                     f"{sum(c.wall_s):.0f}"])
    return rows


COST_COLUMNS = ("cell", "generated tokens", "RL s", "device-s", "hidden eval s")


def cost_rows(rep: AblationReport) -> list[list[Any]]:
    """What each cell's runs spent, mean (min-max) over seeds: the second CLI table."""
    return [[c.cell, _spread(c.tokens, 0), _spread(c.rl_s, 1), _spread(c.device_s, 1), _spread(c.grade_s, 1)]
            for c in rep.cells]


def _spread(values: Sequence[float], digits: int) -> str:
    """``mean (min-max)`` of the finite values, '-' when there are none."""
    xs = [v for v in values if math.isfinite(v)]
    if not xs:
        return "-"
    return f"{sum(xs) / len(xs):.{digits}f} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"
