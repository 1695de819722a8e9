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
from rlctl.engine.batching import build_batch
from rlctl.engine.estimation import estimate, sample_groups
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.metrics import step_metrics
from rlctl.engine.session import Session

if TYPE_CHECKING:  # pragma: no cover
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
    truncation_penalty: float | None = 0.0  # reward of a response cut at max_tokens (None: graded as is)
    max_tokens: int = 0  # rollout.max_tokens: estimators that shape rewards by length read it
    kl_coef: float = 0.0
    kl_placement: Literal["reward", "loss"] = "loss"  # "loss" is the learner's business
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    log_every: int = 1  # sinks get every log_every-th step and the last one
    mode: Literal["sync", "one_step_off", "async"] = "sync"  # run_sync runs sync; the others run in
    # rlctl.engine.async_loop (rlctl.dist picks), whose AsyncSpec carries the queue and staleness settings
    max_staleness: int = 0  # policy versions a sample may lag behind (0 in sync mode)
    max_generated_tokens: int | None = None  # stop after the step whose running total reaches this
    critic_warmup_steps: int = 0  # steps that train only the critic (read only when the session has one)
    verifier_retries: int = 0  # re-score a timed-out / crashed sample with a fresh grader up to N times

    @classmethod
    def from_config(cls, config: "RunConfig") -> "LoopSpec":
        a = config.algo
        return cls(steps=config.train.steps, prompts_per_step=a.prompts_per_step, group_size=a.group_size,
                   truncation_penalty=config.rollout.truncation_penalty, max_tokens=config.rollout.max_tokens,
                   kl_coef=a.kl.coef, kl_placement=a.kl.placement, kl_estimator=a.kl.estimator,
                   log_every=config.train.log_every, max_generated_tokens=config.train.max_generated_tokens,
                   critic_warmup_steps=a.critic.warmup_steps, verifier_retries=config.faults.verifier_retries,
                   mode=config.mode, max_staleness=0 if config.mode == "sync" else config.staleness.max_staleness)


def run_sync(session: Session, spec: LoopSpec, sinks: Sequence[MetricSink], observer: Observer | None = None,
             start_step: int = 0, checkpoint: Checkpointer | None = None,
             heartbeat: Heartbeat = NO_HEARTBEAT) -> dict[str, float]:
    """Run steps ``start_step .. spec.steps-1``; return the last step's metrics.

    A resumed run passes the restored session and ``start_step`` = the
    checkpoint's completed steps. ``heartbeat`` is told of every role call
    (rlctl.engine.heartbeat; the run's hang watchdog listens).
    """
    s, beat = session, heartbeat.phase
    answers = {r.id: r.answer for r in s.task.train}
    encoded: dict[str, tuple[int, ...]] = {}
    metrics: dict[str, float] = {}
    total_generated = 0.0  # counted from start_step: a resumed run's budget restarts there

    def request(p) -> RolloutRequest:
        return RolloutRequest(prompt_id=p.id, prompt_tokens=_encode(s, p.id, p.text, encoded),
                              group_size=spec.group_size, sampling=s.sampling, dataset_version=s.task.version)

    for step in range(start_step, spec.steps):
        sampled = sample_groups(prompts=s.cursor.next, make_request=request, rollout=s.rollout, reward=s.reward,
                                answers=answers, estimator=s.estimator, num_prompts=spec.prompts_per_step,
                                group_size=spec.group_size, max_tokens=spec.max_tokens,
                                truncation_penalty=spec.truncation_penalty,
                                fresh_reward=s.reward_factory, verifier_retries=spec.verifier_retries,
                                pool=s.reward_pool, heartbeat=heartbeat,
                                token_budget=None if spec.max_generated_tokens is None
                                else spec.max_generated_tokens - total_generated)
        scored = sampled.scored
        total_generated += sampled.num_generated_tokens
        trained_version = s.learner.policy_version  # unchanged by train_step when every update is skipped
        learner_stats: dict[str, float] = {}
        t2 = time.perf_counter()
        if scored:
            batch = build_batch(scored, [0.0] * len(scored), s.tokenizer.pad_token_id, s.sampling)
            est = estimate(estimator=s.estimator, batch=batch, rewards=sampled.rewards, valid=sampled.valid,
                           kl_coef=spec.kl_coef if spec.kl_placement == "reward" else 0.0,
                           kl_estimator=spec.kl_estimator, ref_logprobs=s.learner.ref_logprobs,
                           values=s.critic.values if s.critic else None)
            advantages = est.advantages  # [N, T]
            adv_stats = {**est.stats, **sampled.metrics, "generated_tokens_total": total_generated}
            batch = replace(batch, advantages=advantages.float())
            if s.critic is not None:  # the critic regresses onto returns of the values the advantages used
                with beat("train", "critic"):
                    learner_stats.update(s.critic.train_step(batch, est.returns, est.values))
            if s.critic is None or step >= spec.critic_warmup_steps:  # the critic's warm-up leaves the policy as is
                with beat("train", "learner"):
                    learner_stats.update(s.learner.train_step(batch))
            signal = advantages.abs().sum(-1)  # [N]: nonzero on the sequences that carry signal
        else:  # dynamic sampling found no group with signal: no update (weights, optimizer and critic stay)
            import torch

            scored = sampled.seen
            adv_stats = {**sampled.metrics, "generated_tokens_total": total_generated}
            signal = torch.zeros(len(scored))
        t3 = time.perf_counter()
        if sampled.scored:
            with beat("publish", "learner"):
                update = s.learner.export_weights()
            with beat("publish", "rollout"):
                s.rollout.update_weights(update)
        t4 = time.perf_counter()
        metrics = step_metrics(
            scored=scored, learner_stats=learner_stats, adv_stats=adv_stats,
            advantages=signal,
            verify_latencies=sampled.verify_latencies, learner_version=s.learner.policy_version,
            times={**sampled.times, "T_l": t3 - t2, "T_s": t4 - t3}, trained_version=trained_version,
            dropped=sampled.unscored, group_size=spec.group_size,
        )
        spent = spec.max_generated_tokens is not None and total_generated >= spec.max_generated_tokens
        if step % spec.log_every == 0 or step == spec.steps - 1 or spent:
            for sink in sinks:
                sink.write(step, metrics)
        if checkpoint is not None:  # after logging: a checkpoint never skips past unlogged metrics
            with beat("save", "checkpoint"):
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
