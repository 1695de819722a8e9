"""The RL loop: sample -> score -> select -> train_on (advantages, update, publish) -> log -> checkpoint.

What this is: ``run_sync``, the synchronous loop you can read top to bottom:
it generates a step's groups with the run's one rollout engine, then hands
them to the training step (rlctl.engine.step.train_on), which every mode
shares. The overlapped driver (rlctl.engine.overlap) differs only in how
groups arrive: rollout workers feed a queue while the learner trains.
``StepEnd`` is what both do after a step (the periodic eval, sinks,
checkpoint, observer, the generated-token budget); rlctl.engine.drive picks
the driver.

What this is not: building roles (rlctl.placement), run bookkeeping
(rlctl.lifecycle.run) or display (the CLI passes an observer). It never imports
ray, rich or the registry.
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Protocol, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.contracts.roles import MetricSink
from rlctl.contracts.types import Trajectory
from rlctl.engine.groups import Sampler, request_encoder, sample_groups
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.metrics import MachineLoad
from rlctl.engine.roles import Roles
from rlctl.engine.samples import SampleLog
from rlctl.engine.spec import LoopSpec
from rlctl.engine.step import StepInput, train_on

Observer = Callable[[int, Mapping[str, float]], None]
Evaluate = Callable[[int], Mapping[str, float] | None]  # step -> the eval's metrics at that step (None: none ran)


class Checkpointer(Protocol):
    """Called after each step (rlctl.engine.snapshot.StepCheckpointer saves when one is due)."""

    def after_step(self, steps_done: int, metrics: Mapping[str, float],
                   queue_cursor: Mapping[str, object] | None = None) -> None: ...


class StepEnd:
    """After every step, in every mode: evaluate, log to the sinks, checkpoint, tell the observer; whether to stop.

    The run stops after the step at which the generated-token budget
    (``train.max_generated_tokens``) or the wall-clock budget
    (``train.max_wall_seconds``; each step records ``rl_seconds_total``, the
    seconds from the loop's start to the end of that step, its eval included)
    is spent, both counted from the loop's first step.
    ``log`` adds the machine's load over the step to the step's metrics
    (rlctl.engine.metrics.MachineLoad), so a diagnosis can tell a busy machine
    from a slow engine. ``evaluate`` (the run's periodic dev eval) runs first,
    on the weights the step just published: its metrics join the step's, so
    the sinks (written whenever an eval ran, whatever ``log_every`` says), the
    checkpoint's manifest and the observer all see them at that step.
    """

    def __init__(self, spec: LoopSpec, sinks: Sequence[MetricSink], observer: Observer | None,
                 checkpoint: Checkpointer | None, heartbeat: Heartbeat, evaluate: Evaluate | None = None) -> None:
        self.spec, self.sinks, self.observer, self.checkpoint = spec, sinks, observer, checkpoint
        self.heartbeat, self.evaluate = heartbeat, evaluate
        self.started = time.perf_counter()
        self.generated_total = 0.0
        self.load = MachineLoad()

    def count(self, tokens: float) -> float:
        """Add a step's generated tokens; the running total."""
        self.generated_total += tokens
        return self.generated_total

    def log(self, step: int, metrics: Mapping[str, float], samples: Sequence[Trajectory] = ()) -> bool:
        """Write the step's metrics where due; whether the budget is spent (the loop stops after this step).

        ``metrics`` (the step's dict) gains the load metrics and the eval's in place, so the checkpoint and the
        observer see them too. ``samples`` (the step's, StepOutcome.samples) go to the sinks that keep samples
        (rlctl.engine.samples.SampleLog) at the same steps."""
        evaluated = self.evaluate(step) if self.evaluate is not None else None
        if isinstance(metrics, dict):
            metrics.update(self.load.sample())
            metrics.update(evaluated or {})
            metrics["rl_seconds_total"] = time.perf_counter() - self.started
        spent = self.spec.spent(metrics["generated_tokens_total"], metrics.get("rl_seconds_total", 0.0))
        bound, mismatch = self.spec.logprob_mismatch_bound, metrics.get("logprob_mismatch_max")
        if (self.spec.logs(step, spent) or evaluated
                or (bound is not None and mismatch is not None and mismatch > bound)):
            for sink in self.sinks:
                sink.write(step, metrics)
                if isinstance(sink, SampleLog):
                    sink.write_samples(step, samples)
        check_mismatch(step, mismatch, bound)
        return spent

    def save(self, step: int, metrics: Mapping[str, float], queue_cursor: Mapping[str, object] | None = None) -> None:
        if self.checkpoint is not None:  # after logging: a checkpoint never skips past unlogged metrics
            with self.heartbeat.phase("save", "checkpoint"):
                self.checkpoint.after_step(step + 1, metrics, queue_cursor)

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.observer is not None:
            self.observer(step, metrics)


def check_mismatch(step: int, mismatch: float | None, bound: float | None) -> None:
    """Stop the run (RoleError naming ``step``) when the engine's and the learner's logprobs drift past ``bound``."""
    if bound is None or mismatch is None or mismatch <= bound:
        return
    raise RoleError(f"step {step}: logprob_mismatch_max {mismatch:.3g} exceeds train.logprob_mismatch_bound {bound:g}: "
                    "the rollout engine's behaviour logprobs and the learner's recomputation of the same tokens "
                    "disagree, so every importance ratio of this step is off",
                    "check that the engine serves the learner's current weights in the same dtype and samples "
                    "with the logprobs the learner recomputes (vLLM: --logprobs-mode processed_logprobs); raise "
                    "the bound only if the gap is expected (bf16 engines)")


def run_sync(roles: Roles, spec: LoopSpec, sinks: Sequence[MetricSink], observer: Observer | None = None,
             start_step: int = 0, checkpoint: Checkpointer | None = None,
             heartbeat: Heartbeat = NO_HEARTBEAT, evaluate: Evaluate | None = None) -> dict[str, float]:
    """Run steps ``start_step .. spec.steps-1`` with the run's one rollout engine; return the last step's metrics.

    A resumed run passes the restored roles and ``start_step`` = the
    checkpoint's completed steps. ``heartbeat`` is told of every role call
    (rlctl.engine.heartbeat; the run's hang watchdog listens); ``evaluate`` is the periodic eval (StepEnd).
    """
    end = StepEnd(spec, sinks, observer, checkpoint, heartbeat, evaluate)
    sampler = Sampler(prompts=roles.cursor.next, make_request=request_encoder(roles, spec.group_size), rollout=roles.rollout,
                      reward=roles.reward, answers={r.id: r.answer for r in roles.task.train},
                      estimator=roles.estimator, group_size=spec.group_size, max_tokens=spec.max_tokens,
                      truncation_penalty=spec.truncation_penalty, fresh_reward=roles.reward_factory,
                      verifier_retries=spec.verifier_retries, pool=roles.reward_pool, heartbeat=heartbeat)
    metrics: dict[str, float] = {}
    for step in range(start_step, spec.steps):
        budget = None if spec.max_generated_tokens is None else spec.max_generated_tokens - end.generated_total
        sampled = sample_groups(sampler, spec.prompts_per_step, token_budget=budget)
        total = end.count(sampled.generated_tokens)
        groups = len(sampled.selection.kept) // spec.group_size
        inputs = StepInput(selection=sampled.selection, times=sampled.times, verify_latencies=sampled.verify_latencies,
                           rollout_latencies=[sampled.times["T_r"]] * groups,
                           driver={**sampled.metrics, "generated_tokens": float(sampled.generated_tokens),
                                   "generated_tokens_total": total, "generated_tokens_per_s":
                                   sampled.generated_tokens / sampled.times["T_r"] if sampled.times["T_r"] > 0
                                   else 0.0})
        outcome = train_on(inputs, roles, spec, step=step, heartbeat=heartbeat)
        metrics = outcome.metrics
        spent = end.log(step, metrics, outcome.samples)
        end.save(step, metrics)
        end.observe(step, metrics)
        if spent:
            break
    return metrics
