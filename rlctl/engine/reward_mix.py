"""MixedReward: a weighted sum of reward functions with every component recorded.

What this is: a library class the engine builds from (name, weight, function)
triples. total = sum(weight * component total); each component's
total is recorded under its configured name; grader_version names every part.
``score_batch`` grades many samples at once: a component that can score a
batch in one call (``BatchRewardFunction``: the reward-model client) gets them
all, the others are called sample by sample, in the same order as ``score``.

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
from rlctl.contracts.roles import BatchRewardFunction, RewardFunction
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
        return self.score_batch([trajectory], [reference])[0]

    def score_batch(self, trajectories: Sequence[Trajectory], references: Sequence[str]) -> list[RewardResult]:
        """One result per sample, in order. A component with ``score_batch`` (a BatchRewardFunction, e.g. a
        reward-model client) gets all samples in one call; the others are called sample by sample."""
        n = len(trajectories)
        values: list[dict[str, float]] = [{} for _ in range(n)]
        errors: list[list[str]] = [[] for _ in range(n)]
        logs: list[list[str]] = [[] for _ in range(n)]
        spent = [0.0] * n  # per-sample grading seconds (a batched call's time shared evenly)
        for name, _, fn in self.components:
            for i, result in enumerate(self._component(name, fn, trajectories, references, errors, logs, spent)):
                if result is None:
                    continue
                if result.log:
                    logs[i].append(f"{name}: {result.log}")
                if result.error_code is not None:
                    errors[i].append(result.error_code)
                elif not math.isfinite(result.total):
                    errors[i].append("invalid_reward")
                    logs[i].append(f"{name}: non-finite value {result.total}")
                else:
                    values[i][name] = float(result.total)
        out = []
        for i in range(n):
            total = sum(weight * values[i][name] for name, weight, _ in self.components if name in values[i])
            if not errors[i] and not math.isfinite(total):
                errors[i].append("invalid_reward")
                logs[i].append(f"mix: non-finite total {total}")
            out.append(RewardResult(total=0.0 if errors[i] else total, components=values[i],
                                    grader_version=self.version, error_code=errors[i][0] if errors[i] else None,
                                    latency_s=spent[i], log="; ".join(logs[i])))
        return out

    @staticmethod
    def _component(name: str, fn: RewardFunction, trajectories: Sequence[Trajectory], references: Sequence[str],
                   errors: list[list[str]], logs: list[list[str]], spent: list[float]) -> list[RewardResult | None]:
        """``fn``'s result per sample; None where it failed (then its error is in ``errors`` / ``logs``)."""
        def failed(i: int, err: Exception) -> None:
            if isinstance(err, TimeoutError):  # a deadline, not a verdict: flagged as a timeout, retried or excluded
                errors[i].append(f"timeout:{name}")
                logs[i].append(f"{name}: {err}")
            else:  # reported through error_code + log, never a silent zero
                errors[i].append(f"grader_error:{name}")
                logs[i].append(f"{name}: {type(err).__name__}: {err}")

        batched = isinstance(fn, BatchRewardFunction)
        results: list[RewardResult | None] = [None] * len(trajectories)
        todo = []
        for i, (trajectory, reference) in enumerate(zip(trajectories, references)):
            started = time.perf_counter()
            try:
                fault_site("verifier.score", trajectory=trajectory, grader=name)
                if batched:
                    todo.append(i)
                else:
                    results[i] = fn.score(trajectory, reference)
            except Exception as err:  # noqa: BLE001 - every failure becomes this sample's error code
                failed(i, err)
            spent[i] += time.perf_counter() - started
        if todo:
            started = time.perf_counter()
            try:
                got = fn.score_batch([trajectories[i] for i in todo], [references[i] for i in todo])
                if len(got) != len(todo):
                    raise RuntimeError(f"score_batch returned {len(got)} results for {len(todo)} samples")
            except Exception as err:  # noqa: BLE001 - the whole call failed: every sample in it carries the error
                for i in todo:
                    failed(i, err)
            else:
                for i, result in zip(todo, got):
                    results[i] = result
            share = (time.perf_counter() - started) / len(todo)
            for i in todo:
                spent[i] += share
        return results
