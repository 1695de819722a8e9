"""Every hook rlctl calls on plugins, grouped by phase.

What this is: pluggy hook specifications. Component hooks use a register
callback: the plugin calls ``register(name, factory, options=Model)`` once per
component. Observer hooks run on the driver only and receive frozen records.

What this is not: the plugin manager (rlctl.hooks.manager) or any plugin.

Specs only grow: adding an argument is fine (pluggy lets implementations take
a subset); renaming or removing one is a breaking change.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import pluggy

hookspec = pluggy.HookspecMarker("rlctl")
hookimpl = pluggy.HookimplMarker("rlctl")

Register = Callable[..., None]


# -- components (called once, when the plugin manager is built) -------------


@hookspec
def register_task_sources(register: Register) -> None:
    """Register task sources: ``register(name, factory, options=Model|None)``.

    ``factory(options, seed)`` returns a TaskSource. Called once at startup.
    """


@hookspec
def register_rollout_backends(register: Register) -> None:
    """Register rollout backends: ``register(name, factory, options=Model|None)``.

    ``factory(ctx: RolloutContext)`` returns a RolloutBackend; ``ctx`` carries
    the model directory, tokenizer, seed and validated options.
    """


@hookspec
def register_learner_backends(register: Register) -> None:
    """Register learner backends: ``register(name, factory, options=Model|None)``.

    ``factory(ctx: LearnerContext)`` returns a LearnerBackend.
    """


@hookspec
def register_critic_backends(register: Register) -> None:
    """Register critic backends: ``register(name, factory, options=Model|None)``.

    ``factory(ctx: CriticContext)`` returns a CriticBackend (the value model of
    estimators that need one, e.g. ``ppo``). The backend with the same name as
    ``train.learner`` is used.
    """


@hookspec
def register_reward_functions(register: Register) -> None:
    """Register reward functions: ``register(name, factory, options=Model|None)``.

    ``factory(options)`` returns a RewardFunction.
    """


@hookspec
def register_advantage_estimators(register: Register) -> None:
    """Register advantage estimators: ``register(name, factory, options=Model|None)``.

    ``factory(options, algo)`` returns an AdvantageEstimator; ``algo`` is the
    run's resolved ``algo`` config section. The estimator named by
    ``algo.name`` computes every step's advantages and picks the policy loss.
    """


@hookspec
def register_environments(register: Register) -> None:
    """Register environments for multi-turn episodes: ``register(name, factory, options=Model|None)``.

    ``factory(ctx: EnvironmentContext)`` returns an Environment
    (rlctl.contracts.roles): ``start(row)`` begins one episode and its
    ``step(policy_tokens)`` answers each policy turn with observation tokens,
    ``done``, reward parts and info. The environment a run's config names drives
    every episode of that run; none configured means single-turn samples.
    """


@hookspec
def register_tools(register: Register) -> None:
    """Register tools an environment may call: ``register(name, factory, options=Model|None)``.

    ``factory(options)`` returns a Tool: ``call(arguments, timeout_s) -> text``
    that raises ``ToolError`` (or ``TimeoutError``) when it fails; a failure is
    flagged on the episode, never turned into an answer or a zero reward.
    """


@hookspec
def register_metric_sinks(register: Register) -> None:
    """Register metric sinks: ``register(name, factory, options=Model|None)``.

    ``factory(options, run_dir, run_id)`` returns a MetricSink. The run's
    provenance (config hash, seed, dataset version) is in ``<run_dir>/run.json``
    when the factory is called.
    """


@hookspec
def register_faults(register: Register) -> None:
    """Register fault kinds for ``rlctl inject`` / ``faults.inject``: ``register(name, factory, options=Model|None)``.

    ``factory(options)`` returns a Fault: an object with ``arm(ctx: FaultContext)
    -> disarm`` that arms handlers at the real failure sites
    (``rlctl.engine.faults.arm``) and returns a function that disarms them.
    Called once at startup; ``arm`` is called when a run with that fault starts.
    """


@hookspec
def register_weight_transports(register: Register) -> None:
    """Register weight transports: ``register(name, factory, options=Model|None)``.

    ``factory(options, directory, extra_files)`` returns a WeightTransport:
    ``directory`` is where the publisher may keep what it sends (a backend's
    ``publish_dir``), ``extra_files`` the model files every version carries
    (config.json, ...). A rollout backend that publishes weights to engines in
    other processes builds its transport by name (``rlctl.kit.weight_transport``),
    so a new transport (an object store, a shared-memory ring) is a plugin.
    """


@hookspec
def register_commands(app: Any) -> None:
    """Add CLI commands to the root ``typer.Typer`` (use ``app.command`` / ``app.add_typer``)."""


# -- observers (driver only, must not mutate what they receive) -------------


@hookspec
def on_run_start(run_id: str, config: Mapping[str, Any]) -> None:
    """A run row exists and the loop is about to start."""


@hookspec
def on_step_end(run_id: str, step: int, metrics: Mapping[str, float]) -> None:
    """One RL step finished; ``metrics`` are the step's logged values."""


@hookspec
def on_checkpoint_saved(run_id: str, step: int, path: str, manifest: Any) -> None:
    """A checkpoint of ``step`` completed steps is committed at ``path`` and indexed in the registry.

    ``manifest`` is its frozen CheckpointManifest (files and sha256s). Called
    from the background thread that wrote the checkpoint (driver process only);
    an exception is reported as a warning and never fails the run.
    """


@hookspec
def on_run_end(run_id: str, status: str) -> None:
    """The run finished with ``status`` (succeeded / stopped / failed / interrupted)."""
