"""What runs inside Ray actor processes: the rollout, learner and reward actors, and their fault arming.

What this is: ``RolloutActor``, ``LearnerActor`` and ``RewardActor``, each
building its role from the plugin registry inside its own process (a role is
built where it lives: never on the driver to be copied over), the
``BrokerClaims`` through which an actor arms the run's injected faults from
the fault broker (rlctl.placement.ray_faults), and ``StoredWeights`` (an
exported weight version left in the object store).

A restarted actor comes back with its initial state: Ray re-runs its
constructor, and an actor killed while idle is restarted without any call
failing, so the next call would run on the new process. A restarted actor
therefore refuses work (``ActorReset``) until the driver restores it: the
rollout actor until it loads the current weights, the learner actor until it
loads a checkpoint or is told to serve from its initial state.

What this is not: the driver-side handles and the placement group
(rlctl.placement.ray_placement), the cluster plumbing (rlctl.placement.ray_cluster) or
the broker actor (rlctl.placement.ray_faults).
This is one of the modules of rlctl that import ray (all named ``ray_*``).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping, Sequence

import ray

from rlctl.contracts.errors import RoleError
from rlctl.contracts.roles import (
    CapturingLearner, CheckpointableLearner, LrScalable, RestartableLearner,
)
from rlctl.contracts.types import LearnerContext, RewardResult, RolloutContext, RolloutRequest, Trajectory, WeightUpdate
from rlctl.engine.faults import ArmedFault, arm_plan, forward_recoveries



def set_threads(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)


_plugins: Any = None  # this actor process's plugin registry, loaded once for arming faults


def arm_faults(faults: "BrokerClaims | None", plugins: Any = None) -> Callable[[], None]:
    """Arm the run's faults in this actor's process: the broker's plan as it is now (``faults`` is the
    placement's BrokerClaims; None: no faults), and send its recovery reports (``report_recovery``) to the
    driver through the same broker; return the disarm."""
    global _plugins
    if faults is None:
        return lambda: None
    plan = faults.plan()
    forward_recoveries(faults.recovered)
    if not plan:
        return lambda: forward_recoveries(None)
    if plugins is None:
        if _plugins is None:
            from rlctl.hooks.manager import load_plugins

            _plugins = load_plugins()
        plugins = _plugins
    disarm = arm_plan(plan, faults, lambda f: plugins.build("fault", f.kind, f.options, f.where))

    def undo() -> None:
        disarm()
        forward_recoveries(None)

    return undo


class BrokerClaims:
    """SharedClaims through the named FaultBroker (actors get this in their constructor).

    It pickles as the broker's name, not its handle: an actor handle among the
    constructor arguments puts them in the object store, where a restart
    cannot rely on finding them (ray-project/ray#53727).
    """

    def __init__(self, name: str, broker: Any = None) -> None:
        self.name, self._broker = name, broker

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.name, self._broker = state["name"], None

    @property
    def broker(self) -> Any:
        if self._broker is None:
            self._broker = ray.get_actor(self.name)
        return self._broker

    def plan(self) -> list[ArmedFault]:
        return ray.get(self.broker.plan.remote())

    def step(self) -> int:
        return ray.get(self.broker.step.remote())

    def fired(self, index: int, step: int) -> bool:
        return ray.get(self.broker.fired.remote(index, step))

    def claim(self, index: int, step: int) -> bool:
        return ray.get(self.broker.claim.remote(index, step))

    def mark(self, index: int, step: int, event: tuple[str, dict[str, Any]] | None) -> None:
        ray.get(self.broker.mark.remote(index, step, event))

    def recovered(self, kind: str, message: str, data: dict[str, Any]) -> None:
        ray.get(self.broker.recovered.remote(kind, message, data))


# The learner verbs a LearnerActor serves by name (LearnerBackend, CheckpointableLearner, LrScalable).
LEARNER_CALLS = frozenset({"logprobs", "ref_logprobs", "train_step", "save_pretrained", "checkpoint_state",
                           "load_checkpoint_state", "scale_lr"})


class ActorReset(Exception):
    """A restarted actor was called before the driver restored its state (it holds its initial state)."""


def reconstructed() -> bool:
    """Whether this actor process is a restart (Ray re-ran the constructor after the previous one died)."""
    return ray.get_runtime_context().was_current_actor_reconstructed


@ray.remote
class RolloutActor:
    """Hosts one rollout backend built from the plugin registry inside the actor's process."""

    def __init__(self, rollout: Any, ctx: RolloutContext, threads: int, faults: Any = None,
                 retries: int = 0) -> None:
        set_threads(threads)
        from rlctl.engine.episodes import build_rollout
        from rlctl.hooks.manager import load_plugins

        self.plugins = load_plugins()
        self._disarm = arm_faults(faults, self.plugins)  # the broker's plan now: a restart gets live-armed faults
        # ``rollout`` is the run's rollout config section: its backend, wrapped in the episode driver when it
        # names an environment (retries: the verifier policy's, for failed tool calls)
        self.backend = build_rollout(self.plugins, rollout, ctx, retries=retries)
        self.reset = reconstructed()  # refuses to generate until the driver loads the current weights

    def arm(self, faults: Any) -> None:
        """Arm the broker's plan again (a fault was armed while the run trains); None disarms every fault."""
        self._disarm()
        self._disarm = arm_faults(faults, self.plugins)

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        if self.reset:  # killed while idle: Ray restarted it silently and queued this call for the new process
            raise ActorReset("the rollout actor was restarted and holds its initial weights")
        return self.backend.generate(requests)

    def update_weights(self, update: WeightUpdate) -> int:
        self.backend.update_weights(update)
        self.reset = False
        return update.version

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class LearnerActor:
    """Hosts the learner backend, built in this actor's process; the driver's RayLearner calls it.

    Only the members the learner Protocols declare can be called
    (``LEARNER_CALLS``): core never reaches past them, here either.
    """

    def __init__(self, learner: str, options: Mapping[str, Any], ctx: LearnerContext, threads: int,
                 faults: Any = None) -> None:
        set_threads(threads)
        from rlctl.hooks.manager import load_plugins

        self.plugins = load_plugins()
        self._disarm = arm_faults(faults, self.plugins)  # the broker's plan now: a restart gets live-armed faults
        self.learner = self.plugins.build("learner_backend", learner, options, "train.learner_options", ctx=ctx)
        # A restart (Ray re-runs this constructor) serves nothing until the driver restores it: a learner
        # killed between calls would otherwise answer the next call silently from its initial state.
        self.reset = reconstructed()

    def call(self, method: str, *args: Any) -> Any:
        """Run one of the learner's Protocol verbs (``load_checkpoint_state`` also ends a restart's refusal)."""
        if method not in LEARNER_CALLS:
            raise RoleError(f"the learner actor was asked for {method!r}, which no learner Protocol declares",
                            "declare it on a Protocol in rlctl.contracts.roles before core calls it")
        if method == "load_checkpoint_state":
            if not isinstance(self.learner, CheckpointableLearner):
                raise RoleError("the learner cannot load a checkpoint", "use a CheckpointableLearner")
            self.learner.load_checkpoint_state(*args)
            self.reset = False
            return None
        self._check()
        if method == "scale_lr" and not isinstance(self.learner, LrScalable):
            raise RoleError("the learner cannot lower its learning rate mid-run", "use an LrScalable learner")
        return getattr(self.learner, method)(*args)

    def policy_version(self) -> int:
        self._check()
        return self.learner.policy_version

    def _check(self) -> None:
        if self.reset:
            raise ActorReset("the learner actor was restarted and holds its initial state")

    def train_step_with_logprobs(self, batch: Any) -> tuple[Mapping[str, float], Any]:
        """The update and log pi before it, [N, T], from one call (one batch transfer): CapturingLearner."""
        self._check()
        if isinstance(self.learner, CapturingLearner):
            return self.learner.train_step_with_logprobs(batch)
        before = self.learner.logprobs(batch)  # a learner without it: the separate pass, still in this process
        return self.learner.train_step(batch), before

    @ray.method(num_returns=2)
    def export_weights(self) -> tuple[tuple[int, str], WeightUpdate]:
        """(version, fingerprint) for the driver, and the update itself, which stays in the object store."""
        self._check()
        update = self.learner.export_weights()
        return (update.version, update.fingerprint), update

    def accept_initial_state(self) -> None:
        """The driver restores a restarted learner to the run's start (no checkpoint yet): its initial state."""
        if isinstance(self.learner, RestartableLearner):
            self.learner.accept_initial_state()
        self.reset = False

    def arm(self, faults: Any) -> None:
        """Arm the broker's plan again (a fault was armed while the run trains); None disarms every fault."""
        self._disarm()
        self._disarm = arm_faults(faults, self.plugins)

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class RewardActor:
    """Builds one grader from a picklable factory and scores one sample per call."""

    def __init__(self, factory: Callable[[], Any], faults: Any = None) -> None:
        set_threads(1)
        self._disarm = arm_faults(faults)  # the broker's plan now: a restart gets live-armed faults
        self.reward = factory()

    def arm(self, faults: Any) -> None:
        """Arm the broker's plan again (a fault was armed while the run trains); None disarms every fault."""
        self._disarm()
        self._disarm = arm_faults(faults)

    def version(self) -> str:
        return self.reward.version

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        try:
            return self.reward.score(trajectory, reference)
        except Exception as err:  # reported as an error code, never a zero
            return RewardResult(total=0.0, components={}, grader_version=self.reward.version,
                                error_code=f"grader_error:{type(err).__name__}",
                                latency_s=time.perf_counter() - started, log=str(err)[:500])

    def pid(self) -> int:
        return os.getpid()


class StoredWeights(Mapping[str, Any]):
    """The state dict of a WeightUpdate that lives in Ray's object store, not in the driver.

    The learner actor writes each exported version there once (the ref is a
    task return, so the driver owns it and it outlives a learner restart);
    rollout actors read it from the store. Reading it on the driver fetches
    it (nothing in the overlapped loop does).
    """

    def __init__(self, ref: Any) -> None:
        self.ref = ref
        self._fetched: Mapping[str, Any] | None = None

    def _state(self) -> Mapping[str, Any]:
        if self._fetched is None:
            self._fetched = ray.get(self.ref).state_dict
        return self._fetched

    def __getitem__(self, key: str) -> Any:
        return self._state()[key]

    def __iter__(self) -> Any:
        return iter(self._state())

    def __len__(self) -> int:
        return len(self._state())

