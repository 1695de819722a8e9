"""Build the roles of a run from its resolved config: task, policy, rollout, learner, reward.

What this is: the one place config names become objects (through the plugin
registry, with each plugin's options validated). It fails before any training
starts if a name, an option, the data or the model is bad.

What this is not: the loop (rlctl.engine.loop) or run bookkeeping (rlctl.ops).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError, DataError
from rlctl.contracts.roles import AdvantageEstimator, CriticBackend, LearnerBackend, RolloutBackend
from rlctl.contracts.types import (
    CriticContext,
    LearnerContext,
    PolicyLoss,
    RolloutContext,
    SamplingConfig,
    TaskData,
)
from rlctl.engine.batching import PromptCursor
from rlctl.engine.reward_mix import MixedReward
from rlctl.hooks.manager import Plugins


@dataclass
class Session:
    config: RunConfig
    task: TaskData
    policy_dir: Path
    tokenizer: Any
    tokenizer_hash: str
    rollout: RolloutBackend
    learner: LearnerBackend
    reward: MixedReward
    cursor: PromptCursor
    sampling: SamplingConfig
    estimator: AdvantageEstimator
    critic: CriticBackend | None = None  # the value model, when the estimator needs one
    reward_factory: Callable[[], MixedReward] | None = None  # a fresh grader, for retries after a timeout/crash
    reward_pool: Any = None  # a RewardPool when reward.workers > 1; the loop then grades through it
    queue: Any = None  # the live TrajectoryQueue of an overlapped run (rlctl.engine.async_loop); None when sync
    queue_cursor: Mapping[str, Any] | None = None  # a restored checkpoint's queue cursor, applied when the queue opens
    learner_ctx: LearnerContext | None = None  # what the learner was built with (a Ray learner actor is built alike)


def load_task(config: RunConfig, plugins: Plugins, reward: MixedReward | None = None) -> TaskData:
    """Load and check the task; its version also names the grader, since the same data graded
    differently is a different dataset for a run (a resume across a grader change is refused)."""
    import dataclasses
    import hashlib

    options = dict(config.task.options)
    model = plugins.get("task_source", config.task.source).options
    # Sources that render chat prompts (an option named ``tokenizer``) use the policy's tokenizer
    # unless told otherwise; the built-in model's is the character tokenizer, their own default.
    if (model is not None and "tokenizer" in model.model_fields and options.get("tokenizer") is None
            and not config.model.builtin):
        options["tokenizer"] = config.model.path
    source = plugins.build("task_source", config.task.source, options, "task.options", seed=config.run.seed)
    task = source.load()
    for split in ("train", "dev", "hidden"):
        if not task.split(split):
            raise DataError(f"task {task.name!r} has an empty {split} split", "every split needs prompts")
    grader = (reward or build_reward(config, plugins)).version
    version = hashlib.sha256(f"{task.version}\x1f{grader}".encode()).hexdigest()[:16]
    return dataclasses.replace(task, version=version)


def build_reward(config: RunConfig, plugins: Plugins) -> MixedReward:
    parts = []
    for i, comp in enumerate(config.reward.components):
        fn = plugins.build("reward_function", comp.name, reward_options(config, plugins, comp.name, comp.options),
                           f"reward.components.{i}.options")
        parts.append((comp.name, comp.weight, fn))
    return MixedReward(parts)


def reward_options(config: RunConfig, plugins: Plugins, name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A reward's options; one with a ``policy_tokenizer`` option (it decodes prompt tokens) gets the policy's
    tokenizer unless told otherwise (the built-in model's is the character tokenizer, its own default)."""
    out = dict(options)
    model = plugins.get("reward_function", name).options
    if (model is not None and "policy_tokenizer" in model.model_fields and out.get("policy_tokenizer") is None
            and not config.model.builtin):
        out["policy_tokenizer"] = config.model.path
    return out


def reward_from_config(config: RunConfig) -> MixedReward:
    """The run's mixed reward built from scratch (a reward worker process calls this)."""
    from rlctl.hooks.manager import load_plugins

    return build_reward(config, load_plugins())


def build_reward_pool(config: RunConfig) -> Any:
    """A process pool of ``reward.workers`` graders, or None for in-process grading."""
    if config.reward.workers <= 1:
        return None
    from functools import partial

    from rlctl.engine.reward_pool import ProcessRewardPool

    r = config.reward
    return ProcessRewardPool(partial(reward_from_config, config), r.workers, timeout_s=r.timeout_s, retries=r.retries)


def resolve_policy_dir(config: RunConfig, task: TaskData, cache_root: Path,
                       progress: Callable[[int, int, float], None] | None = None) -> Path:
    """The starting policy: the warm-started built-in model, or the user's checked directory."""
    from rlctl.models.load import check_model_dir
    from rlctl.models.warm_start import builtin_policy_dir

    if config.model.builtin:
        return builtin_policy_dir(config.model, task, config.run.seed, cache_root, progress)
    return check_model_dir(config.model.path)


def build_estimator(config: RunConfig, plugins: Plugins) -> AdvantageEstimator:
    """The advantage estimator named by ``algo.name``, its ``algo.options`` validated by its plugin."""
    estimator = plugins.build("advantage_estimator", config.algo.name, config.algo.options, "algo.options",
                              algo=config.algo)
    if config.algo.group_size < estimator.min_group_size:
        raise ConfigError(f"algo.group_size must be >= {estimator.min_group_size} for {config.algo.name}'s group "
                          f"baseline (got {config.algo.group_size})", "set algo.group_size=8")
    return estimator


def policy_loss(config: RunConfig, estimator: AdvantageEstimator) -> PolicyLoss:
    """The learner's loss: the estimator's kind and defaults, the config's explicit choices on top."""
    a = config.algo
    low, high = estimator.clip or (a.clip_eps, a.clip_eps_high or a.clip_eps)
    return PolicyLoss(kind=estimator.policy_loss, clip_low=low, clip_high=high, agg=a.loss_agg or estimator.loss_agg,
                      tis_cap=a.tis_cap)


def build_critic(config: RunConfig, plugins: Plugins, policy_dir: Path) -> CriticBackend:
    """The value model: the ``train.learner`` backend's critic, started from the policy or ``algo.critic.init``."""
    from rlctl.models.load import check_model_dir

    init = config.algo.critic.init
    model_dir = policy_dir if init == "policy" else check_model_dir(init)
    return plugins.build("critic_backend", config.train.learner, {}, "algo.critic",
                         ctx=CriticContext(model_dir=str(model_dir), critic=config.algo.critic,
                                           optim=config.train.optim, seed=config.run.seed,
                                           micro_batch_size=config.algo.micro_batch_size,
                                           deterministic=config.train.deterministic))


def sampling_config(config: RunConfig) -> SamplingConfig:
    r = config.rollout
    return SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens)


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed python, numpy and torch; with ``deterministic``, also force deterministic torch kernels.

    Deterministic mode (``train.deterministic``) makes a CPU run bit-reproducible:
    same config and seed, same parameters after every step, also across a
    checkpoint and resume. On CUDA it also needs a fixed cuBLAS workspace.
    """
    import os
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # required by deterministic cuBLAS
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def learner_context(config: RunConfig, estimator: AdvantageEstimator, policy_dir: Path) -> LearnerContext:
    """What the learner is built with; under ``cluster.backend=ray`` a sharded learner's ranks become Ray actors."""
    launcher = None
    if config.cluster.backend == "ray":
        from functools import partial

        from rlctl.dist.ray_ranks import RayRanks  # imports ray; starts nothing until a sharded learner calls it

        launcher = partial(RayRanks, config.cluster)
    return LearnerContext(model_dir=str(policy_dir), algo=config.algo, optim=config.train.optim, seed=config.run.seed,
                          max_response_tokens=config.rollout.max_tokens, deterministic=config.train.deterministic,
                          device=config.train.device, policy_loss=policy_loss(config, estimator),
                          rank_launcher=launcher)


def build_session(config: RunConfig, plugins: Plugins, cache_root: Path,
                  progress: Callable[[int, int, float], None] | None = None, task: TaskData | None = None) -> Session:
    """Build every role of a run; ``task`` skips loading the task when the caller already has it."""
    from transformers import AutoTokenizer

    from rlctl.models.tokenizer import tokenizer_hash

    seed_everything(config.run.seed, config.train.deterministic)
    reward = build_reward(config, plugins)  # cheap checks first: fail before any model work
    estimator = build_estimator(config, plugins)
    task = task or load_task(config, plugins, reward)
    policy_dir = resolve_policy_dir(config, task, cache_root, progress)
    tok_hash = tokenizer_hash(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    rollout = plugins.build("rollout_backend", config.rollout.backend, config.rollout.options, "rollout.options",
                            ctx=RolloutContext(model_dir=str(policy_dir), tokenizer_hash=tok_hash, seed=config.run.seed))
    lctx = learner_context(config, estimator, policy_dir)
    learner = plugins.build("learner_backend", config.train.learner, config.train.learner_options,
                            "train.learner_options", ctx=lctx)
    return Session(config=config, task=task, policy_dir=policy_dir, tokenizer=tokenizer, tokenizer_hash=tok_hash,
                   rollout=rollout, learner=learner, reward=reward,
                   cursor=PromptCursor(task.train, seed=config.run.seed, batch_size=config.algo.prompts_per_step,
                                       length_window=config.task.length_grouping),
                   sampling=sampling_config(config), estimator=estimator, learner_ctx=lctx,
                   critic=build_critic(config, plugins, policy_dir) if estimator.needs_critic else None,
                   reward_factory=lambda: build_reward(config, plugins),
                   reward_pool=build_reward_pool(config))
