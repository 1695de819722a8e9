"""Fault injection points and the recovery report channel.

Fault sites. ``fault_site(site, value, **info)`` is called at the real place
where a failure happens (the learner's allocation before a micro-batch
forward, its loss, a grader call, a rollout call...). It does nothing unless a
fault is armed there (``arm``, done by rlctl.incidents.recovery from a run's
``faults:`` config or ``rlctl inject``); an armed handler may raise the real
exception (``torch.OutOfMemoryError``, ``TimeoutError``), kill the process, or
return a replacement for ``value`` (a poisoned loss). Sites: ``learner.alloc``,
``learner.loss``, ``learner.train_step``, ``verifier.score``,
``rollout.generate``, ``checkpoint.committed``, ``weights.write`` (a shard
write of a weight publish), and in the ``sglang`` backend
``rollout.connect`` (the URL an HTTP call goes to), ``rollout.dispatch``
(before a step's prompt groups go to the servers) and ``weights.published``
(a committed version before the servers load it).

Recovery reports. Roles (plugins included) call ``report_recovery(kind,
message, data)`` when they recover from a failure on their own (an OOM retried
with a smaller micro-batch); the run bookkeeping drains them after each step
with ``drain_recoveries`` and records each as a registry event, so no recovery
is silent.

Faults in other processes. A placement that runs roles in other processes
(rlctl.placement.ray_faults) re-arms the run's faults there: ``armed_plan()`` lists every
fault armed in this process (``publish``, done by the run guard) with the
spec needed to build it again, and ``arm_plan`` arms that plan in the other
process with FaultContexts bound to a ``SharedClaims`` (an arbiter all
processes reach: the current step, and the fired/claimed steps of each
fault). ``share`` binds this process's contexts to the same arbiter, so
``take()`` stays once per step across every process, and ``note_step``
(called by the run guard whenever its step changes) lets the arbiter follow
the driver's step before the next step starts. ``on_publish`` tells such a
placement about a fault armed while it runs (``rlctl inject --run RUN`` on a
running run), so it arms that fault in its processes too.
``forward_recoveries`` sends the recovery reports of such a process to the
driver the same way.

Named crash points (below) are the older test hook that SIGKILLs rlctl at a
chosen checkpoint-protocol boundary.

What this is: ``crash_point(point, detail)``, called at every write boundary
of the checkpoint commit protocol (rlctl.engine.checkpoint). When the
environment variable ``RLCTL_CRASH_AT`` names that boundary, the process
kills itself with SIGKILL: no cleanup handler, no flush, exactly like a power
cut of the process (recovery is tested against real faults, not simulated ones).

    RLCTL_CRASH_AT=POINT[:DETAIL][@N]

POINT is a boundary name (e.g. ``ckpt.manifest_tmp``); DETAIL, if given, must
equal the boundary's detail (e.g. a file name); N (default 1) fires on the
N-th time this process reaches the matching boundary. The boundaries are
listed in rlctl.engine.checkpoint's docstring.

What this is not: a user-facing setting. It is a test hook; this function is
the only place in the engine that reads the environment, and it does nothing
when the variable is unset.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

_counts: dict[str, int] = {}
_lock = threading.Lock()
_sites: dict[str, list[Callable[..., Any]]] = {}
_recoveries: list[tuple[str, str, dict[str, Any]]] = []
_plan: dict[int, tuple["ArmedFault", "FaultContext"]] = {}
_step_listeners: list[Callable[[int], None]] = []
_publish_listeners: list[Callable[["ArmedFault", "FaultContext"], None]] = []

Handler = Callable[..., Any]


class SharedClaims(Protocol):
    """An arbiter every process of a run reaches: the driver's step and each fault's fired steps."""

    def step(self) -> int:
        """The step the driver is running now."""

    def fired(self, index: int, step: int) -> bool:
        """Whether fault ``index`` already fired (or was claimed) at ``step``."""

    def claim(self, index: int, step: int) -> bool:
        """Mark ``step`` fired for fault ``index``; True only for the first caller (atomic across processes)."""

    def mark(self, index: int, step: int, event: tuple[str, dict[str, Any]] | None) -> None:
        """Mark ``step`` fired; ``event`` (message, data) is handed to the driver, which records it."""


class FaultContext:
    """What a fault plugin gets when it is armed: its spec, the current step, and a way to record firing.

    ``due()`` is True at most once per step inside the fault's window
    ``[at_step, at_step + count)``, and never again for a step that already
    fired in this run (also after a crash, restart or rollback re-runs that
    step: ``fired_steps`` comes from the run's recorded ``fault_injected``
    events). ``fire(message)`` records the firing synchronously before the
    fault acts, so even a SIGKILL leaves its event behind.

    Bound to ``SharedClaims`` (``index`` is the fault's place in the run's
    plan), the fired steps live with the arbiter, so the once-per-step rule
    holds across processes; a context with ``remote=True`` (armed in another
    process) hands its firing records to the arbiter instead of recording them.
    """

    def __init__(self, *, kind: str, at_step: int, count: int | None, rate: float, target: str | None,
                 options: Any, seed: int, step: Callable[[], int], record: Callable[[str, dict[str, Any]], None],
                 fired_steps: set[int] | None = None, index: int = 0, claims: SharedClaims | None = None,
                 remote: bool = False) -> None:
        self.kind, self.at_step, self.rate, self.target, self.options = kind, at_step, rate, target, options
        self.count = count
        self.seed = seed
        self.step = step
        self.index = index
        self._record = record
        self.fired_steps = set(fired_steps or ())
        self.num_fired = 0
        self._claim = threading.Lock()
        self._claims = claims
        self._remote = remote

    def share(self, claims: SharedClaims | None) -> None:
        """Bind this context's fired steps to ``claims`` (None: back to this process's own set)."""
        self._claims = claims

    def in_window(self) -> bool:
        return self._in_window(self.step())

    def _in_window(self, step: int) -> bool:
        return step >= self.at_step and (self.count is None or step < self.at_step + self.count)

    def due(self) -> bool:
        return self._open(self.step())

    def _open(self, step: int) -> bool:
        if not self._in_window(step) or step in self.fired_steps:
            return False
        return self._claims is None or not self._claims.fired(self.index, step)

    def take(self) -> bool:
        """``due()`` and claim the step in one go: True for exactly one caller per step, also when several
        rollout workers reach the fault site at once (checking ``due()`` then firing would let two fire), and
        across processes when the context is bound to ``SharedClaims``."""
        with self._claim:
            step = self.step()  # read once: another process's step may move on while this claims
            if not self._open(step):
                return False
            if self._claims is not None and not self._claims.claim(self.index, step):
                return False
            self.fired_steps.add(step)
            return True

    def fire(self, message: str, data: dict[str, Any] | None = None) -> None:
        step = self.step()
        self.fired_steps.add(step)
        self.num_fired += 1
        data = {"kind": self.kind, "step": step, **(data or {})}
        if self._remote and self._claims is not None:
            self._claims.mark(self.index, step, (message, data))  # synchronous: the arbiter holds it before we act
            return
        self._record(message, data)
        if self._claims is not None:
            self._claims.mark(self.index, step, None)

    def accept(self, message: str, data: dict[str, Any]) -> None:
        """Record a firing of this fault that a context in another process handed to the arbiter."""
        self.fired_steps.add(int(data.get("step", -1)))
        self.num_fired += 1
        self._record(message, data)

    def chance(self, key: str) -> bool:
        """A deterministic coin with probability ``rate`` for ``key`` (same seed and key, same answer)."""
        import hashlib

        digest = hashlib.sha256(f"{self.seed}/{self.kind}/{key}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < self.rate


def fault_site(site: str, value: Any = None, **info: Any) -> Any:
    """Run the handlers armed at ``site`` (each may raise, or return a replacement for ``value``)."""
    handlers = _sites.get(site)
    if not handlers:
        return value
    for handler in tuple(handlers):
        value = handler(value, **info)
    return value


def armed_counts() -> dict[str, int]:
    """Handlers armed per site now (compare before and after arming a fault: the sites it uses)."""
    with _lock:
        return {site: len(handlers) for site, handlers in _sites.items()}


def arm(site: str, handler: Handler) -> Callable[[], None]:
    """Arm ``handler(value, **info) -> value`` at ``site``; return a function that disarms it."""
    with _lock:
        _sites.setdefault(site, []).append(handler)

    def disarm() -> None:
        with _lock:
            if handler in _sites.get(site, []):
                _sites[site].remove(handler)

    return disarm


@dataclass(frozen=True, slots=True, kw_only=True)
class ArmedFault:
    """What another process needs to arm one fault of the run again (picklable)."""

    index: int
    kind: str
    options: Any
    where: str
    at_step: int
    count: int | None
    rate: float
    target: str | None
    seed: int
    sites: tuple[str, ...] = ()  # where it armed in the driver (``armed_counts`` before / after)


def publish(fault: ArmedFault, ctx: FaultContext) -> Callable[[], None]:
    """List ``fault`` (armed here with ``ctx``) in ``armed_plan()`` and tell every ``on_publish`` listener;
    return a function that withdraws it from the list."""

    def withdraw() -> None:
        with _lock:
            if _plan.get(fault.index, (None, None))[1] is ctx:
                del _plan[fault.index]

    with _lock:
        _plan[fault.index] = (fault, ctx)
        listeners = tuple(_publish_listeners)
    try:
        for listener in listeners:
            listener(fault, ctx)
    except BaseException:
        withdraw()  # not armed everywhere: not listed as armed
        raise
    return withdraw


def armed_plan() -> list[tuple[ArmedFault, FaultContext]]:
    """Every published fault armed in this process with its context, by index."""
    with _lock:
        return [_plan[i] for i in sorted(_plan)]


def arm_plan(plan: Sequence[ArmedFault], claims: SharedClaims, build: Callable[[ArmedFault], Any]) -> Callable[[], None]:
    """Arm ``plan`` in this process (``build(fault)`` returns the fault plugin) bound to ``claims``."""
    disarms = []
    for fault in plan:
        ctx = FaultContext(kind=fault.kind, at_step=fault.at_step, count=fault.count, rate=fault.rate,
                           target=fault.target, options=fault.options, seed=fault.seed, step=claims.step,
                           record=_unrecorded, index=fault.index, claims=claims, remote=True)
        disarms.append(build(fault).arm(ctx))

    def disarm_all() -> None:
        for disarm in disarms:
            disarm()

    return disarm_all


def _unrecorded(message: str, data: dict[str, Any]) -> None:
    raise AssertionError("a remote fault context records through its SharedClaims")


def note_step(step: int) -> None:
    """The driver's step changed (called by the run guard): tell every listener (a placement's arbiter)."""
    for listener in tuple(_step_listeners):
        listener(step)


def _subscribe(listeners: list[Any], listener: Any) -> Callable[[], None]:
    """Add ``listener`` to ``listeners``; return a function that removes it."""
    with _lock:
        listeners.append(listener)

    def remove() -> None:
        with _lock:
            if listener in listeners:
                listeners.remove(listener)

    return remove


def on_step(listener: Callable[[int], None]) -> Callable[[], None]:
    """Call ``listener(step)`` on every ``note_step``; return a function that removes it."""
    return _subscribe(_step_listeners, listener)


def on_publish(listener: Callable[[ArmedFault, FaultContext], None]) -> Callable[[], None]:
    """Call ``listener(fault, ctx)`` on every later ``publish`` (a fault armed mid-run); return a function that
    removes it. A listener's error propagates to the caller of ``publish``: the fault could not be armed
    everywhere."""
    return _subscribe(_publish_listeners, listener)


def report_recovery(kind: str, message: str, data: dict[str, Any] | None = None) -> None:
    """Record that a role recovered from a failure (drained into registry events by the run).

    In a role's own process (a Ray actor) the report goes to the sink set with
    ``forward_recoveries``, which hands it to the driver.
    """
    sink = _recovery_sink
    if sink is not None:
        sink(kind, message, dict(data or {}))
        return
    with _lock:
        _recoveries.append((kind, message, dict(data or {})))


_recovery_sink: Callable[[str, str, dict[str, Any]], None] | None = None


def forward_recoveries(sink: Callable[[str, str, dict[str, Any]], None] | None) -> None:
    """Send this process's recovery reports to ``sink`` (None: keep them here for ``drain_recoveries``)."""
    global _recovery_sink
    _recovery_sink = sink


def drain_recoveries() -> list[tuple[str, str, dict[str, Any]]]:
    """Every recovery reported since the last drain, oldest first."""
    with _lock:
        out = list(_recoveries)
        _recoveries.clear()
    return out


def crash_point(point: str, detail: str = "") -> None:
    """SIGKILL this process if ``RLCTL_CRASH_AT`` names this boundary (test / fault-injection hook)."""
    spec = os.environ.get("RLCTL_CRASH_AT")
    if not spec:
        return
    target, _, nth = spec.partition("@")
    want_point, _, want_detail = target.partition(":")
    if want_point != point or (want_detail and want_detail != detail):
        return
    with _lock:
        _counts[target] = seen = _counts.get(target, 0) + 1
    if seen == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
