"""``rlctl profile``: where a step's time goes, from a short measured run or a run's stored metrics.

What this is: ``profile_config()`` trains a config for a few steps through
``rlctl.lifecycle.train.train`` (a normal registry run, eval and checkpoints off by
default) and times every step from outside the loop; ``profile_run()`` reads
an existing run's per-step metrics from the registry. Both produce a
``ProfileReport``: the per-step stage times the loop measures (T_r rollout,
T_v reward, T_l learner incl. batch building and advantages, T_s weight sync;
and tool time, ``T_tool``: the seconds an episode's environment spent in tool
calls, part of T_r, shown as its own stage and cut out of T_r's bar),
the measured wall time of each step and what the stages leave uncovered
("other": metric logging, checkpoints), the critical path, pipeline
utilisation U_pipe = device-busy time (T_r + T_l) / (devices x wall),
generated / learned / effective tokens/s, rollout latency P50/P95/P99, and
for rollout and learner the % of this machine's GEMM roofline and the padding
waste (``rlctl.planning.roofline``, from the token counts every step logs).

Placements: the run itself is measured on its placement (one process:
colocated). ``compare`` adds a disaggregated ``split`` placement as an
ESTIMATE derived from the measured stage times: the same hardware cut into a
rollout pool and a learner pool (each stage runs at pool/total of the
measured speed), run synchronously and one-step-off (rollout of step k+1
overlaps learning on step k). Estimates are labelled as such everywhere.

What this is not: a tracer of individual ops (use torch.profiler) or the
chart renderer (``save_chart`` draws with matplotlib, imported lazily).
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from rlctl.contracts.errors import ConfigError, ModelError, RegistryError

STAGES = ("T_r", "T_v", "T_l", "T_s")
WALL_METRIC = "profile/step_wall_s"  # written by profile_config so `rlctl profile RUN` can show coverage later
PROFILE_DEFAULTS = ("train.steps=5", "eval.at_end=false", "checkpoint.every_steps=0", "train.metric_sinks=[]")
COVERAGE_TOLERANCE = 0.05
# What the overlapped driver (mode one_step_off / async, or the Ray placement) logs about each side's waiting.
OVERLAP_METRICS = ("learner_wait_s", "rollout_wait_s", "rollout_latency_p50_s", "staleness_mean")
TOOL_METRIC = "time_tool_s"  # inside T_r: seconds in tool calls, summed over the step's episodes


@dataclass(frozen=True, slots=True)
class StepTimes:
    step: int
    stages: dict[str, float]
    wall_s: float | None  # measured from outside the loop; None when the run did not record it
    generated_tokens: float
    learned_tokens: float
    effective_tokens: float
    overlap: dict[str, float] = field(default_factory=dict)  # OVERLAP_METRICS of an overlapped run's step
    tool_s: float = 0.0  # T_tool: seconds in tool calls (part of T_r; summed over episodes, so it may exceed T_r)

    @property
    def tool_in_rollout_s(self) -> float:
        """The part of T_r drawn as tool time (T_tool capped at T_r: concurrent calls overlap in wall time)."""
        return min(self.tool_s, self.stages["T_r"])

    @property
    def stage_sum(self) -> float:
        return sum(self.stages.values())


@dataclass(frozen=True, slots=True)
class PlacementProfile:
    placement: str
    mode: str
    measured: bool
    stages: dict[str, float]  # mean seconds per step on this placement
    step_s: float
    critical_path: str
    u_pipe: float
    generated_tokens_per_s: float
    note: str = ""


@dataclass(frozen=True, slots=True)
class ProfileReport:
    run_id: str
    source: str
    steps: tuple[StepTimes, ...]
    placements: tuple[PlacementProfile, ...]
    latency: dict[str, float]
    chart: str | None = None
    notes: tuple[str, ...] = field(default=())
    roofline: tuple[Any, ...] = field(default=())  # rlctl.planning.roofline.StageRoofline: rollout, learner

    @property
    def stage_totals(self) -> dict[str, float]:
        return {k: sum(s.stages.get(k, 0.0) for s in self.steps) for k in STAGES}

    @property
    def tool_total_s(self) -> float:
        """T_tool over all steps (part of T_r; not added to the stage sum)."""
        return sum(s.tool_s for s in self.steps)

    @property
    def wall_s(self) -> float | None:
        walls = [s.wall_s for s in self.steps]
        return None if any(w is None for w in walls) else float(sum(walls))  # type: ignore[arg-type]

    @property
    def coverage(self) -> float | None:
        """Sum of stage times / measured wall time (1.0 = the stages explain every second)."""
        wall = self.wall_s
        return sum(self.stage_totals.values()) / wall if wall else None

    @property
    def tokens_per_s(self) -> dict[str, float]:
        t = self.stage_totals
        gen = sum(s.generated_tokens for s in self.steps)
        wall = self.wall_s or sum(t.values())
        return {"generated (per T_r)": gen / t["T_r"] if t["T_r"] else 0.0,
                "learned (per T_l)": sum(s.learned_tokens for s in self.steps) / t["T_l"] if t["T_l"] else 0.0,
                "effective (per T_r)": sum(s.effective_tokens for s in self.steps) / t["T_r"] if t["T_r"] else 0.0,
                "generated end-to-end (per wall)": gen / wall if wall else 0.0}


def profile_config(config: Any, *, registry: Any, plugins: Any, home: Path, compare: Sequence[str] = (),
                   out: Path | None = None) -> ProfileReport:
    """Train ``config`` (defaults: PROFILE_DEFAULTS, overridable) and profile every step it ran."""
    from rlctl.lifecycle.train import TrainCallbacks, train

    marks: list[float] = []
    result = train(config, registry=registry, plugins=plugins, home=home, callbacks=TrainCallbacks(
        start=lambda first, total, log_every: marks.append(time.perf_counter()),
        step=lambda step, metrics: marks.append(time.perf_counter())))
    walls = [b - a for a, b in zip(marks, marks[1:])]
    first = result.first_step
    for i, wall in enumerate(walls):
        registry.log_metrics(result.run.id, first + i, {WALL_METRIC: wall})
    source = f"measured: {len(walls)} steps of {config.run.name!r} trained now (run {result.run.id})"
    return build_report(result.run.id, source, registry, compare, out or Path(result.run.run_dir), home)


def profile_run(run: str, *, registry: Any, compare: Sequence[str] = (), out: Path | None = None,
                home: Path | None = None) -> ProfileReport:
    record = registry.get_run(run)
    source = f"registry metrics of run {record.id} ({record.status})"
    run_dir = Path(record.run_dir) if record.run_dir else None
    return build_report(record.id, source, registry, compare, out or run_dir, home or run_dir)


def build_report(run_id: str, source: str, registry: Any, compare: Sequence[str], out: Path | None,
                 home: Path | None = None) -> ProfileReport:
    """``home``: where the roofline's GEMM measurement is cached (RLCTL_HOME; else no roofline)."""
    from rlctl.config.models import RunConfig
    from rlctl.engine.spec import overlapped

    config = RunConfig.model_validate(registry.get_run(run_id).config)
    through_queue = overlapped(config)
    steps = read_steps(registry, run_id, through_queue)
    roofline, roof_note = stage_roofline(registry, run_id, config, home) if home is not None else ((), "")
    notes = [roof_note] if roof_note else []
    if roofline and through_queue:
        notes.append("overlapped run: the rollout row's % roofline divides by T_r, the learner's wait, not generation "
                      "time; read its padding waste only")
    if any(s.wall_s is None for s in steps):
        notes.append("per-step wall time was not recorded for this run (only `rlctl profile CONFIG` records it); "
                     "the stage sum stands in for the wall time and 'other' is unknown")
    overlap = overlap_note(steps) if through_queue else ""
    if overlap:
        notes.append(overlap)
    placements = [measured_placement(steps, "overlapped" if through_queue else "sync")]
    for name in compare:
        if name.startswith("split"):
            placements += split_estimates(steps, name)
        elif name != "colocate":
            raise ConfigError(f"--compare takes colocate and split[:R+L], got {name!r}",
                              "e.g. --compare colocate,split")
    report = ProfileReport(run_id=run_id, source=source, steps=tuple(steps), placements=tuple(placements),
                           latency=latency(steps), notes=tuple(notes), roofline=roofline)
    if out is not None:
        path = save_chart(report, out if out.suffix == ".png" else out / "profile.png")
        report = replace(report, chart=str(path))
    return report


def read_steps(registry: Any, run_id: str, through_queue: bool) -> list[StepTimes]:
    """Each step's stage times and tokens; ``through_queue``: the run took the overlapped driver, whose T_r is the
    learner's wait for a batch (so its tokens/s are per whole step), where the synchronous loop's are per T_r."""
    names = [*STAGES, WALL_METRIC, "generated_tokens_per_s", "learned_tokens_per_s", "effective_tokens_per_s",
             *OVERLAP_METRICS, TOOL_METRIC]
    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for point in registry.metrics(run_id, names=names):
        by_step[point.step][point.name] = point.value
    rows = [(step, m) for step, m in sorted(by_step.items()) if all(k in m for k in STAGES)]
    if not rows:
        raise RegistryError(f"run {run_id} has no per-step stage times (T_r, T_v, T_l, T_s)",
                            "profile a run trained by this version of rlctl, or profile its CONFIG")
    per = {step: sum(m[k] for k in STAGES) if through_queue else m["T_r"] for step, m in rows}
    return [StepTimes(step=step, stages={k: m[k] for k in STAGES}, wall_s=m.get(WALL_METRIC),
                      generated_tokens=m.get("generated_tokens_per_s", 0.0) * per[step],
                      learned_tokens=m.get("learned_tokens_per_s", 0.0) * m["T_l"],
                      effective_tokens=m.get("effective_tokens_per_s", 0.0) * per[step],
                      overlap={k: m[k] for k in OVERLAP_METRICS if k in m}, tool_s=m.get(TOOL_METRIC, 0.0))
            for step, m in rows]


def stage_roofline(registry: Any, run_id: str, config: Any, home: Path) -> tuple[tuple[Any, ...], str]:
    """% of this machine's GEMM roofline and padding waste of rollout and learner, and a note on the inputs."""
    from rlctl.planning import roofline as rl

    by_step: dict[int, dict[str, float]] = defaultdict(dict)
    for point in registry.metrics(run_id, names=[*rl.ROLLOUT_METRICS, *rl.LEARNER_METRICS, "T_r", "T_l"]):
        by_step[point.step][point.name] = point.value
    if not rl.roofline_rows(rl.PROBE_SHAPE, list(by_step.values()), 1.0):  # nothing to measure the GEMM for
        return (), "no roofline: the run logged no token counts (trained by an older rlctl, or not the torch learner)"
    try:
        shape = rl.run_shape(config, home)
    except (ConfigError, ModelError, OSError) as err:  # a stored run whose model directory is gone
        return (), f"no roofline: the run's model shape cannot be read ({err})"
    peak = rl.peak_flops(home, rl.run_dtype(config))
    rows = tuple(rl.roofline_rows(shape, [by_step[k] for k in sorted(by_step)], peak.flops_per_s))
    how = "read from" if peak.cached else "measured now, cached in"
    return rows, (f"roofline: torch GEMM {peak.flops_per_s / 1e9:.2f} GFLOP/s ({how} {peak.path}; key {peak.key}); "
                  f"model {shape.name}: {shape.flops_per_token:,.0f} forward FLOPs/token from the weights + "
                  "attention; the learner's forward+backward counts 3 forwards; % = useful FLOPs (real tokens) / "
                  "stage time / GEMM FLOP/s; rollout waste is an upper bound (rows x longest response)")


def _mean_stages(steps: Sequence[StepTimes]) -> dict[str, float]:
    return {k: statistics.fmean(s.stages[k] for s in steps) for k in STAGES}


def overlap_note(steps: Sequence[StepTimes]) -> str:
    """For an overlapped run: what T_r means there, and how long each side waited for the other."""
    mean = lambda k: statistics.fmean(s.overlap.get(k, 0.0) for s in steps)  # noqa: E731
    t_l = statistics.fmean(s.stages["T_l"] for s in steps)
    return (f"overlapped run: T_r is the learner's wait for a batch (mean {mean('learner_wait_s'):.3g}s/step), not "
            f"generation time; each rollout worker waited {mean('rollout_wait_s'):.3g}s/step for queue space or "
            f"admission; a worker call took {mean('rollout_latency_p50_s'):.3g}s (median); mean dv "
            f"{mean('staleness_mean'):.2f}. The learner is busy {t_l:.3g}s/step (T_l): when it hardly waits yet T_l "
            "is above that of the same config at mode=sync, rollout and learner are competing for the same cores "
            "(or, with the local placement's threads, the GIL); overlap then hides no time")


def measured_placement(steps: Sequence[StepTimes], mode: str = "sync") -> PlacementProfile:
    st = _mean_stages(steps)
    walls = [s.wall_s if s.wall_s is not None else s.stage_sum for s in steps]
    step_s = statistics.fmean(walls)
    other = max(0.0, step_s - sum(st.values()))
    order = " -> ".join(f"{k} {st[k]:.3g}s" for k in STAGES) + (f" -> other {other:.3g}s" if other else "")
    tool = statistics.fmean(s.tool_s for s in steps)
    if tool:
        order = order.replace("T_r ", f"T_r (T_tool {tool:.3g}s of it) ", 1)
    gen = statistics.fmean(s.generated_tokens for s in steps)
    shape = "serial" if mode == "sync" else "rollout overlapped, T_r = learner wait"
    return PlacementProfile(placement="colocate", mode=mode, measured=True, stages=st, step_s=step_s,
                            critical_path=f"{order} ({shape}; bottleneck {max(st, key=st.get)})",
                            u_pipe=(st["T_r"] + st["T_l"]) / step_s, generated_tokens_per_s=gen / step_s)


def split_estimates(steps: Sequence[StepTimes], name: str) -> list[PlacementProfile]:
    """Rollout and learner on separate pools of the same hardware: sync and one-step-off (ESTIMATES)."""
    rollout_share, learner_share = _split_shares(name)
    st = _mean_stages(steps)
    t_r, t_l = st["T_r"] / rollout_share, st["T_l"] / learner_share
    gen = statistics.fmean(s.generated_tokens for s in steps)
    label = name if ":" in name else "split:1+1"
    scaled = {"T_r": t_r, "T_v": st["T_v"], "T_l": t_l, "T_s": st["T_s"]}
    out = []
    for mode, step_s, path in (
        ("sync", t_r + st["T_v"] + t_l + st["T_s"], "T_r -> T_v -> T_l -> T_s (serial; each pool idles half)"),
        ("one-step-off", max(t_r + st["T_v"], t_l) + st["T_s"],
         f"max(T_r+T_v {t_r + st['T_v']:.3g}s, T_l {t_l:.3g}s) -> T_s "
         f"(bottleneck {'rollout' if t_r + st['T_v'] >= t_l else 'learner'})"),
    ):
        busy = t_r * rollout_share + t_l * learner_share
        out.append(PlacementProfile(placement=label, mode=mode, measured=False, stages=scaled, step_s=step_s,
                                    critical_path=path, u_pipe=busy / step_s, generated_tokens_per_s=gen / step_s,
                                    note=f"ESTIMATE from measured stage times: rollout pool {rollout_share:.0%} / "
                                    f"learner pool {learner_share:.0%} of the hardware, linear scaling"))
    return out


def _split_shares(name: str) -> tuple[float, float]:
    _, _, spec = name.partition(":")
    if not spec:
        return 0.5, 0.5
    a, _, b = spec.partition("+")
    if not (a.isdigit() and b.isdigit()) or int(a) < 1 or int(b) < 1:
        raise ConfigError(f"--compare {name!r}: write split or split:R+L", "e.g. --compare colocate,split:4+4")
    return int(a) / (int(a) + int(b)), int(b) / (int(a) + int(b))


def latency(steps: Sequence[StepTimes]) -> dict[str, float]:
    """Rollout latency percentiles: a step's requests are batched, so each sample's latency is its step's T_r."""
    values = sorted(s.stages["T_r"] for s in steps)
    pick = lambda q: values[min(len(values) - 1, int(q * len(values)))]  # noqa: E731
    return {"p50_s": pick(0.5), "p95_s": pick(0.95), "p99_s": pick(0.99)}


def save_chart(report: ProfileReport, path: Path) -> Path:
    """PNG timeline: one lane per pool and placement, one coloured bar per stage and step."""
    from rlctl.lifecycle.curves import pyplot, save_png

    plt = pyplot()

    colors = {"T_r": "#4c72b0", "T_tool": "#8172b2", "T_v": "#dd8452", "T_l": "#55a868", "T_s": "#c44e52",
              "other": "#bbbbbb"}
    lanes = _lanes(report)
    fig, ax = plt.subplots(figsize=(11, 1.6 + 0.55 * len(lanes)))
    for y, (label, bars) in enumerate(lanes):
        for start, width, stage in bars:
            ax.barh(y, width, left=start, color=colors[stage], edgecolor="white", linewidth=0.4)
    ax.set_yticks(range(len(lanes)), [label for label, _ in lanes], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(f"rlctl profile {report.run_id}: stage timeline ('est.' lanes are estimates, not measured)",
                 fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, list(colors), ncol=6, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35 / len(lanes)),
              frameon=False)
    fig.tight_layout()
    return save_png(fig, path)


def _lanes(report: ProfileReport) -> list[tuple[str, list[tuple[float, float, str]]]]:
    bars, t = [], 0.0
    for s in report.steps:
        for k in STAGES:
            tool = s.tool_in_rollout_s if k == "T_r" else 0.0  # the rollout's tool calls: a stage of their own
            bars.append((t, s.stages[k] - tool, k))
            if tool:
                bars.append((t + s.stages[k] - tool, tool, "T_tool"))
            t += s.stages[k]
        if s.wall_s is not None and s.wall_s > s.stage_sum:
            bars.append((t, s.wall_s - s.stage_sum, "other"))
            t += s.wall_s - s.stage_sum
    lanes = [("colocate (measured)", bars)]
    for p in report.placements:
        if p.measured:
            continue
        roll, learn, t = [], [], 0.0
        for _ in report.steps:
            roll += [(t, p.stages["T_r"], "T_r"), (t + p.stages["T_r"], p.stages["T_v"], "T_v")]
            l_start = t if p.mode == "one-step-off" else t + p.stages["T_r"] + p.stages["T_v"]
            learn += [(l_start, p.stages["T_l"], "T_l"), (t + p.step_s - p.stages["T_s"], p.stages["T_s"], "T_s")]
            t += p.step_s
        lanes += [(f"{p.placement} {p.mode} rollout (est.)", roll), (f"{p.placement} {p.mode} learner (est.)", learn)]
    return lanes
