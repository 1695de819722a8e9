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
from rlctl.engine.batching import build_batch
from rlctl.engine.estimation import estimate, sample_groups
from rlctl.engine.metrics import step_metrics
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
    cfg, s = session.config, session
    answers = {r.id: r.answer for r in s.task.train}
    encoded: dict[str, tuple[int, ...]] = {}
    metrics: dict[str, float] = {}
    budget = cfg.train.max_generated_tokens
    total_generated = 0.0  # counted from start_step: a resumed run's budget restarts there

    def request(p) -> RolloutRequest:
        return RolloutRequest(prompt_id=p.id, prompt_tokens=_encode(s, p.id, p.text, encoded),
                              group_size=cfg.algo.group_size, sampling=s.sampling, dataset_version=s.task.version)

    for step in range(start_step, cfg.train.steps):
        sampled = sample_groups(prompts=s.cursor.next, make_request=request, rollout=s.rollout, reward=s.reward,
                                answers=answers, estimator=s.estimator, num_prompts=cfg.algo.prompts_per_step,
                                group_size=cfg.algo.group_size, max_tokens=cfg.rollout.max_tokens,
                                truncation_penalty=cfg.rollout.truncation_penalty)
        scored = sampled.scored
        t2 = time.perf_counter()
        batch = build_batch(scored, [0.0] * len(scored), s.tokenizer.pad_token_id, s.sampling)
        est = estimate(estimator=s.estimator, batch=batch, rewards=sampled.rewards, valid=sampled.valid,
                       kl=cfg.algo.kl, ref_logprobs=s.learner.ref_logprobs,
                       values=s.critic.values if s.critic else None)
        total_generated += sampled.num_generated_tokens
        advantages = est.advantages
        adv_stats = {**est.stats, **sampled.metrics, "generated_tokens_total": total_generated}
        batch = replace(batch, advantages=advantages.float())
        learner_stats: dict[str, float] = {}
        if s.critic is not None:  # the critic regresses onto returns of the values the advantages used
            learner_stats.update(s.critic.train_step(batch, est.returns, est.values))
        if step >= (cfg.algo.critic.warmup_steps if s.critic is not None else 0):  # warm-up: critic only
            learner_stats.update(s.learner.train_step(batch))
        t3 = time.perf_counter()
        s.rollout.update_weights(s.learner.export_weights())
        t4 = time.perf_counter()
        metrics = step_metrics(
            scored=scored, learner_stats=learner_stats, adv_stats=adv_stats,
            advantages=advantages.abs().sum(-1),  # [N]: nonzero on the sequences that carry signal
            verify_latencies=sampled.verify_latencies, learner_version=s.learner.policy_version,
            times={**sampled.times, "T_l": t3 - t2, "T_s": t4 - t3},
        )
        spent = budget is not None and total_generated >= budget
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1 or spent:
            for sink in sinks:
                sink.write(step, metrics)
        if checkpoint is not None:  # after logging: a checkpoint never skips past unlogged metrics
            checkpoint.after_step(step + 1, metrics)
        if observer is not None:
            observer(step, metrics)
        if spent:
            break
    return metrics


def _encode(session: Session, prompt_id: str, text: str, cache: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    if prompt_id not in cache:
        cache[prompt_id] = tuple(session.tokenizer(text)["input_ids"])
    return cache[prompt_id]
