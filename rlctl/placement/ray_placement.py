"""Ray placement: the learner, the rollout workers and the graders as Ray actors, each built where it lives.

What this is: ``RayPlacement`` (joins ``cluster.address`` or starts a local
cluster, reserves one bundle per actor with the configured CPUs/GPUs, starts
the actors with ``max_restarts``) and the driver-side handles the loops see:
``RayLearner`` (the learner, LearnerActor), ``RayWorker`` (one rollout
worker, RolloutActor) in a RolloutFleet, ``RayRewardPool`` (``reward.workers``
> 1 graders as RewardActors). A handle turns a dead actor into WorkerLost /
LearnerLost for the overlapped driver. The learner is built in its actor and
nowhere else; a sharded learner (its options are ShardedLearnerOptions) is a
RankGroup on the driver whose ranks are Ray actors started through the
``rank_launcher`` this placement gives its context (rlctl.placement.ray_ranks),
so the driver holds no shard and no GPU.

A restarted rollout actor comes back with its initial weights; the loop
loads the current version into it before it serves (RayWorker.restart waits
until the actor answers again). A restarted learner actor comes back at
version 0 and is restored from the newest checkpoint by the loop.

Graders (``reward.workers`` > 1): one sample at a time per actor, a
per-sample deadline (past it the actor is killed and restarted, the sample
gets ``error_code="timeout"``), and up to ``reward.retries`` new attempts when
an actor dies mid-sample. With one worker the built-in rewards (microseconds
per sample) are scored on the driver.

What this is not: the loop (rlctl.engine), the actors' insides
(rlctl.placement.ray_actors) or the fault relay (rlctl.placement.ray_faults).
"""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlctl.config.load import validate_options
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import LearnerLost, WorkerLost
from rlctl.contracts.roles import ShardedLearnerOptions
from rlctl.contracts.types import RewardResult, RolloutRequest, TaskData, Trajectory, WeightUpdate
from rlctl.engine.faults import fault_site
from rlctl.engine.producers import RolloutFleet
from rlctl.engine.roles import Roles
from rlctl.hooks.manager import Plugins
from rlctl.placement.build import Common, build_common, build_critic, learner_context, reward_from_config
from rlctl.placement.ray_actors import ActorReset, LearnerActor, RewardActor, RolloutActor, StoredWeights
from rlctl.placement.ray_cluster import LOST, READY_TIMEOUT_S, connect, reserve, wait_alive, wait_started
from rlctl.placement.ray_faults import FaultRelay, armed
from rlctl.placement.ray_ranks import RayRanks


class RayRewardPool:
    """``workers`` RewardActors behind the RewardPool contract (``score`` in input order, ``close``)."""

    def __init__(self, factory: Callable[[], Any], workers: int, *, timeout_s: float, retries: int,
                 num_cpus: float = 0.0, max_restarts: int = -1, faults: Any = None) -> None:
        self.timeout_s, self.retries = timeout_s, retries
        self.actors = [RewardActor.options(num_cpus=num_cpus, max_restarts=max_restarts, max_task_retries=0)
                       .remote(factory, faults) for _ in range(workers)]
        self.version = ray.get(self.actors[0].version.remote(), timeout=READY_TIMEOUT_S)

    def score(self, trajectories: Sequence[Trajectory], references: Sequence[str]) -> list[RewardResult]:
        if len(trajectories) != len(references):
            raise ValueError("one reference per trajectory")
        results: list[RewardResult | None] = [None] * len(trajectories)
        todo = iter(range(len(trajectories)))
        lock = threading.Lock()

        def drive(slot: int) -> None:
            while True:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                results[i] = self._one(slot, trajectories[i], references[i])

        threads = [threading.Thread(target=drive, args=(k,), daemon=True) for k in range(len(self.actors))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return [r if r is not None else self._error("worker_crashed", 0.0, "no result") for r in results]

    def _one(self, slot: int, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        actor = self.actors[slot]
        for attempt in range(self.retries + 1):
            try:
                return ray.get(actor.score.remote(trajectory, reference), timeout=self.timeout_s)
            except GetTimeoutError:
                ray.kill(actor, no_restart=False)  # Ray restarts it; the next sample waits for the new process
                return self._error("timeout", started, f"no result within reward.timeout_s={self.timeout_s}s; "
                                   "the reward actor was killed and restarted")
            except LOST as err:
                if attempt == self.retries:
                    return self._error("worker_crashed", started, f"reward actor died: {type(err).__name__}")
                wait_alive(actor, f"reward worker {slot}")
        raise AssertionError("unreachable")

    def _error(self, code: str, started: float, log: str) -> RewardResult:
        return RewardResult(total=0.0, components={}, grader_version=self.version, error_code=code,
                            latency_s=time.perf_counter() - started, log=log)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


class RayWorker:
    """Driver-side handle of a RolloutActor."""

    def __init__(self, name: str, actor: Any) -> None:
        self.name, self.actor = name, actor
        self._ref: tuple[int, str, Any] | None = None
        self._loaded: tuple[int, str] | None = None  # what the actor holds, as far as this handle knows

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        fault_site("rollout.worker", worker=self)  # a worker crash (injected: SIGKILL of this actor's process)
        try:
            return ray.get(self.actor.generate.remote(list(requests)))
        except (*LOST, ActorReset) as err:
            self._loaded = None
            raise WorkerLost(f"{type(err).__name__}") from err

    def load_weights(self, update: WeightUpdate) -> None:
        key = (update.version, update.fingerprint)
        if key == self._loaded:
            return  # only a changed version ships
        if isinstance(update.state_dict, StoredWeights):  # exported by the learner actor: already in the store
            ref = update.state_dict.ref
        else:
            if self._ref is None or self._ref[:2] != key:
                self._ref = (*key, ray.put(update))  # one copy per version in the store
            ref = self._ref[2]
        self._loaded = None
        try:
            ray.get(self.actor.update_weights.remote(ref))
        except LOST as err:
            raise WorkerLost(f"{type(err).__name__}") from err
        self._loaded = key

    def restart(self) -> None:
        self._loaded = None  # a restarted actor holds its initial weights
        wait_alive(self.actor, f"rollout worker {self.name}")

    def close(self) -> None:
        """Nothing to do here: the placement kills the actor when the run ends."""

    def pid(self) -> int:
        return ray.get(self.actor.pid.remote())


class RayLearner:
    """Driver-side stand-in for the learner backend running in a LearnerActor (same methods)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def _get(self, ref: Any) -> Any:
        """``ray.get(ref)``; a dead or restarted learner actor is LearnerLost once it answers again."""
        try:
            return ray.get(ref)
        except (*LOST, ActorReset) as err:
            wait_alive(self.actor, "the learner")
            raise LearnerLost(f"{type(err).__name__}") from err

    def _call(self, method: str, *args: Any) -> Any:
        return self._get(self.actor.call.remote(method, *args))

    @property
    def policy_version(self) -> int:
        return self._get(self.actor.policy_version.remote())

    def accept_initial_state(self) -> None:
        """Let a restarted learner actor serve from its initial state (recovery found no checkpoint yet)."""
        self._get(self.actor.accept_initial_state.remote())

    def logprobs(self, batch: Any) -> Any:
        return self._call("logprobs", batch)

    def ref_logprobs(self, batch: Any) -> Any:
        return self._call("ref_logprobs", batch)

    def train_step(self, batch: Any) -> Mapping[str, float]:
        return self._call("train_step", batch)

    def train_step_with_logprobs(self, batch: Any) -> tuple[Mapping[str, float], Any]:
        return self._get(self.actor.train_step_with_logprobs.remote(batch))

    def export_weights(self) -> WeightUpdate:
        """The new version's tag, with its tensors left in the object store for the rollout actors."""
        meta, ref = self.actor.export_weights.remote()
        version, fingerprint = self._get(meta)
        return WeightUpdate(version=version, state_dict=StoredWeights(ref), fingerprint=fingerprint)

    def checkpoint_state(self) -> Any:
        return self._call("checkpoint_state")

    def load_checkpoint_state(self, state: Any) -> None:
        self._call("load_checkpoint_state", state)

    def save_pretrained(self, directory: str) -> None:
        self._call("save_pretrained", directory)

    def scale_lr(self, factor: float) -> float:
        """LrScalable: the actor's learner lowers its learning rate (the NaN rollback)."""
        return self._call("scale_lr", factor)

    def close(self) -> None:
        """Nothing to do here: the placement kills the actor when the run ends."""

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return {}  # the learner's tensors live in the actor's process

    def pid(self) -> int:
        return ray.get(self.actor.pid.remote())


class RayPlacement:
    """Every role of a run placed on Ray; ``roles`` are ready once it is constructed, ``close`` ends them all."""

    def __init__(self, config: RunConfig, plugins: Plugins, cache_root: Path,
                 progress: Callable[[int, int, float], None] | None = None, task: TaskData | None = None) -> None:
        common = build_common(config, plugins, cache_root, progress, task)  # cheap checks before Ray starts
        cfg = self._cluster = config.cluster
        self._started = connect(cfg)
        self.pg: Any = None
        self.actors: list[Any] = []
        self.learner_actor: Any = None
        self.ranks: RayRanks | None = None  # a sharded learner's rank group, when this placement launched one
        self.reward_pool: RayRewardPool | None = None
        self._closers: list[Callable[[], None]] = []
        self.relay = FaultRelay([])  # the run's guard arms its faults through it; every actor arms them too
        try:
            sharded = isinstance(validate_options(plugins.get("learner_backend", config.train.learner).options,
                                                  config.train.learner_options, "train.learner_options"),
                                 ShardedLearnerOptions)
            self.pg = reserve(_bundles(cfg, learner=not sharded), cfg.placement_strategy, self._started)
            self.roles: Roles = self._start(common, plugins, sharded)
        except BaseException:
            self.close()
            raise

    def _start(self, common: Common, plugins: Plugins, sharded: bool) -> Roles:
        config, cfg, faults = common.config, common.config.cluster, self.relay.claims
        if sharded:  # the ranks are actors, launched by the learner through this placement's launcher
            learner: Any = plugins.build("learner_backend", config.train.learner, config.train.learner_options,
                                         "train.learner_options", ctx=learner_context(
                                             config, common.estimator, common.policy_dir, rank_launcher=self._launch))
        else:
            self.learner_actor = LearnerActor.options(
                num_cpus=cfg.learner_num_cpus, num_gpus=cfg.learner_num_gpus, max_restarts=cfg.max_restarts,
                max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, 0),
            ).remote(config.train.learner, config.train.learner_options,
                     learner_context(config, common.estimator, common.policy_dir), max(1, int(cfg.learner_num_cpus)),
                     faults)
            learner = RayLearner(self.learner_actor)
        first = 0 if sharded else 1  # bundle 0 is the learner actor's
        self.actors = [RolloutActor.options(
            num_cpus=cfg.rollout_num_cpus, num_gpus=cfg.rollout_num_gpus, max_restarts=cfg.max_restarts,
            max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, first + i),
        ).remote(config.rollout, common.rollout_context(i), max(1, int(cfg.rollout_num_cpus)), faults,
                 config.faults.verifier_retries) for i in range(cfg.num_rollout_workers)]
        critic = build_critic(config, plugins, common.policy_dir) if common.estimator.needs_critic else None
        if config.reward.workers > 1:  # graders as actors
            r = config.reward
            self.reward_pool = RayRewardPool(partial(reward_from_config, config), r.workers, timeout_s=r.timeout_s,
                                             retries=r.retries, num_cpus=cfg.reward_num_cpus,
                                             max_restarts=max(cfg.max_restarts, 1), faults=faults)
        self.relay.rearm = self._rearm
        starting = [("the learner actor", self.learner_actor)] if self.learner_actor is not None else []
        wait_started(starting + [(f"rollout worker ray-{i}", a) for i, a in enumerate(self.actors)])
        fleet = RolloutFleet([RayWorker(f"ray-{i}", a) for i, a in enumerate(self.actors)])
        return common.roles(plugins, rollout=fleet, learner=learner, critic=critic, reward_pool=self.reward_pool)

    def _launch(self, *args: Any) -> RayRanks:
        """The rank launcher a sharded learner's context carries: its ranks as actors, armed with the run's faults."""
        self.ranks = RayRanks(self._cluster, *args, faults=self.relay.claims)
        return self.ranks

    def _rearm(self) -> dict[Any, str]:
        """Every live actor arms the broker's plan again (a fault was armed). The learner (its actor or its ranks)
        is idle at a step end and is waited for, so the fault is armed there before the next step; rollout and
        reward actors arm before their next call. Returns those refs, by actor name."""
        faults = self.relay.claims
        if self.ranks is not None:
            try:
                self.ranks.arm(faults)
            except LearnerLost:
                pass  # the ranks were restarted and armed the broker's plan; the loop restores them next call
        elif self.learner_actor is not None:  # a lost actor restarts and arms the broker's plan
            armed("the learner actor", self.learner_actor.arm.remote(faults), READY_TIMEOUT_S)
        pending = {a.arm.remote(faults): f"rollout worker ray-{i}" for i, a in enumerate(self.actors)}
        if self.reward_pool is not None:
            pending.update({a.arm.remote(faults): f"reward worker {i}"
                            for i, a in enumerate(self.reward_pool.actors)})
        return pending

    def close(self) -> None:
        """Kill every actor, record what the fault broker still holds, give back the bundles (idempotent)."""
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None
        if self.reward_pool is not None:
            self.reward_pool.close()
            self.reward_pool = None
        for actor in [self.learner_actor, *self.actors]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.learner_actor, self.actors = None, []
        if self.relay is not None:
            self.relay.close()  # after the actors: every firing and recovery they handed over is recorded
            self.relay = None
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._started:
            ray.shutdown()
            self._started = False


def _bundles(cfg: Any, *, learner: bool) -> list[dict[str, float]]:
    """One bundle for the learner actor (none for a sharded learner: its ranks reserve their own), one per worker."""
    def bundle(cpus: float, gpus: float) -> dict[str, float]:
        return {"CPU": cpus, **({"GPU": gpus} if gpus else {})}

    out = [bundle(cfg.learner_num_cpus, cfg.learner_num_gpus)] if learner else []
    return out + [bundle(cfg.rollout_num_cpus, cfg.rollout_num_gpus) for _ in range(cfg.num_rollout_workers)]
