"""The synchronous RL loop: sample -> score -> advantages -> update -> sync weights -> log -> checkpoint.

What this is: one function you can read top to bottom. Every detail lives in a
role (rollout backend, reward, learner) or a pure function (rlctl.algo).

What this is not: run bookkeeping (registry, run dir: rlctl.ops.run) or
display (the CLI passes an observer). It never imports ray, rich or the registry.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Literal, Mapping, Protocol, Sequence

from rlctl.contracts.roles import MetricSink
from rlctl.contracts.types import RolloutRequest
from rlctl.engine.batching import build_batch, group_rewards
from rlctl.engine.metrics import step_metrics
from rlctl.engine.scoring import score_all
from rlctl.engine.session import Session

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from rlctl.config.models import RunConfig

Observer = Callable[[int, Mapping[str, float]], None]


class Checkpointer(Protocol):
    """Called after each step (rlctl.engine.snapshot.StepCheckpointer saves when one is due)."""

    def after_step(self, steps_done: int, metrics: Mapping[str, float]) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopSpec:
    """What the loop needs to know, and nothing else of the run config."""

    steps: int  # total steps of the run (a resumed run starts later, ends here)
    prompts_per_step: int  # B
    group_size: int  # G
    normalize_std: bool = True  # divide group advantages by the group std
    truncation_penalty: float | None = 0.0  # reward of a response cut at max_tokens (None: graded as is)
    kl_coef: float = 0.0
    kl_placement: Literal["reward", "loss"] = "loss"  # "loss" is the learner's business
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    log_every: int = 1  # sinks get every log_every-th step and the last one
    mode: Literal["sync", "one_step_off", "async"] = "sync"  # run_sync runs sync; the others run in
    # rlctl.engine.async_loop (rlctl.dist picks), whose AsyncSpec carries the queue and staleness settings
    max_staleness: int = 0  # policy versions a sample may lag behind (0 in sync mode)

    @classmethod
    def from_config(cls, config: "RunConfig") -> "LoopSpec":
        a = config.algo
        return cls(steps=config.train.steps, prompts_per_step=a.prompts_per_step, group_size=a.group_size,
                   normalize_std=a.normalize_std, truncation_penalty=config.rollout.truncation_penalty,
                   kl_coef=a.kl.coef, kl_placement=a.kl.placement, kl_estimator=a.kl.estimator,
                   log_every=config.train.log_every, mode=config.mode,
                   max_staleness=0 if config.mode == "sync" else config.staleness.max_staleness)


def run_sync(session: Session, spec: LoopSpec, sinks: Sequence[MetricSink], observer: Observer | None = None,
             start_step: int = 0, checkpoint: Checkpointer | None = None) -> dict[str, float]:
    """Run steps ``start_step .. spec.steps-1``; return the last step's metrics.

    A resumed run passes the restored session and ``start_step`` = the
    checkpoint's completed steps.
    """
    from rlctl.algo.kl import kl_shaped_rewards

    s = session
    answers = {r.id: r.answer for r in s.task.train}
    encoded: dict[str, tuple[int, ...]] = {}
    metrics: dict[str, float] = {}
    for step in range(start_step, spec.steps):
        t0 = time.perf_counter()
        prompts = s.cursor.next(spec.prompts_per_step)
        requests = [RolloutRequest(prompt_id=p.id, prompt_tokens=_encode(s, p.id, p.text, encoded),
                                   group_size=spec.group_size, sampling=s.sampling,
                                   dataset_version=s.task.version) for p in prompts]
        trajectories = s.rollout.generate(requests)
        t1 = time.perf_counter()
        scored, verify_latencies = score_all(trajectories, answers, s.reward, spec.truncation_penalty)
        t2 = time.perf_counter()
        rewards, valid = group_rewards(scored, spec.group_size)  # [B, G]
        batch = build_batch(scored, [0.0] * len(scored), s.tokenizer.pad_token_id, s.sampling)
        if spec.kl_coef > 0 and spec.kl_placement == "reward":
            ref = s.learner.ref_logprobs(batch)  # [N, T]
            rewards = kl_shaped_rewards(rewards, batch.behavior_logprobs, ref, batch.action_mask, spec.kl_coef,
                                        spec.kl_estimator)
        advantages, adv_stats = compute_advantages(rewards, valid, spec)  # [B, G]
        per_token = advantages.reshape(-1, 1).float() * (batch.action_mask > 0)  # [N, T]: the sequence's, broadcast
        batch = replace(batch, advantages=per_token)
        trained_version = s.learner.policy_version  # unchanged by train_step when every update is skipped
        learner_stats = s.learner.train_step(batch)
        t3 = time.perf_counter()
        s.rollout.update_weights(s.learner.export_weights())
        t4 = time.perf_counter()
        metrics = step_metrics(
            scored=scored, learner_stats=learner_stats, adv_stats=adv_stats, advantages=advantages,
            verify_latencies=verify_latencies, learner_version=s.learner.policy_version,
            times={"T_r": t1 - t0, "T_v": t2 - t1, "T_l": t3 - t2, "T_s": t4 - t3}, trained_version=trained_version,
        )
        if step % spec.log_every == 0 or step == spec.steps - 1:
            for sink in sinks:
                sink.write(step, metrics)
        if checkpoint is not None:  # after logging: a checkpoint never skips past unlogged metrics
            checkpoint.after_step(step + 1, metrics)
        if observer is not None:
            observer(step, metrics)
    return metrics


def compute_advantages(rewards: "Tensor", valid: "Tensor", spec: LoopSpec) -> tuple["Tensor", dict[str, float]]:
    """Group-relative advantages [B, G] and their stats (the one place an estimator is chosen)."""
    from rlctl.algo.advantages import grpo_advantages

    return grpo_advantages(rewards, valid, normalize_std=spec.normalize_std)


def _encode(session: Session, prompt_id: str, text: str, cache: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    if prompt_id not in cache:
        cache[prompt_id] = tuple(session.tokenizer(text)["input_ids"])
    return cache[prompt_id]
