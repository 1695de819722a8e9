"""User-facing configuration: pydantic models with ``extra="forbid"``.

What this is: the schema of a run config (configs/*.yaml), its defaults (vetted
settings for the tiny CPU quickstart) and cross-field rules whose messages say
how to fix the problem. Plugin options (``options:`` blocks) are validated by
the plugin's own model when its name is resolved.

What this is not: loading files or applying overrides (rlctl.config.load).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class RunSection(_Strict):
    name: str = Field("run", description="Human-readable run name; not an identity.")
    seed: int = Field(0, description="Seed for data order, sampling and init.")


class WarmStartConfig(_Strict):
    """Short supervised stage that gives the built-in tiny model a starting policy."""

    enabled: bool = Field(True, description="Run SFT before RL when the model is built in.")
    steps: int = Field(600, ge=0, description="Supervised optimizer steps; with target_dev_accuracy, the cap.")
    batch_size: int = Field(64, ge=1, description="Sequences per SFT step.")
    lr: float = Field(3e-3, gt=0, description="Peak SFT learning rate (cosine decay over `steps`).")
    target_dev_accuracy: float | None = Field(
        None, gt=0, le=1, description="Stop as soon as greedy exact-answer accuracy on the first eval_prompts dev "
        "prompts reaches this (checked every eval_every steps), so every CPU starts RL from about the same "
        "policy; a warning says so when `steps` is reached first. null = run exactly `steps` steps.",
    )
    eval_every: int = Field(100, ge=1, description="Steps between dev checks of target_dev_accuracy.")
    eval_prompts: int = Field(300, ge=1, description="Dev prompts in each check of target_dev_accuracy.")
    seed: int | None = Field(
        None, description="Seed of the warm start's init and data order; null = run.seed. Runs with different "
        "run.seed and the same warm_start.seed share one cached warm start (rlctl train --seeds does this).",
    )


class ModelConfig(_Strict):
    path: str = Field(
        "builtin:tiny",
        description="'builtin:tiny' builds the embedded model; otherwise a local Hugging Face "
        "causal-LM directory (the tokenizer is loaded from the same directory).",
    )
    hidden_size: int = Field(128, ge=8, description="builtin:tiny only: width.")
    num_layers: int = Field(4, ge=1, description="builtin:tiny only: decoder layers.")
    num_heads: int = Field(4, ge=1, description="builtin:tiny only: attention heads.")
    num_kv_heads: int = Field(2, ge=1, description="builtin:tiny only: KV heads (GQA).")
    intermediate_size: int = Field(384, ge=8, description="builtin:tiny only: MLP width.")
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)

    @property
    def builtin(self) -> bool:
        return self.path.startswith("builtin:")

    @model_validator(mode="after")
    def _check_shape(self) -> "ModelConfig":
        if self.builtin and self.path != "builtin:tiny":
            raise ValueError(f"unknown built-in model {self.path!r}; use 'builtin:tiny' or a local directory")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                "model.hidden_size must be divisible by num_heads and num_heads by num_kv_heads "
                f"(got {self.hidden_size}/{self.num_heads}/{self.num_kv_heads})"
            )
        return self


class TaskConfig(_Strict):
    source: str = Field("arith", description="Registered task source name (see `rlctl plugins`).")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the source.")
    length_grouping: int = Field(
        0, ge=0, description="Length-aware batching: 0 = off; N > 1 sorts each window of N steps' train prompts "
        "by length so a step's prompts have similar lengths (less padding), in a seeded, resumable order.")


class EnvironmentConfig(_Strict):
    """The environment that turns every sample into a multi-turn episode (docs/environments.md)."""

    name: str = Field(description="Registered environment name (built in: tools).")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the environment.")


class RolloutConfig(_Strict):
    backend: str = Field("local", description="Registered rollout backend name.")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass; 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k truncation; 0 = off.")
    max_tokens: int = Field(12, ge=1, description="Max new tokens per response.")
    truncation_penalty: float | None = Field(
        0.0,
        description="Reward given to responses cut at max_tokens (replaces the graded reward); "
        "null keeps the graded reward.",
    )
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the backend.")
    environment: EnvironmentConfig | None = Field(
        None, description="Multi-turn episodes: the policy writes, the environment (e.g. a tool) answers, until "
        "done or a limit; max_tokens then bounds the whole episode. null = single-turn samples.")


class RewardComponentConfig(_Strict):
    name: str = Field(description="Registered reward function name.")
    weight: float = Field(1.0, description="Weight in the mixed total.")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the function.")


def _default_rewards() -> list[RewardComponentConfig]:
    return [
        RewardComponentConfig(name="math", weight=1.0),
        RewardComponentConfig(name="format", weight=0.1),
    ]


class RewardConfig(_Strict):
    components: list[RewardComponentConfig] = Field(
        default_factory=_default_rewards, min_length=1, description="Weighted reward components."
    )
    workers: int = Field(1, ge=1, le=256, description="Grader processes; 1 grades in the trainer process.")
    timeout_s: float = Field(60.0, gt=0, description="Per-sample deadline when workers > 1 (then error 'timeout').")
    retries: int = Field(1, ge=0, le=10, description="Extra attempts on infrastructure errors when workers > 1.")

    @model_validator(mode="after")
    def _unique(self) -> "RewardConfig":
        names = [c.name for c in self.components]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward component(s) listed twice: {', '.join(dup)}; list each once")
        return self


class KLConfig(_Strict):
    coef: float = Field(0.0, ge=0.0, description="beta; 0 disables the reference model.")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator: k1 (unbiased, noisy), k2 (x^2/2), k3 (unbiased, >= 0).")
    placement: Literal["loss", "reward"] = Field("loss", description="Add to the loss or subtract from the reward.")


class CriticConfig(_Strict):
    """The value model of estimators that need one (``algo.name: ppo``): its own learner role and optimizer."""

    init: str = Field("policy", description="'policy' starts the value model from the policy's weights; "
                      "otherwise a local Hugging Face causal-LM directory of the same tokenizer.")
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate of the critic.")
    gamma: float = Field(1.0, ge=0.0, le=1.0, description="GAE discount.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda.")
    value_clip: float | None = Field(0.2, gt=0, description="Clip of the value update around the old values; "
                                     "null = unclipped squared error.")
    warmup_steps: int = Field(0, ge=0, description="RL steps that train only the critic (the policy is frozen) "
                              "so its first advantages are not noise.")
    epochs: int = Field(1, ge=1, le=8, description="Critic passes over each batch.")


class AlgoConfig(_Strict):
    name: str = Field("grpo", description="Registered advantage estimator (grpo, dr_grpo, rloo, reinforce_pp, "
                      "gspo, dapo, ppo; see `rlctl plugins`).")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the estimator.")
    group_size: int = Field(8, ge=1, description="G: samples per prompt (>= 2 for estimators with a group "
                            "baseline; ppo and reinforce_pp accept 1).")
    prompts_per_step: int = Field(16, ge=1, description="B: prompts per step; batch = B x G.")
    normalize_std: bool = Field(True, description="grpo: divide group advantages by the group std.")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip epsilon (low side); gspo and dapo take theirs "
                            "from algo.options (clip_low, clip_high) and refuse any other value here.")
    clip_eps_high: float | None = Field(None, gt=0, description="Upper clip (clip-higher); default = clip_eps "
                                        "(gspo and dapo: algo.options.clip_high).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = Field(
        None, description="How per-token losses reduce to a scalar (sequence vs token); null = the estimator's "
        "default (token-mean; dr_grpo: seq-mean-token-sum-norm)."
    )
    tis_cap: float | None = Field(
        None, gt=0, description="Truncated importance sampling: weight each token's loss by "
        "min(pi_old / mu, cap) with the learner's pre-update log-probs pi_old and the sampler's mu (metrics "
        "tis_weight_mean, tis_truncated_frac); null = off (the PPO ratio is taken against mu directly)."
    )
    ppo_epochs: int = Field(1, ge=1, le=8, description="Passes over each batch.")
    num_mini_batches: int = Field(1, ge=1, description="Optimizer steps per epoch.")
    micro_batch_size: int = Field(64, ge=1, description="Sequences per forward/backward (grad accumulation).")
    kl: KLConfig = Field(default_factory=KLConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)

    @model_validator(mode="after")
    def _check(self) -> "AlgoConfig":
        batch = self.group_size * self.prompts_per_step
        if batch % self.num_mini_batches:
            raise ValueError(
                f"algo.num_mini_batches={self.num_mini_batches} does not divide the batch of "
                f"{batch} sequences (prompts_per_step x group_size); pick a divisor"
            )
        return self



class OptimConfig(_Strict):
    lr: float = Field(2e-4, gt=0, description="AdamW learning rate (sweep it on dev).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, gt=0, description="Max global grad norm.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warmup steps.")


class MetricSinkSpec(_Strict):
    """A metric sink with options, e.g. ``{name: mlflow, options: {experiment: arith}}``."""

    name: str = Field(description="Registered metric sink name.")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the sink.")


def sink_specs(entries: list[str | MetricSinkSpec]) -> list[tuple[str, dict[str, Any]]]:
    """``train.metric_sinks`` as (name, options) pairs; a bare name has no options."""
    return [(e, {}) if isinstance(e, str) else (e.name, e.options) for e in entries]


STOP_RULE_METRICS = {"dev_drop": "eval_dev_pass_at_1", "kl": "kl_ref", "entropy": "entropy",
                     "lag_p95": "staleness_p95", "reward_gap": "eval_reward_gap"}


class StopRule(_Strict):
    """One ``train.stop_rules`` entry (rlctl.lifecycle.stop_rules)."""

    rule: Literal["dev_drop", "kl", "entropy", "lag_p95", "reward_gap"] = Field(
        description="dev_drop: the dev score (eval_dev_pass_at_1) fell on `evals` consecutive dev evals; kl "
        "(kl_ref), entropy, lag_p95 (staleness_p95) and reward_gap (eval_reward_gap: training reward minus "
        "eval.grader score on the dev prompts): the metric left [min, max] for `window` consecutive records.")
    evals: int = Field(2, ge=1, description="dev_drop: consecutive dev evals that each fell below the one before.")
    min: float | None = Field(None, description="Lower bound (entropy; any bounded rule).")
    max: float | None = Field(None, description="Upper bound (kl, entropy, lag_p95, reward_gap).")
    window: int = Field(1, ge=1, description="Consecutive records (steps, or dev evals) out of bounds before it fires.")

    @model_validator(mode="after")
    def _bounded(self) -> "StopRule":
        if self.rule != "dev_drop" and self.min is None and self.max is None:
            need = "min and/or max" if self.rule == "entropy" else "max"
            raise ValueError(f"stop rule {self.rule!r} has no bound: it never fires; set {need}, e.g. "
                             f"{{rule: {self.rule}, {'min: 0.1' if self.rule == 'entropy' else 'max: 0.5'}}}")
        if self.min is not None and self.max is not None and self.min >= self.max:
            raise ValueError(f"stop rule {self.rule!r}: min {self.min:g} >= max {self.max:g}, so it always fires; "
                             "set min below max")
        return self


class TrainConfig(_Strict):
    steps: int = Field(60, ge=0, description="RL steps.")
    seeds: int = Field(
        1, ge=1, le=32, description="RL seeds run one after another from the same warm start (run.seed, run.seed+1, "
        "...), each its own run, reported together with a pooled CI; `rlctl train --seeds N` overrides it.",
    )
    max_generated_tokens: int | None = Field(
        None, ge=1, description="Stop after the step at which the run's generated response tokens (dropped DAPO "
        "groups included) reach N, even before train.steps; null = train.steps only. Equal-budget comparisons "
        "(rlctl ablate) use it."
    )
    max_wall_seconds: float | None = Field(
        None, gt=0, description="Stop after the step at which the training loop's wall-clock seconds (counted from "
        "its first step; metric rl_seconds_total) reach N, even before train.steps; null = train.steps only. "
        "Equal-time comparisons (rlctl ablate --budget wall-seconds|device-seconds) use it."
    )
    learner: str = Field("torch", description="Registered learner backend name.")
    learner_options: dict[str, Any] = Field(default_factory=dict, description="Validated by the learner.")
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="Packed learner micro-batches (the torch, fsdp2 and deepspeed learners' and the torch "
        "critic's): whole sequences (prompt + response) laid end to end, "
        "at most this many tokens (and at most algo.micro_batch_size sequences) per forward/backward, with no "
        "attention across sequences and no padding; a sequence longer than the budget gets a micro-batch of its "
        "own. Same loss, gradients and log-probs as the padded path. null = padded micro-batches of "
        "algo.micro_batch_size sequences.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d+)$", description="Where the learner's model, "
                        "optimizer state and batches live: auto (the first GPU when CUDA is usable, else CPU), cpu, "
                        "cuda or cuda:N. Asking for cuda where there is none is an error.")
    optim: OptimConfig = Field(default_factory=OptimConfig)
    log_every: int = Field(1, ge=1, description="Metric logging period in steps: sinks get every N-th step and the "
                           "last; with no terminal (output piped to a file) the live display prints one line per N steps.")
    metric_sinks: list[str | MetricSinkSpec] = Field(
        default_factory=lambda: ["jsonl"],
        description="Metric sinks besides the registry: a name (jsonl, tensorboard, mlflow, wandb) or "
        "{name, options} with options validated by that sink.",
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535, description="Serve the latest step metrics (those the registry gets) in the "
        "Prometheus text format at http://127.0.0.1:PORT/metrics while the run trains; 0 picks a free port "
        "(written to <run_dir>/metrics.url); null = off."
    )
    logprob_mismatch_bound: float | None = Field(
        None, gt=0, description="Stop the run with an error naming the step when the step's logprob_mismatch_max "
        "(max |behaviour logprob from the rollout engine - the learner's recomputation| over the step's tokens, "
        "before the update) exceeds this; null = off. In fp32 on CPU, vLLM and rlctl's engine stay below 1e-5."
    )
    stop_rules: list[StopRule] = Field(
        default_factory=list, description="End the run early, with status `stopped`, when a rule fires (a "
        "`stopped` event names the rule and step); with eval.every_steps the checkpoint at the best dev eval "
        "is kept. See docs/evaluation.md.")
    deterministic: bool = Field(
        False, description="Seed python/numpy/torch and use deterministic torch kernels: a CPU run is "
        "bit-reproducible, also across a checkpoint and resume."
    )


class CheckpointConfig(_Strict):
    """Immutable checkpoint directories under ``<run_dir>/checkpoints/`` (rlctl.engine.checkpoint)."""

    every_steps: int = Field(
        20, ge=0, description="Save after every N completed steps and after the last step; 0 = never save."
    )
    keep_last: int = Field(
        2, ge=1, description="Keep the newest K committed checkpoints (older ones are deleted only after "
        "a newer one is committed and verified)."
    )
    keep_best_metric: str | None = Field(
        None, description="Also keep the checkpoint with the best value of this metric (e.g. reward_mean); "
        "null = off."
    )
    keep_best_mode: Literal["max", "min"] = Field("max", description="Whether the best metric value is the max or the min.")
    async_save: bool = Field(
        True, description="Write checkpoints in a background thread (at most one in flight); the step "
        "blocks only while the state is copied."
    )
    shadow_tolerance: float = Field(
        1e-5, ge=0, description="Max |log-prob difference| allowed on the shadow batch when resuming."
    )


class FaultSpec(_Strict):
    """One injected fault (``rlctl inject --fault KIND`` writes the same thing); kinds are fault plugins."""

    kind: str = Field(description="Registered fault name: nan, oom, verifier-timeout, verifier-error, tool-timeout, "
                      "tool-error, bad-checkpoint, learner-crash, slow-rollout, slow-learner, worker-crash, "
                      "network-partition, weight-sync-failure (see `rlctl plugins`).")
    at_step: int = Field(0, ge=0, description="First step (0-based) at which the fault fires.")
    count: int = Field(1, ge=1, description="Steps in a row it fires for (e.g. K NaN steps).")
    rate: float = Field(1.0, gt=0, le=1, description="Fraction of samples (verifier faults) or of episode tool "
                        "calls (tool faults) hit.")
    target: str | None = Field(None, description="Role to hit (learner, rollout, verifier, checkpoint; tool faults: "
                               "the tool's name as the policy writes it); default: the kind's own role.")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the fault plugin.")


class FaultsConfig(_Strict):
    """Injected faults and the recovery policies that answer them."""

    inject: list[FaultSpec] = Field(default_factory=list, description="Faults to inject (none by default).")
    verifier_retries: int = Field(2, ge=0, description="Re-score a timed-out / errored sample with a fresh "
                                  "grader up to N times; past that its whole group is dropped and counted.")
    nan_rollback_after: int = Field(3, ge=1, description="After K NaN/Inf-skipped steps in a row, roll back to the "
                                    "last committed checkpoint.")
    rollback_lr_factor: float = Field(0.5, gt=0, lt=1, description="Learning-rate multiplier after a NaN rollback.")
    max_rollbacks: int = Field(2, ge=0, description="NaN rollbacks allowed per run before it stops.")
    watchdog_timeout_s: float = Field(0.0, ge=0, description="Report a role that makes no progress for this long "
                                      "(role, phase, stack dump) and stop the run; 0 = off.")
    max_restarts: int = Field(3, ge=0, description="`rlctl train --supervise`: restarts after a crash.")
    alerts: bool = Field(True, description="Evaluate the runbook triggers after every step (live alerts).")


# Config paths a resume may change without --allow-config-change: they do not
# change what the next step computes. A path covers everything below it.
RESUME_MUTABLE_PATHS = (
    "run.name", "train.steps", "train.log_every", "train.metric_sinks", "train.metrics_port", "train.stop_rules", "eval",
    "checkpoint.every_steps",
    "checkpoint.keep_last", "checkpoint.keep_best_metric", "checkpoint.keep_best_mode", "checkpoint.async_save",
    "faults",
    "cluster", "staleness.take_timeout_s",
    # sharded learners reshard their checkpoint onto any number of ranks (rlctl.engine.shards)
    "train.learner_options.world_size",
)


class ClusterConfig(_Strict):
    """Where the roles run: in this process (``local``) or as Ray actors (``ray``, needs the ``ray`` extra)."""

    backend: Literal["local", "ray"] = Field("local", description="local = threads in this process; ray = Ray actors.")
    address: str | None = Field(
        None, description="ray only: join this cluster (e.g. 'ray://host:10001' or 'host:6379'); null starts a "
        "local one sized by num_cpus."
    )
    num_cpus: int | None = Field(None, ge=1, description="ray only: CPUs of a locally started cluster; null = all.")
    num_rollout_workers: int = Field(
        2, ge=1, description="Rollout workers (each holds a policy copy; the G samples of a prompt stay on one)."
    )
    rollout_workers: Literal["auto", "threads", "processes"] = Field("auto", description="local, overlapped modes: "
        "workers as threads or child processes (a Python-bound engine holds the GIL against the learner); auto = "
        "processes for the local engine unless faults.inject is set, threads otherwise.")
    rollout_num_cpus: float = Field(0.5, gt=0, description="ray only: CPUs requested per rollout worker actor.")
    rollout_num_gpus: float = Field(0.0, ge=0, description="ray only: GPUs requested per rollout worker actor.")
    learner_num_cpus: float = Field(1.0, gt=0, description="ray only: CPUs requested by the learner actor (a sharded "
                                    "learner: by each of its world_size rank actors).")
    learner_num_gpus: float = Field(0.0, ge=0, description="ray only: GPUs requested by the learner actor (a sharded "
                                    "learner: by each rank actor; 1 gives each rank its own GPU).")
    reward_num_cpus: float = Field(0.0, ge=0, description="ray only: CPUs requested per reward actor "
                                   "(reward.workers > 1); 0 = scheduled beside the reserved bundles.")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="ray only: placement-group strategy for the learner and worker bundles."
    )
    max_restarts: int = Field(3, ge=0, description="Restarts allowed per rollout worker (and for the learner, or "
                              "each rank of a sharded learner, all of which restart together) before the run fails.")


class StalenessConfig(_Strict):
    """How far rollout may run ahead of the learner (modes one_step_off and async) and what happens beyond."""

    max_staleness: int = Field(
        1, ge=0, description="async: the bound on dv = learner version - sample's policy version; samples beyond "
        "it are dropped or reweighted (stale_policy), always counted."
    )
    stale_policy: Literal["drop", "reweight"] = Field(
        "drop", description="drop = discard groups beyond max_staleness; reweight = keep them with truncated "
        "importance weights (decoupled PPO)."
    )
    is_cap: float = Field(2.0, gt=0, description="reweight: truncation cap of the per-token importance weight.")
    queue_capacity: int | None = Field(
        None, ge=1, description="Groups buffered plus in flight before rollout pauses; null = (bound + 1) x B."
    )
    queue_ttl_s: float | None = Field(None, gt=0, description="Drop buffered groups older than this; null = no TTL.")
    rollout_chunk: int | None = Field(
        None, ge=1, description="Prompts per rollout-worker call; null = ceil(B / workers). Smaller = fresher weights."
    )
    take_timeout_s: float = Field(600.0, gt=0, description="Fail if the learner waits this long for one batch.")
    partial_fraction: float = Field(
        1.0, gt=0, le=1, description="Partial rollout: a step proceeds once this fraction of its B groups is "
        "ready; the unfinished groups carry over to a later step with their policy versions recorded (the "
        "max_staleness bound still applies and is counted). 1 = wait for the whole batch."
    )
    continuous_rollout: bool = Field(False, description="One continuous call per worker whose engine can: groups "
                                     "queued as they end, prompts into freed slots, weights loaded mid-call.")
    queue_segment_bytes: int = Field(64 << 20, ge=1, description="Size at which the trajectory log starts a new "
                                     "segment file; whole segments older than the oldest kept checkpoint are deleted "
                                     "after each checkpoint commits.")


class EvalConfig(_Strict):
    split: Literal["dev", "hidden"] = Field("hidden", description="Split for `rlctl eval`.")
    num_prompts: int = Field(0, ge=0, description="0 = the whole split.")
    max_tokens: int = Field(12, ge=1, description="Greedy decoding budget.")
    bootstrap_samples: int = Field(2000, ge=100, description="Paired bootstrap resamples.")
    at_end: bool = Field(True, description="Evaluate after `rlctl train` finishes.")
    every_steps: int = Field(0, ge=0, description="Greedy dev pass@1 every N steps during training, recorded as "
                             "metric eval_dev_pass_at_1 in every metric sink (0 = off; every mode; a failed eval "
                             "never stops training).")
    every_num_prompts: int = Field(64, ge=1, description="Dev prompts per periodic eval (the first N of dev).")
    grader: RewardComponentConfig | None = Field(
        None, description="The evaluation grader, kept apart from the training reward: {name, options} of a "
        "reward function, run in its own process by the periodic dev eval (its pass@1 and mean score; the gap "
        "to the training reward on the same answers is eval_reward_gap). null = the run's correctness reward.")


class RunConfig(_Strict):
    """The whole resolved config of a run. Its JSON is hashed into ``config_hash``."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync", description="sync = learner and rollout alternate; one_step_off = batch s+1 is generated while "
        "the learner trains on batch s; async = workers run ahead up to staleness.max_staleness versions."
    )
    staleness: StalenessConfig = Field(default_factory=StalenessConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="after")
    def _stop_rules_have_their_metric(self) -> "RunConfig":
        for i, r in enumerate(self.train.stop_rules):
            if r.rule in ("dev_drop", "reward_gap") and self.eval.every_steps == 0:
                raise ValueError(f"train.stop_rules.{i} ({r.rule}) reads the periodic dev eval, which is off "
                                 "(eval.every_steps=0); set eval.every_steps=N, or drop the rule")
            if r.rule == "kl" and self.algo.kl.coef == 0:
                raise ValueError(f"train.stop_rules.{i} (kl) bounds kl_ref, the KL to the reference model, which "
                                 "is not computed with algo.kl.coef=0; set algo.kl.coef>0, or drop the rule")
            if r.rule == "reward_gap" and self.eval.grader is None:
                raise ValueError(f"train.stop_rules.{i} (reward_gap) needs an evaluation grader kept apart from the "
                                 "training reward; set eval.grader={name: math}, or drop the rule")
        return self

    @model_validator(mode="after")
    def _partial_needs_overlap(self) -> "RunConfig":
        if self.staleness.partial_fraction < 1 and self.mode == "sync":
            raise ValueError("staleness.partial_fraction < 1 needs mode one_step_off or async: in mode=sync a "
                             "group carried over to the next step is always one version stale and would be dropped; "
                             "set mode=one_step_off (or async), or staleness.partial_fraction=1")
        return self

    @model_validator(mode="after")
    def _token_budget_fits_a_response(self) -> "RunConfig":
        budget = self.train.micro_batch_tokens
        if budget is not None and budget <= self.rollout.max_tokens:
            raise ValueError(f"train.micro_batch_tokens={budget} cannot hold one full-length sequence (a prompt "
                             f"plus rollout.max_tokens={self.rollout.max_tokens} response tokens), so most "
                             f"micro-batches would hold one sequence; set it well above rollout.max_tokens (e.g. "
                             f"{8 * (self.rollout.max_tokens + 32)}), or null for padded micro-batches")
        return self
