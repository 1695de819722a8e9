"""The synchronous RL loop: sample -> score -> advantages -> update -> sync weights -> log -> checkpoint.

What this is: one function you can read top to bottom. Every detail lives in a
role (rollout backend, reward, learner) or a pure function (rlctl.algo).

What this is not: run bookkeeping (registry, run dir: rlctl.ops.train) or
display (the CLI passes an observer). It never imports ray, rich or the registry.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Mapping, Protocol, Sequence

from rlctl.contracts.roles import MetricSink
from rlctl.contracts.types import RolloutRequest
from rlctl.engine.batching import build_batch, group_rewards
from rlctl.engine.metrics import step_metrics
from rlctl.engine.scoring import score_all
from rlctl.engine.session import Session

Observer = Callable[[int, Mapping[str, float]], None]


class Checkpointer(Protocol):
    """Called after each step (rlctl.engine.snapshot.StepCheckpointer saves when one is due)."""

    def after_step(self, steps_done: int, metrics: Mapping[str, float]) -> None: ...


def run_sync(session: Session, sinks: Sequence[MetricSink], observer: Observer | None = None,
             start_step: int = 0, checkpoint: Checkpointer | None = None) -> dict[str, float]:
    """Run steps ``start_step .. train.steps-1``; return the last step's metrics.

    A resumed run passes the restored session and ``start_step`` = the
    checkpoint's completed steps.
    """
    from rlctl.algo.advantages import grpo_advantages
    from rlctl.algo.kl import kl_estimate

    cfg, s = session.config, session
    answers = {r.id: r.answer for r in s.task.train}
    encoded: dict[str, tuple[int, ...]] = {}
    metrics: dict[str, float] = {}
    for step in range(start_step, cfg.train.steps):
        t0 = time.perf_counter()
        prompts = s.cursor.next(cfg.algo.prompts_per_step)
        requests = [RolloutRequest(prompt_id=p.id, prompt_tokens=_encode(s, p.id, p.text, encoded),
                                   group_size=cfg.algo.group_size, sampling=s.sampling,
                                   dataset_version=s.task.version) for p in prompts]
        trajectories = s.rollout.generate(requests)
        t1 = time.perf_counter()
        scored, verify_latencies = score_all(trajectories, answers, s.reward, cfg.rollout.truncation_penalty,
                                              pool=s.reward_pool)
        t2 = time.perf_counter()
        rewards, valid = group_rewards(scored, cfg.algo.group_size)  # [B, G]
        batch = build_batch(scored, [0.0] * len(scored), s.tokenizer.pad_token_id, s.sampling)
        if cfg.algo.kl.coef > 0 and cfg.algo.kl.placement == "reward":
            ref = s.learner.ref_logprobs(batch)  # [N, T]
            kl_seq = (kl_estimate(batch.behavior_logprobs, ref, cfg.algo.kl.estimator) * batch.action_mask).sum(-1)
            rewards = rewards - cfg.algo.kl.coef * kl_seq.view_as(rewards)
        advantages, adv_stats = grpo_advantages(rewards, valid, normalize_std=cfg.algo.normalize_std)  # [B, G]
        per_token = advantages.reshape(-1, 1).float() * (batch.action_mask > 0)  # [N, T]: the sequence's, broadcast
        batch = replace(batch, advantages=per_token)
        learner_stats = s.learner.train_step(batch)
        t3 = time.perf_counter()
        s.rollout.update_weights(s.learner.export_weights())
        t4 = time.perf_counter()
        metrics = step_metrics(
            scored=scored, learner_stats=learner_stats, adv_stats=adv_stats, advantages=advantages,
            verify_latencies=verify_latencies, learner_version=s.learner.policy_version,
            times={"T_r": t1 - t0, "T_v": t2 - t1, "T_l": t3 - t2, "T_s": t4 - t3},
        )
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
            for sink in sinks:
                sink.write(step, metrics)
        if checkpoint is not None:  # after logging: a checkpoint never skips past unlogged metrics
            checkpoint.after_step(step + 1, metrics)
        if observer is not None:
            observer(step, metrics)
    return metrics


def _encode(session: Session, prompt_id: str, text: str, cache: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    if prompt_id not in cache:
        cache[prompt_id] = tuple(session.tokenizer(text)["input_ids"])
    return cache[prompt_id]
