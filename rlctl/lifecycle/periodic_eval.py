"""Evaluation during training: greedy pass@1 of the current policy on dev every ``eval.every_steps`` steps.

What this is: ``DevEval``, called by the run after each step. Every
``eval.every_steps`` completed steps it decodes the first
``eval.every_num_prompts`` dev prompts greedily (``eval.max_tokens``) with the
run's rollout backend, which holds the weights just published, grades them
with the run's correctness reward, and records ``eval_dev_pass_at_1`` and
``eval_dev_seconds`` at that step in the registry (so they are curves next to
the step metrics) and as a ``dev_eval`` event. Hidden stays for the final table.

An eval that fails is reported (a warning and a ``dev_eval_failed`` event) and
training goes on: it never raises, except for an interrupt. It runs only in
``mode: sync``: the overlapped modes generate while the step trains, and a
second caller of their rollout fleet would race them (a warning says so once).

What this is not: the final evaluation (rlctl.lifecycle.evaluate).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rlctl.contracts.types import RolloutRequest, SamplingConfig
from rlctl.hooks.manager import Plugins
from rlctl.registry.store import Registry


class DevEval:
    """Greedy dev pass@1 every N steps; ``__call__(step)`` after each step (0-based)."""

    def __init__(self, roles: Any, plugins: Plugins, registry: Registry, run_id: str,
                 warn: Callable[[str], None]) -> None:
        config = roles.config
        self.roles, self.plugins, self.registry, self.run_id, self.warn = roles, plugins, registry, run_id, warn
        self.every = config.eval.every_steps
        self.enabled = self.every > 0 and config.mode == "sync"
        if self.every > 0 and not self.enabled:
            warn(f"eval.every_steps={self.every} is ignored in mode: {config.mode} (the dev eval runs in mode: "
                 "sync only); the final eval still runs")
        self.records = roles.task.dev[:config.eval.every_num_prompts]
        self.grader = None

    def due(self, step: int) -> bool:
        return self.enabled and (step + 1) % self.every == 0

    def __call__(self, step: int) -> dict[str, float] | None:
        """The dev metrics recorded at ``step`` (None when not due or when the eval failed)."""
        if not self.due(step):
            return None
        try:
            metrics = self._evaluate()
            self.registry.log_metrics(self.run_id, step, metrics)
            self.registry.add_event(self.run_id, "dev_eval", f"step {step + 1}: dev pass@1 "
                                    f"{metrics['eval_dev_pass_at_1']:.3f} on {len(self.records)} prompts",
                                    {"step": step, **metrics})
            return metrics
        except KeyboardInterrupt:
            raise
        except Exception as err:  # noqa: BLE001 - an eval must never end the run; it is reported instead
            message = f"the dev eval at step {step + 1} failed ({type(err).__name__}: {err}); training goes on"
            self.warn(message)
            try:
                self.registry.add_event(self.run_id, "dev_eval_failed", message, {"step": step})
            except Exception:  # noqa: BLE001 - the registry itself may be what failed
                pass
            return None

    def _evaluate(self) -> dict[str, float]:
        from rlctl.lifecycle.grading import correctness_grader

        started = time.perf_counter()
        roles, config = self.roles, self.roles.config
        if self.grader is None:
            self.grader = correctness_grader(config, self.plugins)
        sampling = SamplingConfig(temperature=0.0, max_tokens=config.eval.max_tokens)
        requests = [RolloutRequest(prompt_id=r.id, prompt_tokens=tuple(roles.tokenizer(r.text)["input_ids"]),
                                   group_size=1, sampling=sampling, dataset_version=roles.task.version)
                    for r in self.records]
        trajectories = roles.rollout.generate(requests)
        results = [self.grader.score(t, r.answer) for t, r in zip(trajectories, self.records)]
        correct = sum(int(res.ok and res.total >= 1.0) for res in results)
        return {"eval_dev_pass_at_1": correct / max(1, len(self.records)),
                "eval_dev_seconds": time.perf_counter() - started}
