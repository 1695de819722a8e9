"""MixedReward: a weighted sum of reward functions with every component recorded.

What this is: a library class the engine builds from (name, weight, function)
triples. total = sum(weight * component total); each component's
total is recorded under its configured name; grader_version names every part.

What this is not: a registered plugin component, or a place where errors
vanish. If any component fails (returns an error_code, raises, or gives a
non-finite value) the result carries ``error_code`` and ``total`` is 0.0 only
because NaN is not allowed: ``total`` is MEANINGLESS whenever ``error_code`` is
set, and the engine must exclude the sample (a grader failure is never a
zero score). Exceptions are
turned into ``error_code="grader_error:<name>"`` with the message in ``log``.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

from rlctl import RewardResult, Trajectory
from rlctl.contracts.roles import RewardFunction
from rlctl.engine.faults import fault_site


class MixedReward:
    """Weighted sum of reward functions.

    ``MixedReward([("math", 0.8, math_fn), ("format", 0.2, format_fn)])`` has
    grader_version "math:<math version>x0.8+format:<format version>x0.2".
    """

    name = "mix"

    def __init__(self, components: Sequence[tuple[str, float, RewardFunction]]) -> None:
        if not components:
            raise ValueError("a mixed reward needs at least one component; add one under reward.components")
        names = [name for name, _, _ in components]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward component names must be unique, {dup} repeats; rename one")
        for name, weight, _ in components:
            if not math.isfinite(weight):
                raise ValueError(f"reward component {name!r} has weight {weight}; use a finite number")
        self.components = tuple((name, float(weight), fn) for name, weight, fn in components)
        self.version = "+".join(f"{name}:{fn.version}x{weight!r}" for name, weight, fn in self.components)

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        values: dict[str, float] = {}
        errors: list[str] = []
        logs: list[str] = []
        for name, _, fn in self.components:
            try:
                fault_site("verifier.score", trajectory=trajectory, grader=name)
                result = fn.score(trajectory, reference)
            except TimeoutError as err:  # a deadline, not a verdict: flagged as a timeout, retried or excluded
                errors.append(f"timeout:{name}")
                logs.append(f"{name}: {err}")
                continue
            except Exception as err:  # reported through error_code + log, never a silent zero
                errors.append(f"grader_error:{name}")
                logs.append(f"{name}: {type(err).__name__}: {err}")
                continue
            if result.log:
                logs.append(f"{name}: {result.log}")
            if result.error_code is not None:
                errors.append(result.error_code)
            elif not math.isfinite(result.total):
                errors.append("invalid_reward")
                logs.append(f"{name}: non-finite value {result.total}")
            else:
                values[name] = float(result.total)
        total = sum(weight * values[name] for name, weight, _ in self.components if name in values)
        if not errors and not math.isfinite(total):
            errors.append("invalid_reward")
            logs.append(f"mix: non-finite total {total}")
        return RewardResult(
            total=0.0 if errors else total,
            components=values,
            grader_version=self.version,
            error_code=errors[0] if errors else None,
            latency_s=time.perf_counter() - started,
            log="; ".join(logs),
        )
