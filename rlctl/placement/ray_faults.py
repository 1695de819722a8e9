"""The run's injected faults across Ray actors: the broker actor and the driver's relay to it.

What this is: ``FaultBroker`` (a named actor holding the run's plan -- its
armed faults, rlctl.engine.faults -- the driver's step and each fault's fired
steps) and ``FaultRelay``, its driver side. Every actor arms the broker's plan
in its own process when it starts (rlctl.placement.ray_actors.arm_faults), so
``learner.*`` faults fire in the learner actor, ``rollout.generate`` in the
rollout actors and ``verifier.score`` in the reward actors. A fault the run
arms -- at its start, or while it trains (``rlctl inject --run RUN``: the run
guard publishes it at a step end) -- is added to the broker's plan and every
live actor arms the plan again: the learner before the driver goes on, a
rollout or reward actor before its next call (Ray runs one caller's calls to
an actor in order). An actor Ray restarts arms the broker's plan as it is then.

The broker is also the arbiter: it holds the driver's step (pushed by the run
guard on every change, before the next step starts) and each fault's fired
steps, so a step fires once across the driver and every actor
(``FaultContext.take`` claims it there, atomically), and a fault that fired in
an actor hands its record to the broker before it acts (a SIGKILL leaves it
behind); the driver records those as ``fault_injected`` events at every step
end and when the run closes. Recoveries an actor reports itself
(``report_recovery``: the learner's OOM retry) travel through the same broker
into the driver's registry events.

What this is not: the fault kinds (plugins) or the actors (rlctl.placement.ray_actors).
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Any, Callable, Sequence

import ray
from ray.exceptions import GetTimeoutError

from rlctl.contracts.errors import RoleError
from rlctl.engine.faults import ArmedFault, FaultContext, on_publish, on_step, report_recovery
from rlctl.placement.ray_actors import BrokerClaims
from rlctl.placement.ray_cluster import LOST, READY_TIMEOUT_S


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


def armed(who: str, ref: Any, timeout: float | None) -> None:
    """Wait for an actor's ``arm`` call; a lost actor is fine (restarted, it arms the broker's plan), any other
    failure is a RoleError naming the actor."""
    try:
        ray.get(ref, timeout=timeout)
    except LOST:
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


class FaultRelay:
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
        self.claims = BrokerClaims(name, self.broker)
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
            self.sync(ctx.step())  # the driver's step now (a resumed run's first fault arms at its start step)
            if self.rearm is not None:
                self._arming.update(self.rearm())

    def _broker_call(self, ref: Any) -> Any:
        try:
            return ray.get(ref, timeout=READY_TIMEOUT_S)
        except (*LOST, GetTimeoutError) as err:
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
            armed(who, ref, None)

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
