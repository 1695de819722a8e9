"""``train.stop_rules``: end a run early, with status ``stopped``, when a rule fires.

What this is: ``StopRules``, which the run feeds every step's metrics (with
the periodic dev eval's merged in at an eval step) and which returns a
``Stop`` naming the rule, the step and the evidence when one fires; the run
then raises ``StopRun`` out of the loop, saves and marks itself ``stopped``
(rlctl.lifecycle.run). Rules (rlctl.config.models.StopRule):

  dev_drop    eval_dev_pass_at_1 fell on ``evals`` consecutive dev evals
  kl          kl_ref outside [min, max] for ``window`` consecutive steps
  entropy     entropy outside [min, max] for ``window`` consecutive steps
  lag_p95     staleness_p95 outside [min, max] for ``window`` consecutive steps
  reward_gap  eval_reward_gap (training reward minus eval.grader score on the
              same dev answers) outside [min, max] for ``window`` dev evals

A metric a step did not record (the dev metrics between evals) is not a
record: windows count the records, not the steps. Non-finite values are
skipped (the NaN guard owns them). A resumed run starts its windows afresh.

What this is not: live alerts, which only report (rlctl.incidents.recovery).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from rlctl.config.models import STOP_RULE_METRICS, StopRule


@dataclass(frozen=True, slots=True)
class Stop:
    """A rule that fired: ``index`` into train.stop_rules, the 0-based ``step`` it fired at, and why."""

    index: int
    rule: str
    step: int
    metric: str
    message: str
    values: tuple[tuple[int, float], ...] = field(default_factory=tuple)

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.rule, "index": self.index, "step": self.step, "metric": self.metric,
                "values": [list(v) for v in self.values]}


class StopRun(Exception):
    """Raised from the step observer when a stop rule fired; the run ends ``stopped``."""

    def __init__(self, stop: Stop, metrics: Mapping[str, float]) -> None:
        super().__init__(stop.message)
        self.stop, self.metrics = stop, dict(metrics)


class StopRules:
    """See the module docstring; ``observe(step, metrics)`` after each step."""

    def __init__(self, rules: Sequence[StopRule]) -> None:
        self.rules = list(rules)
        self.records: dict[int, list[tuple[int, float]]] = {}

    def observe(self, step: int, metrics: Mapping[str, float]) -> Stop | None:
        """The first rule that fires at ``step``, or None."""
        for i, rule in enumerate(self.rules):
            metric = STOP_RULE_METRICS[rule.rule]
            value = metrics.get(metric)
            if value is None or not math.isfinite(float(value)):
                continue
            series = self.records.setdefault(i, [])
            series.append((step, float(value)))
            stop = _dev_drop(i, rule, step, series) if rule.rule == "dev_drop" else _bound(i, rule, step, series)
            if stop is not None:
                return stop
        return None


def _dev_drop(index: int, rule: StopRule, step: int, series: list[tuple[int, float]]) -> Stop | None:
    tail = series[-(rule.evals + 1):]
    if len(tail) <= rule.evals or not all(b[1] < a[1] for a, b in zip(tail, tail[1:])):
        return None
    path = " -> ".join(f"{v:.3g}" for _, v in tail)
    at = ", ".join(str(s + 1) for s, _ in tail)
    message = (f"stop rule train.stop_rules.{index} (dev_drop) fired after step {step + 1}: the dev score "
               f"eval_dev_pass_at_1 fell on {rule.evals} consecutive dev evals ({path} after steps {at})")
    return Stop(index, "dev_drop", step, "eval_dev_pass_at_1", message, tuple(tail))


def _bound(index: int, rule: StopRule, step: int, series: list[tuple[int, float]]) -> Stop | None:
    tail = series[-rule.window:]

    def out(v: float) -> bool:
        return (rule.max is not None and v > rule.max) or (rule.min is not None and v < rule.min)

    if len(tail) < rule.window or not all(out(v) for _, v in tail):
        return None
    metric = STOP_RULE_METRICS[rule.rule]
    bounds = " and ".join(b for b in (f">= {rule.min:g}" if rule.min is not None else "",
                                      f"<= {rule.max:g}" if rule.max is not None else "") if b)
    records = "dev evals" if rule.rule == "reward_gap" else "steps"
    message = (f"stop rule train.stop_rules.{index} ({rule.rule}) fired after step {step + 1}: {metric} "
               f"{tail[-1][1]:.4g} is not {bounds}" + (f" for {rule.window} consecutive {records}"
                                                       if rule.window > 1 else ""))
    return Stop(index, rule.rule, step, metric, message, tuple(tail))
