"""A sharded learner's ranks as Ray actors: ``train.learner`` fsdp2 / deepspeed with ``cluster.backend=ray``.

What this is: ``RayRanks``, the Ray counterpart of rlctl.kit's
LocalRanks behind the same RankGroup learner (the Ray placement passes a
launcher of it as the learner context's ``rank_launcher``). Every rank, rank 0
included, is a RankActor in a placement group of ``world_size`` bundles
(``cluster.learner_num_cpus`` / ``learner_num_gpus`` each, placed by
``cluster.placement_strategy``); the driver holds no shard and no GPU. A call
goes to every rank at once, its arguments put in the object store once, and
rank 0's answer comes back; exported weights stay in the object store, where
the rollout actors read them (StoredWeights). Checkpoints are the learner's
own sharded ones: every rank writes and reads its pieces of the checkpoint's
``shards/`` itself, so on several nodes RLCTL_HOME (policy, runs,
checkpoints) must be on storage every node mounts at the same path, as it
must for the one-process learner actor.

Failures:

- A rank actor that dies, or that Ray restarted while it was idle (it then
  answers ActorReset), takes the group with it: the driver kills the other
  ranks at once (they would wait in a collective until the rank timeout), Ray
  restarts every rank (``cluster.max_restarts``), they meet again on a new
  port, and the call raises LearnerLost. The overlapped loop restores the
  newest checkpoint into them (``load_shards``) or accepts their initial
  state; until then a restarted rank refuses every other call.
- A rank that raises ends the group for good with a RoleError naming it (an
  rlctl error it raised, such as a CheckpointError, is passed on as it is);
  ranks that gave no answer within ``rank_timeout_s`` after that are named
  too, so a hung rank is reported, never waited on forever.

The group lives as long as the placement that launched it, which arms the
run's faults in its ranks when they join, again when a fault is armed while
the run trains (``rlctl inject --run RUN``) and after Ray restarts them (from
the broker's plan as it is then). Like every ``ray_*`` module of
rlctl.placement, it imports ray; nothing else in rlctl does.

What this is not: the ranks' maths (the learner plugins) or the rollout and
reward actors (rlctl.placement.ray_placement).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any, Mapping, Sequence

import ray
from ray.util.placement_group import remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlctl.contracts.errors import CheckpointError, ConfigError, RoleError
from rlctl.contracts.types import LearnerContext, WeightUpdate
from rlctl.contracts.errors import LearnerLost
from rlctl.placement.ranks import free_port, init_group, rank_device
from rlctl.placement.ray_actors import ActorReset, StoredWeights, arm_faults, reconstructed, set_threads
from rlctl.placement.ray_cluster import LOST, READY_TIMEOUT_S, connect, reserve, wait_alive


@ray.remote
class RankActor:
    """One rank of a sharded learner: joins the group when the driver says where (``join``), then runs its calls."""

    def __init__(self, make_rank: Any, ctx: LearnerContext, options: Any, rank: int, world: int,
                 threads: int) -> None:
        set_threads(threads)
        self.make_rank, self.ctx, self.options, self.rank, self.world = make_rank, ctx, options, rank, world
        self.me: Any = None  # built by join, once the group is up
        self.reset = reconstructed()  # a restart serves nothing until the driver restores (or accepts) its state
        self._disarm: Any = lambda: None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address for the group's store: this node's IP and a free port on it."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def join(self, host: str, port: int, faults: Any) -> str:
        """Join the group at ``host:port``, build this rank's shard, arm the run's faults; the rank's device."""
        from rlctl.models.device import resolve_device

        if not os.path.isdir(self.ctx.model_dir):
            raise ConfigError(f"learner rank {self.rank} on node {ray.util.get_node_ip_address()} cannot read the "
                              f"policy directory {self.ctx.model_dir}",
                              "keep RLCTL_HOME (models, runs, checkpoints) on storage every Ray node mounts at the "
                              "same path")
        # Ray gives each rank actor its own GPU (cuda:0 inside it), whatever index train.device names
        device = resolve_device("cuda" if self.ctx.device.startswith("cuda") else self.ctx.device, "train.device")
        init_group(device, host, port, self.rank, self.world, self.options.rank_timeout_s, local_index=0)
        self.me = self.make_rank(replace(self.ctx, device=rank_device(device, 0)), self.options, self.rank,
                                 self.world)
        self.arm(faults)
        return str(self.me.device)

    def arm(self, faults: Any) -> None:
        """Arm the run's faults here: the plan of the placement's fault broker as it is now (``faults`` is the
        relay's claims; None disarms them)."""
        self._disarm()
        self._disarm = arm_faults(faults)

    def _check(self) -> None:
        if self.me is None or self.reset:
            raise ActorReset(f"learner rank {self.rank} was restarted and holds its initial state")

    def call(self, name: str, *args: Any) -> Any:
        """Run ``name`` on this rank; only rank 0's result travels back (the driver uses no other)."""
        if name == "load_shards":  # the restore itself: what a restarted rank waits for
            if self.me is None:
                raise ActorReset(f"learner rank {self.rank} was restarted and has not joined its group")
            self.me.load_shards(*args)
            self.reset = False
            return None
        self._check()
        out = getattr(self.me, name)(*args)
        return out if self.rank == 0 else None

    def get(self, name: str) -> Any:
        self._check()
        return getattr(self.me, name)

    @ray.method(num_returns=2)
    def export(self) -> tuple[Any, Any]:
        """Gather the full weights (a collective); rank 0 returns (version, fingerprint) and the update itself,
        which stays in the object store; the other ranks return nothing."""
        from rlctl.models.fingerprint import fingerprint

        self._check()
        state = self.me.full_state()
        if self.rank != 0:
            return None, None
        update = WeightUpdate(version=self.me.policy_version, state_dict=state, fingerprint=fingerprint(state))
        return (update.version, update.fingerprint), update

    def accept_initial_state(self) -> None:
        if self.me is None:
            raise ActorReset(f"learner rank {self.rank} was restarted and has not joined its group")
        self.reset = False

    def pid(self) -> int:
        return os.getpid()


class RayRanks:
    """Driver side of a sharded learner whose ranks are RankActors (the ``ranks`` of a RankGroup)."""

    remote = True

    def __init__(self, cluster: Any, make_rank: Any, label: str, ctx: LearnerContext, options: Any,
                 faults: Any = None) -> None:
        gpus = cluster.learner_num_gpus
        if ctx.device.startswith("cuda") and gpus < 1:
            raise ConfigError(f"train.device is {ctx.device!r} but each {label} rank actor is given "
                              f"cluster.learner_num_gpus={gpus:g}: a rank needs a GPU of its own (NCCL cannot put "
                              "two ranks on one device)",
                              "set cluster.learner_num_gpus=1, or train.device=cpu")
        self.label, self.options, self.world = label, options, options.world_size
        self._faults: Any = faults  # the placement's fault claims: every rank arms the run's faults when it joins
        self._broken: str | None = None
        self._restarted = False  # the ranks were restarted: only a restore (or accepting their initial state) runs
        self._closed = False
        self._started = connect(cluster)
        bundle = {"CPU": cluster.learner_num_cpus, **({"GPU": gpus} if gpus else {})}
        self.pg = reserve([dict(bundle) for _ in range(self.world)], cluster.placement_strategy, self._started)
        threads = max(1, int(cluster.learner_num_cpus))
        self.actors = [
            RankActor.options(num_cpus=cluster.learner_num_cpus, num_gpus=gpus, max_restarts=cluster.max_restarts,
                              max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, r)).remote(make_rank, ctx, options, r, self.world, threads)
            for r in range(self.world)]
        try:
            self.device = self._join()
        except LearnerLost as err:
            self.close()
            raise RoleError(f"a {label} learner rank died while the group started ({err})",
                            "look at the rank actor's log under the Ray session directory (out of memory?)") from None
        except BaseException:
            self.close()
            raise

    # -- the group -------------------------------------------------------------------

    def _join(self) -> Any:
        """Every rank joins a new group (rank 0's node and a fresh port); the ranks' device."""
        import torch

        host, port = self._wait([(0, self.actors[0].rendezvous.remote())], "start-up")[0]
        devices = self._wait([(r, a.join.remote(host, port, self._faults)) for r, a in enumerate(self.actors)],
                             "start-up")
        return torch.device(devices[0])

    def _check(self, restoring: bool = False) -> None:
        if self._broken:
            raise RoleError(f"the {self.label} learner group is down ({self._broken})", "restart or resume the run")
        if self._restarted and not restoring:  # a new group: nothing but the restore may run (no second restart)
            raise LearnerLost(f"the {self.label} learner ranks were restarted and wait for their state")

    def _wait(self, calls: Sequence[tuple[int, Any]], what: str) -> list[Any]:
        """The results of ``(rank, ref)`` calls in order; a lost rank restarts the group and raises LearnerLost,
        a failed rank ends it (``_fail``)."""
        pending = {ref: rank for rank, ref in calls}
        results: dict[int, Any] = {}
        failure: tuple[int, BaseException] | None = None
        deadline: float | None = None
        while pending:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            if not ready:
                break  # past the deadline after a failure: the rest are stuck
            rank = pending.pop(ready[0])
            try:
                results[rank] = ray.get(ready[0])
            except (*LOST, ActorReset) as err:
                self._restart()
                raise LearnerLost(f"learner rank {rank} was lost during {what} ({type(err).__name__})") from err
            except Exception as err:  # noqa: BLE001 - the rank's own error, reported by rank
                if failure is None:
                    failure = (rank, err)  # the others finish, fail the same way, or time out in their collective
                    deadline = time.monotonic() + self.options.rank_timeout_s + 5.0
        if failure is not None:
            self._fail(what, *failure, sorted(pending.values()))
        return [results[rank] for rank, _ in calls]

    def _restart(self) -> None:
        """Kill every rank (Ray restarts each), wait until all answer, and let them form a new group."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=False)
            except Exception:  # noqa: BLE001 - already dead; Ray restarts it or gives up (seen below)
                pass
        self._restarted = True
        for rank, actor in enumerate(self.actors):
            wait_alive(actor, f"learner rank {rank}")
        self._join()

    def _fail(self, what: str, rank: int, err: BaseException, stuck: list[int]) -> None:
        cause = getattr(err, "cause", None) or err  # a RayTaskError carries the rank's own exception
        self._broken = f"rank {rank} failed during {what}"
        self._kill()
        if isinstance(cause, CheckpointError | ConfigError | RoleError) and not stuck:
            raise cause from None
        late = (f"; rank(s) {', '.join(map(str, stuck))} gave no answer within {self.options.rank_timeout_s:g}s "
                "after that" if stuck else "")
        raise RoleError(f"learner rank {rank} failed during {what}: {type(cause).__name__}: {cause}{late}",
                        "see that rank's error (its log is under the Ray session directory); `rlctl resume` "
                        "continues the run from its last checkpoint") from None

    def _kill(self) -> None:
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - gone already
                pass

    # -- what RankGroup asks of its ranks ------------------------------------------------

    def run(self, name: str, *args: Any) -> Any:
        """Run ``name`` on every rank (arguments shipped once through the object store); rank 0's result."""
        restoring = name == "load_shards"
        self._check(restoring)
        refs = [ray.put(a) for a in args]
        out = self._wait([(r, a.call.remote(name, *refs)) for r, a in enumerate(self.actors)], name)[0]
        if restoring:
            self._restarted = False
        return out

    def call0(self, name: str, *args: Any) -> Any:
        self._check()
        return self._wait([(0, self.actors[0].call.remote(name, *args))], name)[0]

    def get0(self, name: str) -> Any:
        self._check()
        return self._wait([(0, self.actors[0].get.remote(name))], name)[0]

    def export(self) -> WeightUpdate:
        """The gathered weights' tag; the tensors stay in the object store for the rollout actors."""
        self._check()
        pairs = [a.export.remote() for a in self.actors]
        version, fingerprint = self._wait([(r, meta) for r, (meta, _) in enumerate(pairs)], "export_weights")[0]
        return WeightUpdate(version=version, state_dict=StoredWeights(pairs[0][1]), fingerprint=fingerprint)

    def resident_tensors(self) -> Mapping[str, list[Any]]:
        return {}  # every shard lives in a rank actor's process

    def accept_initial_state(self) -> None:
        self._check(restoring=True)
        self._wait([(r, a.accept_initial_state.remote()) for r, a in enumerate(self.actors)], "restore")
        self._restarted = False

    def arm(self, faults: Any) -> None:
        """Arm a run's faults in every rank (also after a restart); None disarms them."""
        self._faults = faults
        if not self._broken:
            self._wait([(r, a.arm.remote(faults)) for r, a in enumerate(self.actors)], "arming faults")

    def pids(self) -> list[int]:
        return [ray.get(a.pid.remote(), timeout=READY_TIMEOUT_S) for a in self.actors]

    def close(self) -> None:
        """Stop the ranks and give back their bundles (idempotent; Ray is shut down if this group started it)."""
        if self._closed:
            return
        self._closed = True
        self._broken = self._broken or "closed"
        if not ray.is_initialized():
            return
        self._kill()
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - the cluster is going away
            pass
        if self._started:
            ray.shutdown()
