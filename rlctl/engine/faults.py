"""Fault injection points and the recovery report channel.

Fault sites. ``fault_site(site, value, **info)`` is called at the real place
where a failure happens (the learner's allocation before a micro-batch
forward, its loss, a grader call, a rollout call...). It does nothing unless a
fault is armed there (``arm``, done by rlctl.ops.faults from a run's
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

from typing import Any, Callable

_counts: dict[str, int] = {}
_lock = threading.Lock()
_sites: dict[str, list[Callable[..., Any]]] = {}
_recoveries: list[tuple[str, str, dict[str, Any]]] = []

Handler = Callable[..., Any]


class FaultContext:
    """What a fault plugin gets when it is armed: its spec, the current step, and a way to record firing.

    ``due()`` is True at most once per step inside the fault's window
    ``[at_step, at_step + count)``, and never again for a step that already
    fired in this run (also after a crash, restart or rollback re-runs that
    step: ``fired_steps`` comes from the run's recorded ``fault_injected``
    events). ``fire(message)`` records the firing synchronously before the
    fault acts, so even a SIGKILL leaves its event behind.
    """

    def __init__(self, *, kind: str, at_step: int, count: int | None, rate: float, target: str | None,
                 options: Any, seed: int, step: Callable[[], int], record: Callable[[str, dict[str, Any]], None],
                 fired_steps: set[int] | None = None) -> None:
        self.kind, self.at_step, self.rate, self.target, self.options = kind, at_step, rate, target, options
        self.count = count
        self.seed = seed
        self.step = step
        self._record = record
        self.fired_steps = set(fired_steps or ())
        self.num_fired = 0
        self._claim = threading.Lock()

    def in_window(self) -> bool:
        step = self.step()
        return step >= self.at_step and (self.count is None or step < self.at_step + self.count)

    def due(self) -> bool:
        return self.in_window() and self.step() not in self.fired_steps

    def take(self) -> bool:
        """``due()`` and claim the step in one go: True for exactly one caller per step, also when several
        rollout workers reach the fault site at once (checking ``due()`` then firing would let two fire)."""
        with self._claim:
            if not self.due():
                return False
            self.fired_steps.add(self.step())
            return True

    def fire(self, message: str, data: dict[str, Any] | None = None) -> None:
        step = self.step()
        self.fired_steps.add(step)
        self.num_fired += 1
        self._record(message, {"kind": self.kind, "step": step, **(data or {})})

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


def arm(site: str, handler: Handler) -> Callable[[], None]:
    """Arm ``handler(value, **info) -> value`` at ``site``; return a function that disarms it."""
    with _lock:
        _sites.setdefault(site, []).append(handler)

    def disarm() -> None:
        with _lock:
            if handler in _sites.get(site, []):
                _sites[site].remove(handler)

    return disarm


def report_recovery(kind: str, message: str, data: dict[str, Any] | None = None) -> None:
    """Record that a role recovered from a failure (drained into registry events by the run)."""
    with _lock:
        _recoveries.append((kind, message, dict(data or {})))


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
