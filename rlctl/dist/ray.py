"""Ray placement: rollout workers and the learner as Ray actors in one placement group.

What this is: ``RayPlacement`` (joins ``cluster.address`` or starts a local
cluster, reserves one bundle per actor with the configured CPUs/GPUs, starts
the actors with ``max_restarts``) and the driver-side handles ``RayWorker``
and ``RayLearner`` that turn a dead actor into WorkerLost / LearnerLost for
the overlapped loop. This module and rlctl.dist.ray_ranks (a sharded learner's rank actors) are the
only ones in rlctl that import ray.

A restarted rollout actor comes back with its initial weights; the loop
loads the current version into it before it serves (RayWorker.restart waits
until the actor answers again). A restarted learner actor comes back at
version 0 and is restored from the newest checkpoint by the loop. An actor
killed while idle is restarted by Ray without any call failing, and the next
call would run on the new process; so a restarted actor refuses work
(``ActorReset``, seen by the loop as WorkerLost / LearnerLost) until it has
been given the current weights or checkpoint state.

With ``reward.workers`` > 1 the graders run as Ray actors too
(``RayRewardPool``, the same RewardPool contract as the process pool): one
sample at a time per actor, a per-sample deadline (past it the actor is killed
and restarted, the sample gets ``error_code="timeout"``), and up to
``reward.retries`` new attempts when an actor dies mid-sample. With one worker
the built-in rewards (microseconds per sample) are scored on the driver.

Injected faults reach the actors: a ``FaultBroker`` actor holds the run's
plan (its armed faults, rlctl.engine.faults.armed_plan), every actor arms that
plan in its own process when it starts, so ``learner.*`` faults fire in the
learner actor, ``rollout.generate`` in the rollout actors and
``verifier.score`` in the reward actors. A fault armed while the run trains
(``rlctl inject --run RUN``: the run guard publishes it at a step end) is
added to the broker's plan and every live actor arms the plan again
(``arm``): the learner before the driver goes on, a rollout or reward actor
before its next call (Ray runs one caller's calls to an actor in order). An
actor Ray restarts arms the broker's plan as it is then, live-armed faults
included. The broker is also the arbiter of all of them:
it holds the driver's step (pushed by the run guard on every change, before
the next step starts) and each fault's fired steps, so a step fires once
across the driver and every actor (``FaultContext.take`` claims it there,
atomically), and a fault that fired in an actor hands its record to the
broker before it acts (a SIGKILL leaves it behind); the driver records those
as ``fault_injected`` events at every step end and when the run closes.
Recoveries an actor reports itself (``report_recovery``: the learner's OOM
retry) travel through the same broker into the driver's registry events.

What this is not: the loop (rlctl.engine.async_loop).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Any, Callable, Mapping, Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import (
    LearnerContext,
    RewardResult,
    RolloutContext,
    RolloutRequest,
    Trajectory,
    WeightUpdate,
)
from rlctl.engine.async_loop import LearnerLost, WorkerLost
from rlctl.engine.faults import (
    ArmedFault, FaultContext, arm_plan, armed_plan, fault_site, forward_recoveries, on_publish, on_step,
    report_recovery,
)

_LOST = (RayActorError, ActorUnavailableError)
READY_TIMEOUT_S = 600.0  # a restarting actor imports torch and loads its model; shared CPUs are slow


def _threads(n: int) -> None:
    os.environ["OMP_NUM_THREADS"] = str(n)
    import torch

    torch.set_num_threads(n)


_plugins: Any = None  # this actor process's plugin registry, loaded once for arming faults


def _arm_faults(faults: "_BrokerClaims | None", plugins: Any = None) -> Callable[[], None]:
    """Arm the run's faults in this actor's process: the broker's plan as it is now (``faults`` is the
    placement's _BrokerClaims; None: no faults), and send its recovery reports (``report_recovery``) to the
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


@ray.remote
class FaultBroker:
    """The arbiter of the run's faults across processes: the run's plan, the driver's step and each fault's
    fired steps.

    Ray runs one method at a time on an actor, so ``claim`` is atomic.
    """

    def __init__(self, step: int, fired: dict[int, set[int]], plan: Sequence[ArmedFault] = ()) -> None:
        self._step, self._fired = step, {i: set(steps) for i, steps in fired.items()}
        self._plan = {fault.index: fault for fault in plan}
        self._events: list[tuple[int, str, dict[str, Any]]] = []
        self._recoveries: list[tuple[str, str, dict[str, Any]]] = []

    def plan(self) -> list[ArmedFault]:
        """Every fault of the run armed so far, by index: what an actor arms when it (re)starts or re-arms."""
        return [self._plan[i] for i in sorted(self._plan)]

    def add(self, fault: ArmedFault, fired: set[int]) -> None:
        """A fault the driver armed mid-run (``fired``: the steps it already fired at)."""
        self._plan[fault.index] = fault
        self._fired.setdefault(fault.index, set()).update(fired)

    def step(self) -> int:
        return self._step

    def fired(self, index: int, step: int) -> bool:
        return step in self._fired.get(index, ())

    def claim(self, index: int, step: int) -> bool:
        steps = self._fired.setdefault(index, set())
        if step in steps:
            return False
        steps.add(step)
        return True

    def mark(self, index: int, step: int, event: tuple[str, dict[str, Any]] | None) -> None:
        self._fired.setdefault(index, set()).add(step)
        if event is not None:
            self._events.append((index, *event))

    def recovered(self, kind: str, message: str, data: dict[str, Any]) -> None:
        self._recoveries.append((kind, message, data))

    def sync(self, step: int | None) -> tuple[list[tuple[int, str, dict[str, Any]]], list[tuple[str, str, dict]]]:
        """Take the driver's step (None: unchanged); return the firing records and recovery reports actors
        left since the last call."""
        if step is not None:
            self._step = step
        events, self._events = self._events, []
        recoveries, self._recoveries = self._recoveries, []
        return events, recoveries


class _BrokerClaims:
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


def _armed(who: str, ref: Any, timeout: float | None) -> None:
    """Wait for an actor's ``arm`` call; a lost actor is fine (restarted, it arms the broker's plan), any other
    failure is a RoleError naming the actor."""
    try:
        ray.get(ref, timeout=timeout)
    except _LOST:
        pass
    except GetTimeoutError:
        raise RoleError(f"{who} did not arm a fault injected into the running run within {timeout:.0f}s",
                        "check the cluster's free resources with `ray status`; `rlctl resume` continues the run "
                        "from its last checkpoint") from None
    except Exception as err:  # noqa: BLE001 - the actor's own error, named with the actor
        cause = getattr(err, "cause", None) or err
        raise RoleError(f"{who} could not arm a fault injected into the running run: {type(cause).__name__}: "
                        f"{cause}", "check the fault's options (`rlctl inject --help`); the actor's log is under "
                        "the Ray session directory") from None


class _FaultRelay:
    """Driver side of the FaultBroker: binds the driver's fault contexts to it, records the actors' firings
    and passes their recovery reports on to this process's ``report_recovery``.

    ``claims`` is what the actors get (``faults``): they arm the broker's plan through it. A fault the driver
    publishes while the relay lives is added to that plan, and ``rearm`` (set by the placement once its actors
    run) makes the live actors arm it; it returns the refs of re-arms not waited for, checked at each ``sync``.
    """

    def __init__(self, plan: list[tuple[ArmedFault, FaultContext]]) -> None:
        self.contexts = {fault.index: ctx for fault, ctx in plan}
        step = plan[0][1].step() if plan else 0
        name = f"rlctl-faults-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.broker = FaultBroker.options(name=name, num_cpus=0, max_restarts=0).remote(
            step, {i: set(ctx.fired_steps) for i, ctx in self.contexts.items()}, [fault for fault, _ in plan])
        self.claims = _BrokerClaims(name, self.broker)
        for ctx in self.contexts.values():
            ctx.share(self.claims)
        self.rearm: Callable[[], dict[Any, str]] | None = None
        self._arming: dict[Any, str] = {}  # re-arm refs in flight -> the actor's name
        self._lock = threading.RLock()
        self._removers = [on_step(self.sync), on_publish(self._published)]

    def _published(self, fault: ArmedFault, ctx: FaultContext) -> None:
        """The driver armed ``fault`` mid-run: the broker's plan gets it, then every live actor arms it."""
        with self._lock:
            self.contexts[fault.index] = ctx
            ctx.share(self.claims)
            self._broker_call(self.broker.add.remote(fault, set(ctx.fired_steps)))
            if self.rearm is not None:
                self._arming.update(self.rearm())

    def _broker_call(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=READY_TIMEOUT_S)
        except (*_LOST, GetTimeoutError) as err:
            raise RoleError(f"the run's fault broker actor is gone ({type(err).__name__}): injected faults "
                            "and the actors' recovery reports can no longer be recorded",
                            "resume the run with `rlctl resume`; check the Ray session's logs for why the "
                            "actor died") from None

    def _check_arming(self) -> None:
        """Raise the error of a finished re-arm; a lost actor is fine (restarted, it arms the broker's plan)."""
        if not self._arming:
            return
        done, _ = ray.wait(list(self._arming), num_returns=len(self._arming), timeout=0)
        for ref in done:
            who = self._arming.pop(ref)
            _armed(who, ref, None)

    def sync(self, step: int | None = None) -> None:
        with self._lock:
            self._check_arming()
            events, recoveries = self._broker_call(self.broker.sync.remote(step))
            for index, message, data in events:
                ctx = self.contexts.get(index)
                if ctx is not None:
                    ctx.accept(message, data)
            for kind, message, data in recoveries:
                report_recovery(kind, message, data)

    def close(self) -> None:
        for remove in self._removers:
            remove()
        self.rearm, self._arming = None, {}  # the actors are gone: a re-arm they did not finish is moot
        try:
            self.sync()
        except RoleError:
            pass  # the run is ending anyway; what already reached the driver is recorded
        finally:
            for ctx in self.contexts.values():
                ctx.share(None)
            ray.kill(self.broker, no_restart=True)


def connect(cluster: Any) -> bool:
    """Join ``cluster.address``, or start a local cluster sized by ``cluster.num_cpus``, unless Ray is up already;
    whether this call started it (then the caller shuts it down)."""
    if ray.is_initialized():
        return False
    if cluster.address:
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep a local cluster on loopback
        ray.init(num_cpus=cluster.num_cpus, include_dashboard=False, log_to_driver=False)
    return True


def reserve(bundles: list[dict[str, float]], strategy: str, started: bool) -> Any:
    """A ready placement group of ``bundles``; RoleError (and Ray shut down if ``started``) when it cannot be placed."""
    pg = placement_group(bundles, strategy=strategy)
    try:
        ray.get(pg.ready(), timeout=READY_TIMEOUT_S)
    except GetTimeoutError:
        remove_placement_group(pg)
        if started:
            ray.shutdown()
        raise RoleError(f"the Ray cluster cannot place {len(bundles)} bundles {bundles} "
                        f"(it has {ray.cluster_resources()})",
                        "lower cluster.num_rollout_workers, train.learner_options.world_size or the per-actor "
                        "num_cpus/num_gpus, or add nodes") from None
    return pg


class ActorReset(Exception):
    """A restarted actor was called before the driver restored its state (it holds its initial state)."""


def _reconstructed() -> bool:
    """Whether this actor process is a restart (Ray re-ran the constructor after the previous one died)."""
    return ray.get_runtime_context().was_current_actor_reconstructed


@ray.remote
class RolloutActor:
    """Hosts one rollout backend built from the plugin registry inside the actor's process."""

    def __init__(self, backend: str, options: Mapping[str, Any], ctx: RolloutContext, threads: int,
                 faults: Any = None) -> None:
        _threads(threads)
        from rlctl.hooks.manager import load_plugins

        self.plugins = load_plugins()
        self._disarm = _arm_faults(faults, self.plugins)  # the broker's plan now: a restart gets live-armed faults
        self.backend = self.plugins.build("rollout_backend", backend, options, "rollout.options", ctx=ctx)
        self.reset = _reconstructed()  # refuses to generate until the driver loads the current weights

    def arm(self, faults: Any) -> None:
        """Arm the broker's plan again (a fault was armed while the run trains); None disarms every fault."""
        self._disarm()
        self._disarm = _arm_faults(faults, self.plugins)

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
    """Hosts the learner backend; the driver calls its methods by name."""

    def __init__(self, learner: str, options: Mapping[str, Any], ctx: LearnerContext, threads: int,
                 faults: Any = None) -> None:
        _threads(threads)
        from rlctl.hooks.manager import load_plugins

        self.plugins = load_plugins()
        self._disarm = _arm_faults(faults, self.plugins)  # the broker's plan now: a restart gets live-armed faults
        self.learner = self.plugins.build("learner_backend", learner, options, "train.learner_options", ctx=ctx)
        # A restart (Ray re-runs this constructor) serves nothing until the driver restores it: a learner
        # killed between calls would otherwise answer the next call silently from its initial state.
        self.reset = _reconstructed()

    def call(self, method: str, *args: Any) -> Any:
        if method != "load_checkpoint_state":
            self._check()
        result = getattr(self.learner, method)(*args)
        if method == "load_checkpoint_state":
            self.reset = False
        return result

    def _check(self) -> None:
        if self.reset:
            raise ActorReset("the learner actor was restarted and holds its initial state")

    def train_step_with_logprobs(self, batch: Any) -> tuple[Mapping[str, float], Any]:
        """The update and log pi before it, [N, T], from one call (one batch transfer); see the torch learner."""
        self._check()
        capture = getattr(self.learner, "train_step_with_logprobs", None)
        if capture is not None:
            return capture(batch)
        before = self.learner.logprobs(batch)  # a learner without it: the separate pass, still in this process
        return self.learner.train_step(batch), before

    @ray.method(num_returns=2)
    def export_weights(self) -> tuple[tuple[int, str], WeightUpdate]:
        """(version, fingerprint) for the driver, and the update itself, which stays in the object store."""
        self._check()
        update = self.learner.export_weights()
        return (update.version, update.fingerprint), update

    def attr(self, name: str) -> Any:
        self._check()
        return getattr(self.learner, name)

    def accept_initial_state(self) -> None:
        """The driver restores a restarted learner to the run's start (no checkpoint yet): its initial state."""
        self.reset = False

    def arm(self, faults: Any) -> None:
        """Arm the broker's plan again (a fault was armed while the run trains); None disarms every fault."""
        self._disarm()
        self._disarm = _arm_faults(faults, self.plugins)

    def pid(self) -> int:
        return os.getpid()


@ray.remote
class RewardActor:
    """Builds one grader from a picklable factory and scores one sample per call."""

    def __init__(self, factory: Callable[[], Any], faults: Any = None) -> None:
        _threads(1)
        self._disarm = _arm_faults(faults)  # the broker's plan now: a restart gets live-armed faults
        self.reward = factory()

    def arm(self, faults: Any) -> None:
        """Arm the broker's plan again (a fault was armed while the run trains); None disarms every fault."""
        self._disarm()
        self._disarm = _arm_faults(faults)

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
            except _LOST as err:
                if attempt == self.retries:
                    return self._error("worker_crashed", started, f"reward actor died: {type(err).__name__}")
                _wait_alive(actor, f"reward worker {slot}")
        raise AssertionError("unreachable")

    def _error(self, code: str, started: float, log: str) -> RewardResult:
        return RewardResult(total=0.0, components={}, grader_version=self.version, error_code=code,
                            latency_s=time.perf_counter() - started, log=log)

    def close(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


def _wait_alive(actor: Any, what: str) -> None:
    """Block until a restarting actor answers; RoleError once Ray gives up on it.

    A ping sent while the actor restarts is queued and answered by the new
    process. ActorDiedError on a fresh ping means the actor is dead for good,
    except when the ping raced the death itself: three in a row are final.
    """
    deadline = time.monotonic() + READY_TIMEOUT_S
    died = 0
    while time.monotonic() < deadline:
        try:
            ray.get(actor.pid.remote(), timeout=5)
            return
        except (GetTimeoutError, ActorUnavailableError):
            time.sleep(0.2)
        except ActorDiedError:
            died += 1
            if died >= 3:
                raise RoleError(f"{what} died and Ray will not restart it",
                                "raise cluster.max_restarts, or look at the actor's log under the Ray session "
                                "directory") from None
            time.sleep(0.5)
    raise RoleError(f"{what} did not come back within {READY_TIMEOUT_S:.0f}s",
                    "check the cluster's free resources with `ray status`")


def _started(actors: Sequence[tuple[str, Any]]) -> None:
    """Wait until every actor's constructor has run (it loads a model), so start-up is the placement's phase and
    an actor that cannot start is one RoleError naming it, not a restart loop inside the first step."""
    refs = {actor.pid.remote(): name for name, actor in actors}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=READY_TIMEOUT_S)
    if pending:
        names = ", ".join(refs[r] for r in pending)
        raise RoleError(f"{names} did not start within {READY_TIMEOUT_S:.0f}s",
                        "check the cluster's free resources with `ray status` and the actors' logs under the Ray "
                        "session directory")
    for ref in ready:
        try:
            ray.get(ref)
        except _LOST as err:  # its constructor raised: Ray's message ends with that error's own line
            lines = [line.strip() for line in (getattr(err, "error_msg", None) or str(err)).splitlines()]
            raise RoleError(f"{refs[ref]} failed to start: {next((x for x in reversed(lines) if x), '?')}",
                            "see the actor's log under the Ray session directory") from None


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
        except (*_LOST, ActorReset) as err:
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
        except _LOST as err:
            raise WorkerLost(f"{type(err).__name__}") from err
        self._loaded = key

    def restart(self) -> None:
        self._loaded = None  # a restarted actor holds its initial weights
        _wait_alive(self.actor, f"rollout worker {self.name}")

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
        except (*_LOST, ActorReset) as err:
            _wait_alive(self.actor, "the learner")
            raise LearnerLost(f"{type(err).__name__}") from err

    def _call(self, method: str, *args: Any) -> Any:
        return self._get(self.actor.call.remote(method, *args))

    @property
    def policy_version(self) -> int:
        return self._get(self.actor.attr.remote("policy_version"))

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

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return {}  # the learner's tensors live in the actor's process

    def pid(self) -> int:
        return ray.get(self.actor.pid.remote())


class RayPlacement:
    """Starts (or joins) Ray, reserves the bundles, and runs the learner and the rollout workers as actors.

    A one-process learner (``train.learner: torch``) runs in a LearnerActor
    started here. The session keeps its in-process learner as the canonical
    copy between runs: the actor starts from it (so a resumed run continues
    from the restored state) and the final state is copied back on close (so
    the final policy and evaluation read it as in a local run). A sharded
    learner's ranks are Ray actors already (rlctl.dist.ray_ranks, started with
    the session and living as long as it): the placement uses it as it is,
    arms the run's faults in its ranks and reserves bundles for the rollout
    workers only.
    """

    def __init__(self, session: Any, plugins: Any) -> None:
        cfg = session.config.cluster
        self.session, self.cfg = session, cfg
        self._started = connect(cfg)
        ranks = getattr(session.learner, "ranks", None)
        self.ranks = ranks if getattr(ranks, "remote", False) else None
        n = cfg.num_rollout_workers
        bundles = [] if self.ranks is not None else [
            {"CPU": cfg.learner_num_cpus, **({"GPU": cfg.learner_num_gpus} if cfg.learner_num_gpus else {})}]
        bundles += [{"CPU": cfg.rollout_num_cpus, **({"GPU": cfg.rollout_num_gpus} if cfg.rollout_num_gpus else {})}
                    for _ in range(n)]
        self.pg = reserve(bundles, cfg.placement_strategy, self._started)
        self.relay = _FaultRelay(armed_plan())  # the run's faults armed in every actor; recoveries reported back
        try:
            self._start_actors(session, plugins)
        except BaseException:
            self.relay.close()  # no listener or shared fault contexts outlive a placement that never started
            remove_placement_group(self.pg)
            if self._started:
                ray.shutdown()
            raise

    def _start_actors(self, session: Any, plugins: Any) -> None:
        from dataclasses import replace

        cfg = self.cfg
        faults = self.relay.claims
        self.local_learner = session.learner
        config, s = session.config, session
        first = 0
        if self.ranks is not None:
            self.learner_actor, self.learner = None, session.learner
            self.ranks.arm(faults)
        else:
            first = 1  # bundle 0 is the learner's
            threads = max(1, int(cfg.learner_num_cpus))
            self.learner_actor = LearnerActor.options(
                num_cpus=cfg.learner_num_cpus, num_gpus=cfg.learner_num_gpus, max_restarts=cfg.max_restarts,
                max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, 0),
            ).remote(config.train.learner, config.train.learner_options, replace(s.learner_ctx, rank_launcher=None),
                     threads, faults)
            self.learner = RayLearner(self.learner_actor)
            if self.local_learner.policy_version > 0:  # a resumed run: the actor continues from the restored state
                self.learner.load_checkpoint_state(self.local_learner.checkpoint_state())
        self.actors = [
            RolloutActor.options(
                num_cpus=cfg.rollout_num_cpus, num_gpus=cfg.rollout_num_gpus, max_restarts=cfg.max_restarts,
                max_task_retries=0, scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, first + i),
            ).remote(config.rollout.backend, config.rollout.options,
                     RolloutContext(model_dir=str(s.policy_dir), tokenizer_hash=s.tokenizer_hash,
                                    seed=config.run.seed + 1000 * i), max(1, int(cfg.rollout_num_cpus)), faults)
            for i in range(cfg.num_rollout_workers)
        ]
        session.learner = self.learner
        self.local_pool, self.reward_pool = session.reward_pool, None
        if config.reward.workers > 1:  # graders as actors; the session's process pool waits for the run's end
            from functools import partial

            from rlctl.engine.session import reward_from_config

            r = config.reward
            self.reward_pool = RayRewardPool(partial(reward_from_config, config), r.workers, timeout_s=r.timeout_s,
                                             retries=r.retries, num_cpus=cfg.reward_num_cpus,
                                             max_restarts=max(cfg.max_restarts, 1), faults=faults)
            session.reward_pool = self.reward_pool
        self.relay.rearm = self._rearm
        starting = [("the learner actor", self.learner_actor)] if self.learner_actor is not None else []
        _started(starting + [(f"rollout worker ray-{i}", a) for i, a in enumerate(self.actors)])

    def _rearm(self) -> dict[Any, str]:
        """Every live actor arms the broker's plan again (a fault was armed mid-run). The learner (its actor or
        its ranks) is idle at a step end and is waited for, so the fault is armed there before the next step;
        rollout and reward actors arm before their next call. Returns those refs, by actor name."""
        faults = self.relay.claims
        if self.ranks is not None:
            try:
                self.ranks.arm(faults)
            except LearnerLost:
                pass  # the ranks were restarted and armed the broker's plan; the loop restores them next call
        else:  # a lost learner actor restarts and arms the broker's plan; the loop sees the loss at its next call
            _armed("the learner actor", self.learner_actor.arm.remote(faults), READY_TIMEOUT_S)
        pending = {a.arm.remote(faults): f"rollout worker ray-{i}" for i, a in enumerate(self.actors)}
        if self.reward_pool is not None:
            pending.update({a.arm.remote(faults): f"reward worker {i}"
                            for i, a in enumerate(self.reward_pool.actors)})
        return pending

    def workers(self) -> list[RayWorker]:
        return [RayWorker(f"ray-{i}", a) for i, a in enumerate(self.actors)]

    def close(self) -> None:
        try:
            if self.ranks is not None:
                try:
                    self.ranks.arm(None)  # the ranks outlive this placement; its fault broker does not
                except (LearnerLost, RoleError):
                    pass  # lost or broken ranks hold no armed faults that could fire
            elif self.session.learner is self.learner:
                try:
                    self.local_learner.load_checkpoint_state(self.learner.checkpoint_state())
                except (LearnerLost, RoleError):
                    pass  # the run is failing anyway; the newest checkpoint holds the state
        finally:
            self.session.learner = self.local_learner
            if self.reward_pool is not None:
                self.session.reward_pool = self.local_pool
                self.reward_pool.close()
            for actor in [self.learner_actor, *self.actors]:
                if actor is not None:
                    ray.kill(actor, no_restart=True)
            self.relay.close()  # after the actors: every firing and recovery they handed over is recorded
            remove_placement_group(self.pg)
            if self._started:
                ray.shutdown()
