"""Trigger conditions over a run's recorded metrics and events: the one definition of "something is wrong".

What this is: ``Trigger`` (a validated condition such as "clip_fraction above
0.5 for 3 steps" or "an ``oom_recovered`` event occurred"), and ``evaluate``,
which checks one trigger against a metric history and an event log and
returns a ``Firing`` with its evidence (metric, flagged step windows, values).
Runbook front matter declares triggers (rlctl.incidents.runbooks); ``rlctl diagnose``,
``rlctl runbook check`` and the live alerts during training all evaluate these
same objects, so a threshold lives in exactly one place.

Conditions (``when``):
  above / below      value > / < ``threshold`` for ``window`` consecutive steps
  increases          a counter grew at ``window`` consecutive steps (e.g. NaN-skipped steps)
  nonfinite          the metric was NaN/Inf at some step (SQLite keeps NaN only as a
                     ``metric_nonfinite`` event, which counts too)
  rises / drops      the mean of the last ``window`` steps moved up / down against the
                     mean of the ``baseline`` steps before (default: ``window``) by more
                     than ``by`` (absolute) or ``by_ratio`` (relative to the earlier mean).
                     A ``baseline`` longer than ``window`` makes the reference a steadier
                     mean, so a per-step noisy metric (entropy over a small batch) can have a
                     tight bound without firing on noise, and detection still takes only
                     ``window`` steps
  falls_steadily     over ``window`` steps, at least 80% of step-to-step changes are
                     decreases and the total decline exceeds ``by_ratio``
  occurs             an event of kind ``event`` was recorded at least ``threshold`` times

What this is not: reading the registry (callers pass histories) or rendering.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

SEVERITY_RANK = {"info": 0, "warning": 1, "high": 2, "critical": 3}
Severity = Literal["info", "warning", "high", "critical"]
Condition = Literal["above", "below", "increases", "nonfinite", "rises", "drops", "falls_steadily", "occurs"]
Series = Sequence[tuple[int, float]]


class Trigger(BaseModel):
    """One metric (or event) condition; see the module docstring for ``when``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(description="Unique within its runbook, e.g. clip-fraction-high.")
    when: Condition = Field(description="The condition kind.")
    metric: str | None = Field(None, description="Recorded metric name (R-MET names), for metric conditions.")
    event: str | None = Field(None, description="Registry event kind, for `occurs`.")
    threshold: float | None = Field(None, description="Bound for above/below; minimum count for occurs.")
    by: float | None = Field(None, ge=0, description="Absolute change for rises/drops.")
    by_ratio: float | None = Field(None, ge=0, description="Relative change for rises/drops/falls_steadily.")
    window: int = Field(1, ge=1, description="Consecutive steps (above/below/increases) or window size.")
    baseline: int | None = Field(None, ge=1, description="rises/drops: steps before the window whose mean is "
                                 "the reference (default: window).")
    severity: Severity = Field("warning", description="How bad a firing is.")
    branch: str | None = Field(None, description="Diagnosis branch; defaults to the runbook's.")
    summary: str = Field(description="One line a person reads when it fires.")

    @model_validator(mode="after")
    def _complete(self) -> "Trigger":
        if self.when == "occurs":
            if not self.event:
                raise ValueError(f"trigger {self.id!r}: `occurs` needs `event: KIND`")
            return self
        if not self.metric:
            raise ValueError(f"trigger {self.id!r}: `{self.when}` needs `metric: NAME`")
        if self.when in ("above", "below") and self.threshold is None:
            raise ValueError(f"trigger {self.id!r}: `{self.when}` needs `threshold`")
        if self.when in ("rises", "drops") and self.by is None and self.by_ratio is None:
            raise ValueError(f"trigger {self.id!r}: `{self.when}` needs `by` or `by_ratio`")
        if self.baseline is not None and self.when not in ("rises", "drops"):
            raise ValueError(f"trigger {self.id!r}: `baseline` applies to rises/drops only, not `{self.when}`")
        if self.when == "falls_steadily" and (self.by_ratio is None or self.window < 3):
            raise ValueError(f"trigger {self.id!r}: `falls_steadily` needs `by_ratio` and `window` >= 3")
        return self

    def describe(self) -> str:
        """The condition in words, e.g. ``clip_fraction > 0.5 for 3 steps``."""
        target = self.metric or f"event {self.event}"
        if self.when in ("above", "below"):
            sign = ">" if self.when == "above" else "<"
            return f"{target} {sign} {self.threshold:g}" + (f" for {self.window} steps" if self.window > 1 else "")
        if self.when in ("rises", "drops"):
            amount = f"{self.by:g}" if self.by is not None else f"{100 * (self.by_ratio or 0):.0f}%"
            before = self.baseline or self.window
            return f"{target} {self.when} by > {amount} (mean of {self.window} steps vs the {before} before)"
        if self.when == "falls_steadily":
            return f"{target} falls steadily by > {100 * (self.by_ratio or 0):.0f}% over {self.window} steps"
        if self.when == "increases":
            return f"{target} increases" + (f" at {self.window} consecutive steps" if self.window > 1 else "")
        if self.when == "occurs":
            return f"event {self.event} recorded" + (f" >= {self.threshold:g} times" if self.threshold else "")
        return f"{target} is NaN/Inf"


@dataclass(frozen=True, slots=True)
class Firing:
    """A trigger that fired, with its evidence: flagged ``windows`` (first, last step) and values there."""

    trigger: Trigger
    windows: tuple[tuple[int, int], ...]
    values: tuple[tuple[int, float], ...]
    detail: str
    magnitude: float = 1.0  # how far past the bound (>= 1); ranks findings of equal severity
    events: tuple[str, ...] = field(default_factory=tuple)

    @property
    def last_step(self) -> int:
        return self.windows[-1][1] if self.windows else -1

    def to_json(self) -> dict[str, Any]:
        t = self.trigger
        return {"trigger": t.id, "condition": t.describe(), "metric": t.metric, "event": t.event,
                "severity": t.severity, "summary": t.summary, "detail": self.detail,
                "windows": [list(w) for w in self.windows], "values": [list(v) for v in self.values],
                "magnitude": self.magnitude, "events": list(self.events)}


@dataclass(frozen=True, slots=True)
class History:
    """What triggers are evaluated over: ``metrics[name] = [(step, value), ...]`` ascending, and events."""

    metrics: Mapping[str, Series]
    events: Sequence[Any] = ()  # objects with .kind, .message, .data (EventRecord)


def history_from(points: Iterable[Any], events: Sequence[Any] = ()) -> History:
    """A History from registry MetricPoints (any order) and EventRecords."""
    series: dict[str, list[tuple[int, float]]] = {}
    for p in points:
        series.setdefault(p.name, []).append((int(p.step), float(p.value)))
    for values in series.values():
        values.sort()
    return History(metrics=series, events=tuple(events))


def evaluate(trigger: Trigger, history: History) -> Firing | None:
    """The firing of ``trigger`` over ``history``, or None when the condition never held."""
    if trigger.when == "occurs":
        return _occurs(trigger, history.events)
    series = list(history.metrics.get(trigger.metric or "", ()))
    if trigger.when == "nonfinite":
        return _nonfinite(trigger, series, history.events)
    finite = [(s, v) for s, v in series if math.isfinite(v)]
    if trigger.when in ("above", "below", "increases"):
        return _runs(trigger, finite)
    if trigger.when in ("rises", "drops"):
        return _shift(trigger, finite)
    return _steady_fall(trigger, finite)


def _runs(t: Trigger, series: Series) -> Firing | None:
    """Maximal runs of consecutive recorded steps where the condition holds, at least ``window`` long."""
    holds: list[bool] = []
    for i, (_, v) in enumerate(series):
        if t.when == "above":
            holds.append(v > t.threshold)  # type: ignore[operator]
        elif t.when == "below":
            holds.append(v < t.threshold)  # type: ignore[operator]
        else:
            prev = series[i - 1][1] if i else 0.0
            holds.append(v > prev)
    windows, start = [], None
    for i, ok in enumerate(holds + [False]):
        if ok and start is None:
            start = i
        if not ok and start is not None:
            if i - start >= t.window:
                windows.append((start, i - 1))
            start = None
    if not windows:
        return None
    flagged = [series[i] for a, b in windows for i in range(a, b + 1)]
    if t.when == "increases":
        total = series[windows[-1][1]][1]
        detail = f"{t.metric} rose to {total:g} (at steps {', '.join(str(s) for s, _ in flagged[:8])})"
        magnitude = 1.0 + len(flagged)
    else:
        worst = max(flagged, key=lambda sv: sv[1]) if t.when == "above" else min(flagged, key=lambda sv: sv[1])
        bound = abs(t.threshold or 0.0) or 1.0
        magnitude = 1.0 + abs(worst[1] - (t.threshold or 0.0)) / bound
        detail = (f"{t.metric} {'>' if t.when == 'above' else '<'} {t.threshold:g} at {len(flagged)} step(s); "
                  f"worst {worst[1]:.4g} at step {worst[0]}")
    return Firing(t, tuple((series[a][0], series[b][0]) for a, b in windows), tuple(flagged), detail, magnitude)


def _shift(t: Trigger, series: Series) -> Firing | None:
    """Sliding comparison of the last ``window`` steps' mean with the mean of the ``baseline`` steps before;
    flags every window past the bound."""
    w, base = t.window, t.baseline or t.window
    best: tuple[float, int, float, float] | None = None
    windows: list[tuple[int, int]] = []
    for end in range(w + base - 1, len(series)):
        before = sum(v for _, v in series[end - w - base + 1:end - w + 1]) / base
        after = sum(v for _, v in series[end - w + 1:end + 1]) / w
        change = after - before if t.when == "rises" else before - after
        ratio = change / max(abs(before), 1e-8)
        past = (t.by is not None and change > t.by) or (t.by_ratio is not None and ratio > t.by_ratio)
        if past:
            span = (series[end - w + 1][0], series[end][0])
            if windows and span[0] <= windows[-1][1] + 1:
                windows[-1] = (windows[-1][0], span[1])
            else:
                windows.append(span)
            if best is None or change > best[0]:
                best = (change, end, before, after)
    if best is None:
        return None
    change, end, before, after = best
    bound = t.by if t.by is not None else (t.by_ratio or 0) * max(abs(before), 1e-8)
    values = tuple(sv for sv in series if any(a <= sv[0] <= b for a, b in windows))
    detail = (f"{t.metric} mean {before:.4g} -> {after:.4g} ({'+' if t.when == 'rises' else '-'}{abs(change):.4g}) "
              f"over steps {series[end - w - base + 1][0]}-{series[end][0]}")
    return Firing(t, tuple(windows), values, detail, 1.0 + change / max(bound, 1e-8))


def _steady_fall(t: Trigger, series: Series) -> Firing | None:
    w = t.window
    for end in range(len(series) - 1, w - 2, -1):
        chunk = series[end - w + 1:end + 1]
        diffs = [b[1] - a[1] for a, b in zip(chunk, chunk[1:])]
        first, last = chunk[0][1], chunk[-1][1]
        decline = (first - last) / max(abs(first), 1e-8)
        if sum(d < 0 for d in diffs) >= 0.8 * len(diffs) and decline > (t.by_ratio or 0):
            detail = f"{t.metric} fell {100 * decline:.0f}% from {first:.4g} to {last:.4g} over steps {chunk[0][0]}-{chunk[-1][0]}"
            return Firing(t, ((chunk[0][0], chunk[-1][0]),), tuple(chunk), detail, 1.0 + decline)
    return None


def _nonfinite(t: Trigger, series: Series, events: Sequence[Any]) -> Firing | None:
    bad = [(s, v) for s, v in series if not math.isfinite(v)]
    for e in events:
        data = getattr(e, "data", {}) or {}
        if e.kind == "metric_nonfinite" and data.get("name") == t.metric and isinstance(data.get("step"), int):
            bad.append((data["step"], float("nan")))
    if not bad:
        return None
    bad = sorted(set(bad), key=lambda sv: sv[0])
    steps = [s for s, _ in bad]
    windows: list[tuple[int, int]] = []
    for s in steps:
        if windows and s == windows[-1][1] + 1:
            windows[-1] = (windows[-1][0], s)
        else:
            windows.append((s, s))
    detail = f"{t.metric} was NaN/Inf at {len(steps)} step(s): {', '.join(str(s) for s in steps[:8])}"
    return Firing(t, tuple(windows), tuple(bad), detail, 1.0 + len(steps))


def _occurs(t: Trigger, events: Sequence[Any]) -> Firing | None:
    hits = [e for e in events if e.kind == t.event]
    if not hits or len(hits) < (t.threshold or 1):
        return None
    steps = sorted({int(s) for e in hits if isinstance(s := (e.data or {}).get("step"), (int, float))})
    windows = tuple((s, s) for s in steps)
    detail = f"{len(hits)} {t.event} event(s); last: {hits[-1].message}"
    return Firing(t, windows, tuple((s, float(i + 1)) for i, s in enumerate(steps)), detail, 1.0 + len(hits),
                  events=tuple(e.message for e in hits[-5:]))
