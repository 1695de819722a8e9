"""Diagnosis by cause: which finding explains which, and wall-clock findings against the machine's load.

What this is: ``rank_by_cause``, which orders diagnosis findings so that a
finding another one explains comes right after its cause, marked "follows
..." (a reward collapse whose onset is after a length-hacking episode is
the hack's consequence, not the root), and ``account_for_load``, which checks
a wall-clock finding (throughput falling, step time growing) against the
machine's load recorded per step (``host_load_per_cpu``, ``process_cpu_frac``:
rlctl.engine.metrics.MachineLoad) and, when the machine was busy (load per
CPU >= 1, or 1.5x the load before the window, or this process's CPU share
fell to 0.7x of before while the load was >= 0.5), turns it
into an ``info`` finding that says so instead of blaming the engine. The live
alerts (rlctl.incidents.recovery) add the same note to a wall-clock alert.

``EXPLAINED_BY`` is the table of what may explain what, by branch. A cause
must start strictly before its consequence (onset: the first flagged step).
It is deliberately short: only pairs where the earlier finding is the usual
mechanism of the later one. ``EXPLAINED_IN_STEP`` lists the few causes that
act within the same step, so may share the consequence's onset: a failed
tool call leaves its episode unscored in that very step, which moves the
grader's ``reward_error_frac`` and ``groups_dropped``; a grader finding whose
every trigger is on those metrics follows a tool finding starting no later.

What this is not: the trigger semantics (rlctl.incidents.triggers) or the
tree walk and rendering (rlctl.incidents.diagnose).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence

from rlctl.incidents.triggers import Firing, History

Finding = Any  # rlctl.incidents.diagnose.Finding (which imports this module)

# consequence branch -> branches whose earlier finding explains it
EXPLAINED_BY: dict[str, tuple[str, ...]] = {
    # a reward drop after a hack, NaN steps, grader failures, or updates that moved the policy too far
    "collapse": ("hacking", "numerics", "grader", "instability"),
    "instability": ("lag",),  # drift from training on stale samples
}
# consequence branch -> (cause branch, the consequence's metrics that cause moves in the same step)
EXPLAINED_IN_STEP: dict[str, tuple[str, frozenset[str]]] = {
    "grader": ("tools", frozenset({"reward_error_frac", "groups_dropped"})),  # flagged episodes have no reward
}

# metrics measured in wall-clock time: a busy machine moves them without anything wrong in the engine
WALL_CLOCK_METRICS = frozenset({"generated_tokens_per_s", "learned_tokens_per_s", "effective_tokens_per_s",
                                "step_time_s", "T_r", "T_l"})
BUSY_LOAD = 1.0  # load average per CPU at or above which the machine has more runnable threads than CPUs
BUSY_RISE = 1.5  # or: the load during the flagged window is this many times the load before it (and >= 0.5)
STARVED = 0.7  # or: the process's CPU share late in the window fell to this fraction of before (and load >= 0.5)


def rank_by_cause(findings: Sequence[Finding]) -> list[Finding]:
    """Roots by ``Finding.score`` (severity, onset, tree order, magnitude), each followed by what it explains."""
    ordered = sorted(findings, key=lambda f: f.score, reverse=True)
    cause_of: dict[int, Finding] = {}
    for f in ordered:
        causes = [c for c in ordered if c is not f and (c.branch in EXPLAINED_BY.get(f.branch, ())
                  and 0 <= c.onset < f.onset or _in_step(c, f))]
        if causes:
            cause_of[id(f)] = min(causes, key=lambda c: c.onset)
    out: list[Finding] = []

    def place(finding: Finding, cause: Finding) -> None:
        when = ("in the same step" if cause is not None and cause.onset == finding.onset
                else f"before this one's onset at step {finding.onset}")
        out.append(finding if cause is None else replace(finding, follows=(
            f"follows {cause.branch}: {cause.title} (from step {cause.onset}, {when}); likely a consequence, "
            "fix that first")))
        for g in ordered:
            if cause_of.get(id(g)) is finding:
                place(g, finding)

    for root in (f for f in ordered if id(f) not in cause_of):
        place(root, None)
    return out


def _in_step(cause: Finding, finding: Finding) -> bool:
    branch, metrics = EXPLAINED_IN_STEP.get(finding.branch, ("", frozenset()))
    return (cause.branch == branch and 0 <= cause.onset <= finding.onset
            and all(f.trigger.metric in metrics for f in finding.firings))


def account_for_load(finding: Finding, history: History) -> Finding:
    """``finding`` with its wall-clock evidence checked against the recorded load (unchanged without load data)."""
    wall = [f for f in finding.firings if f.trigger.metric in WALL_CLOCK_METRICS]
    if not wall or not history.metrics.get("host_load_per_cpu"):
        return finding
    firings, busy = [], 0
    for f in finding.firings:
        verdict = machine_busy(f, history) if f in wall else None
        if verdict:
            busy += 1
            f = replace(f, detail=f"{f.detail}; {verdict}")
        firings.append(f)
    if busy and busy == len(finding.firings):  # every piece of evidence is the machine's load
        return replace(finding, firings=tuple(firings), severity="info",
                       title=f"The machine was busy, not the engine ({finding.title.lower()})",
                       actions=("Re-measure on an idle machine (or compare `host_load_per_cpu` across runs) "
                                "before tuning the engine.",) + finding.actions)
    return replace(finding, firings=tuple(firings))


def machine_busy(firing: Firing, history: History) -> str | None:
    """Why the machine counts as busy over the firing's flagged steps, or None when it was not."""
    if not firing.windows:
        return None
    first, last = firing.windows[0][0], firing.windows[-1][1]
    load_in, load_before = _mean(history, "host_load_per_cpu", first, last), _mean(history, "host_load_per_cpu",
                                                                                  None, first - 1)
    if load_in is None:
        return None
    risen = load_before is not None and load_before > 0 and load_in >= BUSY_RISE * load_before and load_in >= 0.5
    # the CPU share late in the window against before it (or, with nothing before, the window's first half)
    mid = (first + last) // 2
    cpu_late = _mean(history, "process_cpu_frac", mid + 1, last)
    cpu_ref = _mean(history, "process_cpu_frac", None, first - 1)
    if cpu_ref is None:
        cpu_ref = _mean(history, "process_cpu_frac", first, mid)
    starved = (cpu_late is not None and cpu_ref is not None and cpu_late <= STARVED * cpu_ref
               and load_in >= 0.5)  # it got less of a CPU per wall second while others ran
    if load_in < BUSY_LOAD and not risen and not starved:
        return None
    text = (f"the machine was busy: load average {load_in:.2f} per CPU over steps {first}-{last}"
            + (f" (vs {load_before:.2f} before)" if load_before is not None else ""))
    if cpu_late is not None:
        text += f", this process got {cpu_late:.2f} of a CPU by the end" + (
            f" (vs {cpu_ref:.2f})" if cpu_ref is not None else "")
    return text + " - other processes, not the engine, are the likely cause"


def _mean(history: History, metric: str, first: int | None, last: int) -> float | None:
    values = [v for s, v in history.metrics.get(metric, ()) if (first is None or s >= first) and s <= last
              and math.isfinite(v)]
    return sum(values) / len(values) if values else None
