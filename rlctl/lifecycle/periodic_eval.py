"""Evaluation during training: greedy pass@1 of the current policy on dev every ``eval.every_steps`` steps.

What this is: ``DevEval``, called at every step end (rlctl.engine.loop.StepEnd,
in every mode) on the weights the step just published. Every
``eval.every_steps`` completed steps it decodes the first
``eval.every_num_prompts`` dev prompts greedily (``eval.max_tokens``) with the
run's rollout backend, grades them with the run's correctness reward, and
returns ``eval_dev_pass_at_1`` and ``eval_dev_seconds``: they join that
step's metrics, so every metric sink (the registry, metrics.jsonl,
TensorBoard, MLflow, W&B) records them at that step, the checkpoint's
manifest carries them and the live display shows them; a ``dev_eval`` event
says the same. Hidden stays for the final table. In the overlapped modes the
eval generates on the fleet's first worker between two of its producer's
calls (rlctl.engine.producers.RolloutFleet.generate), with the newest weights.

An eval that fails is reported (a warning and a ``dev_eval_failed`` event) and
training goes on: it never raises, except for an interrupt.

With ``eval.grader`` (a reward function's {name, options}, kept apart from the
training reward) the answers are graded by it in its own process (a one-worker
rlctl.engine.reward_pool.ProcessRewardPool), and also by the training reward:
``eval_dev_pass_at_1`` is then the eval grader's, ``eval_dev_score`` its mean,
``eval_dev_train_reward`` the training reward's mean on the same answers and
``eval_reward_gap`` the difference (a reward hack grows it; a runbook trigger
alerts on it and a ``reward_gap`` stop rule can end the run). The event
records the eval grader's name and version.

``prepare`` is the run's checkpointer hook: a step whose metrics carry a new
best dev score asks for a save when the store keeps the best checkpoint by
``eval_dev_pass_at_1`` (train.stop_rules sets that).

What this is not: the final evaluation (rlctl.lifecycle.evaluate).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from rlctl.config.models import RunConfig
from rlctl.contracts.types import RolloutRequest, SamplingConfig
from rlctl.hooks.manager import Plugins
from rlctl.registry.store import Registry

BEST_DEV_METRIC = "eval_dev_pass_at_1"


def best_checkpoint_metric(config: RunConfig) -> str | None:
    """checkpoint.keep_best_metric, else the dev score when stop rules may end the run and the dev eval is on."""
    if config.checkpoint.keep_best_metric is None and config.train.stop_rules and config.eval.every_steps > 0:
        return BEST_DEV_METRIC
    return config.checkpoint.keep_best_metric


class DevEval:
    """Greedy dev pass@1 every N steps; ``__call__(step)`` after each step (0-based)."""

    def __init__(self, roles: Any, plugins: Plugins, registry: Registry, run_id: str,
                 warn: Callable[[str], None]) -> None:
        config = roles.config
        self.roles, self.plugins, self.registry, self.run_id, self.warn = roles, plugins, registry, run_id, warn
        self.every = config.eval.every_steps
        self.enabled = self.every > 0
        self.records = roles.task.dev[:config.eval.every_num_prompts]
        self.grader = None
        self.pool: Any = None  # the eval.grader's worker process, started at the first eval
        self.keep_best = best_checkpoint_metric(config) == BEST_DEV_METRIC
        self.best: float | None = None

    def prepare(self, steps_done: int, metrics: Mapping[str, float]) -> tuple[Mapping[str, float], bool]:
        """Checkpointer hook: a new best dev score in the step's metrics asks for a save when the best
        checkpoint is kept by it."""
        score = metrics.get(BEST_DEV_METRIC)
        if score is None:
            return metrics, False
        better = self.best is None or score > self.best
        if better:
            self.best = score
        return metrics, better and self.keep_best

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def due(self, step: int) -> bool:
        return self.enabled and (step + 1) % self.every == 0

    def __call__(self, step: int) -> dict[str, float] | None:
        """The dev metrics of ``step`` (None when not due or when the eval failed); the sinks record them."""
        if not self.due(step):
            return None
        try:
            metrics = self._evaluate()
            gap = (f", eval score {metrics['eval_dev_score']:.3f} vs training reward "
                   f"{metrics['eval_dev_train_reward']:.3f} (gap {metrics['eval_reward_gap']:+.3f})"
                   if "eval_reward_gap" in metrics else "")
            grader = ({"eval_grader": self.roles.config.eval.grader.name, "eval_grader_version": self.pool.version}
                      if self.pool is not None else {})
            self.registry.add_event(self.run_id, "dev_eval", f"step {step + 1}: dev pass@1 "
                                    f"{metrics['eval_dev_pass_at_1']:.3f} on {len(self.records)} prompts{gap}",
                                    {"step": step, **metrics, **grader})
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
        config = self.roles.config
        if config.eval.grader is not None:
            return self._evaluate_apart(started)
        if self.grader is None:
            self.grader = correctness_grader(config, self.plugins)
        trajectories = self._generate()
        results = [self.grader.score(t, r.answer) for t, r in zip(trajectories, self.records)]
        correct = sum(int(res.ok and res.total >= 1.0) for res in results)
        return {"eval_dev_pass_at_1": correct / max(1, len(self.records)),
                "eval_dev_seconds": time.perf_counter() - started}

    def _generate(self) -> list[Any]:
        roles, config = self.roles, self.roles.config
        sampling = SamplingConfig(temperature=0.0, max_tokens=config.eval.max_tokens)
        return roles.rollout.generate([
            RolloutRequest(prompt_id=r.id, prompt_tokens=tuple(roles.tokenizer(r.text)["input_ids"]), group_size=1,
                           sampling=sampling, dataset_version=roles.task.version) for r in self.records])

    def _evaluate_apart(self, started: float) -> dict[str, float]:
        """Grade the greedy dev answers with eval.grader (its own process) and with the training reward."""
        from functools import partial

        from rlctl.engine.reward_pool import ProcessRewardPool
        from rlctl.lifecycle.grading import eval_grader_from_config

        config = self.roles.config
        if self.pool is None:
            self.pool = ProcessRewardPool(partial(eval_grader_from_config, config), 1,
                                          timeout_s=config.reward.timeout_s, retries=config.reward.retries)
        trajectories = self._generate()
        answers = [r.answer for r in self.records]
        graded = self.pool.score(trajectories, answers)
        trained = [self.roles.reward.score(t, a) for t, a in zip(trajectories, answers)]
        n = max(1, len(self.records))
        scores = [g.total for g in graded if g.ok]
        if len(scores) < len(graded):
            bad = next(g for g in graded if not g.ok)
            raise RuntimeError(f"the eval grader failed on {len(graded) - len(scores)} of {len(graded)} answers "
                               f"({bad.error_code})")
        score = sum(scores) / n
        train_reward = sum(t.total for t in trained if t.ok) / max(1, sum(1 for t in trained if t.ok))
        return {"eval_dev_pass_at_1": sum(int(s >= 1.0) for s in scores) / n, "eval_dev_score": score,
                "eval_dev_train_reward": train_reward, "eval_reward_gap": train_reward - score,
                "eval_dev_seconds": time.perf_counter() - started}
