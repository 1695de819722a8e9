"""Evaluation: greedy pass@1 on a frozen split and a paired bootstrap of the difference.

What this is: decode every prompt of the split once with fixed greedy decoding
through the configured rollout backend, grade it with the run's correctness
reward (the ``math`` component, or the first component), and compare two
policies on the same prompts with a paired bootstrap 95% CI.

``sample_policy`` draws n answers per prompt at a temperature and counts the
correct ones, for pass@k (rlctl.lifecycle.passk).

What this is not: registry bookkeeping (rlctl.lifecycle.evaluate).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rlctl.config.models import RunConfig
from rlctl.contracts.types import PromptRecord, RolloutContext, RolloutRequest, SamplingConfig, TaskData
from rlctl.engine.episodes import build_rollout
from rlctl.hooks.manager import Plugins


@dataclass(frozen=True, slots=True)
class PolicyScores:
    name: str
    correct: tuple[int, ...]  # 1/0 per prompt, in split order
    responses: tuple[str, ...]
    apart: dict[str, Any] | None = None  # with eval.grader: its name, version, mean score and the training reward
    tool_calls: tuple[int, ...] | None = None  # episodes (rollout.environment): tool calls per prompt

    @property
    def pass_at_1(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0

    @property
    def tool_call_rate(self) -> float | None:
        """Share of prompts whose episode called a tool at least once; None for single-turn samples."""
        if self.tool_calls is None:
            return None
        return sum(1 for n in self.tool_calls if n) / len(self.tool_calls) if self.tool_calls else 0.0


@dataclass(frozen=True, slots=True)
class Comparison:
    diff: float
    ci_low: float
    ci_high: float
    num_prompts: int


def grade_policy(name: str, policy_dir: Path, config: RunConfig, plugins: Plugins, task: TaskData,
                 records: Sequence[PromptRecord]) -> PolicyScores:
    """Greedy-decode ``records`` with the policy in ``policy_dir`` and grade each answer."""
    from transformers import AutoTokenizer

    from rlctl.models.tokenizer import tokenizer_hash

    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    backend = build_rollout(plugins, config.rollout, RolloutContext(
        model_dir=str(policy_dir), tokenizer_hash=tokenizer_hash(policy_dir), seed=config.run.seed),
        retries=config.faults.verifier_retries)
    sampling = SamplingConfig(temperature=0.0, max_tokens=config.eval.max_tokens)
    requests = [RolloutRequest(prompt_id=r.id, prompt_tokens=tuple(tokenizer(r.text)["input_ids"]), group_size=1,
                               sampling=sampling, dataset_version=task.version) for r in records]
    try:
        trajectories = backend.generate(requests)
    finally:
        backend.close()
    calls = tool_calls(trajectories) if config.rollout.environment is not None else None
    if config.eval.grader is not None:
        return dataclasses.replace(_grade_apart(name, config, plugins, trajectories, records), tool_calls=calls)
    grader = correctness_grader(config, plugins)
    correct = []
    for traj, rec in zip(trajectories, records):
        result = grader.score(traj, rec.answer)
        correct.append(int(result.ok and result.total >= 1.0))
    return PolicyScores(name=name, correct=tuple(correct), responses=tuple(t.response_text for t in trajectories),
                        tool_calls=calls)


def tool_calls(trajectories: Sequence[Any]) -> tuple[int, ...]:
    """Per episode, the environment turns that answered a tool call (a call the policy wrote wrong included)."""
    from rlctl.contracts.types import Writer

    return tuple(sum(1 for t in traj.turns if t.writer is Writer.ENV) for traj in trajectories)


def _grade_apart(name: str, config: RunConfig, plugins: Plugins, trajectories: Sequence[Any],
                 records: Sequence[PromptRecord]) -> PolicyScores:
    """Grade with eval.grader in its own process (pass@1 is its), and with the training reward on the same answers."""
    from functools import partial

    from rlctl.engine.reward_pool import ProcessRewardPool
    from rlctl.placement.build import build_reward

    answers = [r.answer for r in records]
    with ProcessRewardPool(partial(eval_grader_from_config, config), 1, timeout_s=config.reward.timeout_s,
                           retries=config.reward.retries) as pool:
        graded, version = pool.score(trajectories, answers), pool.version
    reward = build_reward(config, plugins)
    trained = [reward.score(t, a) for t, a in zip(trajectories, answers)]
    n = max(1, len(records))
    score = sum(g.total for g in graded if g.ok) / n
    train_reward = sum(t.total for t in trained if t.ok) / max(1, sum(1 for t in trained if t.ok))
    apart = {"eval_grader": config.eval.grader.name if config.eval.grader else "", "eval_grader_version": version,
             "eval_score": score, "train_reward": train_reward, "gap": train_reward - score,
             "grader_errors": sum(1 for g in graded if not g.ok)}
    return PolicyScores(name=name, correct=tuple(int(g.ok and g.total >= 1.0) for g in graded),
                        responses=tuple(t.response_text for t in trajectories), apart=apart)


def eval_grader_from_config(config: RunConfig) -> Any:
    """The ``eval.grader`` reward function built from scratch (its worker process calls this)."""
    from rlctl.hooks.manager import load_plugins
    from rlctl.placement.build import reward_options

    plugins, spec = load_plugins(), config.eval.grader
    assert spec is not None, "eval.grader is not set"
    return plugins.build("reward_function", spec.name, reward_options(config, plugins, spec.name, spec.options),
                         "eval.grader.options")


@dataclass(frozen=True, slots=True)
class SampledScores:
    """n sampled answers per prompt: correct counts per prompt, and the first sample's response of each."""

    counts: tuple[int, ...]
    n: int
    temperature: float
    responses: tuple[str, ...]
    grade_seconds: float
    grader: dict[str, Any] | None = None  # with eval.grader: its name, version and errors (answers it failed on)


def sample_policy(policy_dir: Path, config: RunConfig, plugins: Plugins, task: TaskData,
                  records: Sequence[PromptRecord], n: int, temperature: float) -> SampledScores:
    """Sample ``n`` answers per prompt at ``temperature`` (top_p/top_k from rollout) and count correct ones:
    graded by ``eval.grader`` in its own processes (``reward.workers`` of them) when the config sets one, else
    by the run's correctness reward."""
    import time

    from transformers import AutoTokenizer

    from rlctl.models.tokenizer import tokenizer_hash

    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    backend = build_rollout(plugins, config.rollout, RolloutContext(
        model_dir=str(policy_dir), tokenizer_hash=tokenizer_hash(policy_dir), seed=config.run.seed),
        retries=config.faults.verifier_retries)
    sampling = SamplingConfig(temperature=temperature, top_p=config.rollout.top_p, top_k=config.rollout.top_k,
                              max_tokens=config.eval.max_tokens)
    requests = [RolloutRequest(prompt_id=r.id, prompt_tokens=tuple(tokenizer(r.text)["input_ids"]), group_size=n,
                               sampling=sampling, dataset_version=task.version) for r in records]
    try:
        trajectories = backend.generate(requests)
    finally:
        backend.close()
    started = time.perf_counter()
    answers = [rec.answer for rec in records for _ in range(n)]
    apart = None
    if config.eval.grader is not None:
        from functools import partial

        from rlctl.engine.reward_pool import ProcessRewardPool

        with ProcessRewardPool(partial(eval_grader_from_config, config), max(1, config.reward.workers),
                               timeout_s=config.reward.timeout_s, retries=config.reward.retries) as pool:
            results, version = pool.score(trajectories, answers), pool.version
        apart = {"name": config.eval.grader.name, "version": version,
                 "errors": sum(1 for r in results if not r.ok)}  # counted as wrong, and said, as greedy pass@1 does
        correct = [int(r.ok and r.total >= 1.0) for r in results]
        counts = [sum(correct[i * n:(i + 1) * n]) for i in range(len(records))]
        return SampledScores(counts=tuple(counts), n=n, temperature=temperature,
                             responses=tuple(trajectories[i * n].response_text for i in range(len(records))),
                             grade_seconds=time.perf_counter() - started, grader=apart)
    grader = correctness_grader(config, plugins)
    if config.reward.workers > 1:  # a sandboxed grader (code) waits on its jail: grade reward.workers at once
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(config.reward.workers) as pool:
            results = list(pool.map(grader.score, trajectories, answers))
    else:
        results = [grader.score(t, a) for t, a in zip(trajectories, answers)]
    correct = [int(r.ok and r.total >= 1.0) for r in results]
    counts = [sum(correct[i * n:(i + 1) * n]) for i in range(len(records))]
    return SampledScores(counts=tuple(counts), n=n, temperature=temperature,
                         responses=tuple(trajectories[i * n].response_text for i in range(len(records))),
                         grade_seconds=time.perf_counter() - started)


def correctness_grader(config: RunConfig, plugins: Plugins):
    comps = config.reward.components
    chosen = next((c for c in comps if c.name == "math"), comps[0])
    from rlctl.placement.build import reward_options

    return plugins.build("reward_function", chosen.name, reward_options(config, plugins, chosen.name, chosen.options),
                         "reward.components")


def paired_bootstrap(baseline: Sequence[int], candidate: Sequence[int], samples: int = 2000,
                     seed: int = 0) -> Comparison:
    """95% percentile CI of mean(candidate - baseline), resampling prompts with replacement."""
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError("paired bootstrap needs two equally long, non-empty score lists")
    n = len(baseline)
    diffs = [c - b for b, c in zip(baseline, candidate)]
    rng = random.Random(seed)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(samples))
    low = means[int(0.025 * samples)]
    high = means[min(samples - 1, int(0.975 * samples))]
    return Comparison(diff=sum(diffs) / n, ci_low=low, ci_high=high, num_prompts=n)


def pooled_bootstrap(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], samples: int = 2000,
                     seed: int = 0) -> Comparison:
    """95% CI of the mean paired difference over several RL seeds, by a hierarchical bootstrap.

    ``pairs`` holds one (baseline, candidate) score list pair per seed, all on
    the same prompts in the same order. Each resample draws the seeds with
    replacement, then the prompts with replacement, the same prompts for every
    drawn seed (a prompt's difficulty is shared by the seeds, so it stays
    paired), and takes the mean candidate - baseline over the drawn cells. The
    interval therefore covers both prompt sampling and seed-to-seed variation;
    with one seed it is the paired bootstrap over prompts.
    """
    import numpy as np

    if not pairs:
        raise ValueError("pooled bootstrap needs at least one seed")
    n = len(pairs[0][0])
    if n == 0 or any(len(b) != n or len(c) != n for b, c in pairs):
        raise ValueError("pooled bootstrap needs equally long, non-empty score lists for every seed")
    diffs = np.array([[c - b for b, c in zip(base, cand)] for base, cand in pairs], dtype=np.float64)  # [S, N]
    rng = np.random.default_rng(seed)
    s = len(pairs)
    means = np.empty(samples)
    for i in range(samples):
        rows = diffs[rng.integers(0, s, s)]
        means[i] = rows[:, rng.integers(0, n, n)].mean()
    means.sort()
    return Comparison(diff=float(diffs.mean()), ci_low=float(means[int(0.025 * samples)]),
                      ci_high=float(means[min(samples - 1, int(0.975 * samples))]), num_prompts=n)
