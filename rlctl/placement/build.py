"""Config names become role objects: task, policy, reward, estimator, critic, and the contexts of the rest.

What this is: the one place config names become objects (through the plugin
registry, with each plugin's options validated), and ``build_common``, what
every placement builds the same way in the driver's process before it places
the rollout engines and the learner where they live (rlctl.placement.local,
rlctl.placement.ray_placement). It fails before any training starts if a name,
an option, the data or the model is bad, or a loop option cannot work in the
run's mode (rlctl.engine.spec.check_loop_options).

What this is not: the loop (rlctl.engine.loop) or run bookkeeping (rlctl.lifecycle).
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
from rlctl.engine.roles import Roles
from rlctl.engine.spec import check_loop_options
from rlctl.hooks.manager import Plugins


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
    check_loop_options(config, estimator)
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
                                           deterministic=config.train.deterministic,
                                           micro_batch_tokens=config.train.micro_batch_tokens))


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


def learner_context(config: RunConfig, estimator: AdvantageEstimator, policy_dir: Path,
                    rank_launcher: Any = None) -> LearnerContext:
    """What the learner is built with; ``rank_launcher`` (the placement's) starts a sharded learner's ranks."""
    return LearnerContext(model_dir=str(policy_dir), algo=config.algo, optim=config.train.optim, seed=config.run.seed,
                          max_response_tokens=config.rollout.max_tokens, deterministic=config.train.deterministic,
                          device=config.train.device, policy_loss=policy_loss(config, estimator),
                          rank_launcher=rank_launcher, micro_batch_tokens=config.train.micro_batch_tokens)


def check_environment(config: RunConfig, plugins: Plugins) -> None:
    """Fail before any model work on an unknown environment or tool name or bad options: the environment and
    its tools are built once, without a tokenizer (``EnvironmentContext.tokenizer`` None)."""
    from rlctl.engine.episodes import build_environment

    if config.rollout.environment is not None:
        build_environment(plugins, config.rollout.environment, tokenizer=None, seed=config.run.seed)


@dataclass(frozen=True, slots=True, kw_only=True)
class Common:
    """What every placement builds the same way, in the driver's process, before it places rollout and learner."""

    config: RunConfig
    task: TaskData
    policy_dir: Path
    tokenizer: Any
    tokenizer_hash: str
    reward: MixedReward
    estimator: AdvantageEstimator

    def rollout_context(self, index: int = 0) -> RolloutContext:
        """Rollout worker ``index``'s context: its own seed (run.seed + 1000 * index)."""
        return RolloutContext(model_dir=str(self.policy_dir), tokenizer_hash=self.tokenizer_hash,
                              seed=self.config.run.seed + 1000 * index, deterministic=self.config.train.deterministic)

    def build_rollout(self, plugins: Plugins, index: int = 0) -> RolloutBackend:
        """A rollout backend in this process (worker ``index``)."""
        from rlctl.engine.episodes import build_rollout

        return build_rollout(plugins, self.config.rollout, self.rollout_context(index),
                             retries=self.config.faults.verifier_retries)

    def roles(self, plugins: Plugins, *, rollout: RolloutBackend, learner: LearnerBackend,
              critic: CriticBackend | None, reward_pool: Any) -> Roles:
        config = self.config
        return Roles(config=config, task=self.task, policy_dir=self.policy_dir, tokenizer=self.tokenizer,
                     tokenizer_hash=self.tokenizer_hash, rollout=rollout, learner=learner, reward=self.reward,
                     estimator=self.estimator, critic=critic, sampling=sampling_config(config),
                     cursor=PromptCursor(self.task.train, seed=config.run.seed,
                                         batch_size=config.algo.prompts_per_step,
                                         length_window=config.task.length_grouping),
                     reward_factory=lambda: build_reward(config, plugins), reward_pool=reward_pool)


def build_common(config: RunConfig, plugins: Plugins, cache_root: Path,
                 progress: Callable[[int, int, float], None] | None = None, task: TaskData | None = None) -> Common:
    """Seed the process, then build the cheap roles first (a bad name fails before any model work), the task,
    the starting policy (warm-started when built in) and its tokenizer; ``task`` skips loading the task."""
    from transformers import AutoTokenizer

    from rlctl.models.tokenizer import tokenizer_hash

    from rlctl.config.load import validate_options

    seed_everything(config.run.seed, config.train.deterministic)
    reward = build_reward(config, plugins)
    estimator = build_estimator(config, plugins)
    if estimator.needs_critic and config.train.learner not in plugins.names("critic_backend"):
        raise ConfigError(f"algo.name={config.algo.name} needs a critic, and train.learner={config.train.learner} "
                          "has no critic backend (built in: torch)",
                          f"use train.learner=torch with algo.name={config.algo.name}, or an estimator without a "
                          "critic (e.g. algo.name=grpo)")
    # the rollout backend is built after the starting policy (its context needs it); its options are checked now
    validate_options(plugins.get("rollout_backend", config.rollout.backend).options, config.rollout.options,
                     "rollout.options")
    check_environment(config, plugins)
    task = task or load_task(config, plugins, reward)
    policy_dir = resolve_policy_dir(config, task, cache_root, progress)
    tok_hash = tokenizer_hash(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    return Common(config=config, task=task, policy_dir=policy_dir, tokenizer=tokenizer, tokenizer_hash=tok_hash,
                  reward=reward, estimator=estimator)
