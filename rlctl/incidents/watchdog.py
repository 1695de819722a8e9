"""The hang watchdog: the run's heartbeat listener, which stops a run whose loop makes no progress.

What this is: ``Watchdog`` (a ``Heartbeat``, rlctl.engine.heartbeat, that the
loops beat through; its thread reports a driver phase that lasts longer than
``faults.watchdog_timeout_s``) and ``HangError``, what the run stops with.
rlctl.incidents.recovery.RunGuard starts it and records its report as a ``hang``
event.

What this is not: the loops' phases (rlctl.engine.loop, rlctl.engine.overlap
say where they are) or a per-request timeout (roles keep their own deadlines).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

from rlctl.contracts.errors import RoleError


class HangError(RoleError):
    """A role made no progress within faults.watchdog_timeout_s."""


class Watchdog:
    """Reports a loop phase without progress within ``timeout_s`` (role, phase, stacks), then stops the run.

    The loops beat through it (it is the run's ``Heartbeat``,
    rlctl.engine.heartbeat): ``with watchdog.phase("train", "learner"): ...``
    around every call that can block on a role, in the synchronous loop and in
    the overlapped driver alike, so the phases are the same whatever a
    placement built behind the roles (a fleet of rollout workers, a Ray actor
    handle). The timer runs on the driver thread (the
    one that started the watchdog and runs the loop): entering or leaving a
    phase there is progress; between phases the driver is in ``loop`` (role
    driver: advantages, logging, step-end observers), before its first phase
    in ``start``. A hang is the driver spending ``timeout_s`` in one phase.

    Beats from other threads (the overlapped run's rollout producers) never
    reset the timer; they only record what each thread is doing. Producers
    keep generating and grading while the learner trains -- that is what
    overlapping is for -- so if their beats counted as progress, a learner
    stuck in ``train`` would go unreported for as long as they have work, and
    a driver waiting on one stuck producer would be kept alive by the others'
    beats. The producers matter only when the driver waits for them (a
    producer stuck while others feed the async learner is not a hang of the
    run; its late groups meet the staleness bound): in a phase opened
    with ``waits_for_threads`` (the driver waiting for a batch of
    trajectories, ``generate`` / rollout) the report names the producer phase
    that has been open longest (``generate`` / rollout for a stuck rollout
    call, ``score`` / reward for a stuck grader, ``publish`` / rollout for a
    stuck weight load) and its thread, or the driver's own phase when no
    producer is inside a call. So the timeout bounds one driver phase: the
    wait for a batch must fit in it as one rollout call does in a sync run.

    On a timeout the watchdog thread dumps every thread's stack
    (faulthandler), calls ``on_hang(phase, role, thread, idle_s, stack)`` and
    raises HangError in the main thread (through a signal, so a blocking
    call there is interrupted too).
    """

    def __init__(self, timeout_s: float, on_hang: Callable[[str, str, str, float, str], str]) -> None:
        self.timeout_s = timeout_s
        self.on_hang = on_hang
        self._driver_ident = threading.get_ident()
        self._driver = _Phase("start", "driver", threading.current_thread().name)
        self._others: dict[int, _Phase] = {}  # thread ident -> the phase it is in (producer threads)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._message = ""
        self._thread = threading.Thread(target=self._watch, name="rlctl-watchdog", daemon=True)
        self._main = threading.main_thread().ident
        self._previous_handler: Any = None

    @contextlib.contextmanager
    def phase(self, name: str, role: str, *, waits_for_threads: bool = False) -> Iterator[None]:
        """The calling thread is in phase ``name``, waiting on ``role``, until the block ends."""
        me, thread = threading.get_ident(), threading.current_thread().name
        entered = _Phase(name, role, thread, waits_for_threads)
        if me != self._driver_ident:  # a producer: recorded, never progress (see the class docstring)
            with self._lock:
                outer_other = self._others.get(me)  # a phase inside another (scoring inside a stream)
                self._others[me] = entered
            try:
                yield
            finally:
                with self._lock:
                    if outer_other is None:
                        self._others.pop(me, None)
                    else:
                        self._others[me] = outer_other
            return
        outer, self._driver = self._driver, entered
        try:
            yield
        finally:
            self._driver = _Phase("loop", "driver", thread) if outer.name == "start" else outer.again()

    def start(self) -> None:
        """Start watching the calling thread (it runs the loop); a HangError interrupts it if it is the main one."""
        import signal

        self._driver_ident = threading.get_ident()
        self._driver = self._driver.again()
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGUSR1, self._raise_in_main)
        self._thread.start()

    def _culprit(self, driver: _Phase) -> tuple[int, _Phase]:
        """The driver's phase, or when it waits for other threads, the longest-open phase of one of them."""
        if not driver.waits_for_threads:
            return self._driver_ident, driver
        with self._lock:
            others = sorted(self._others.items(), key=lambda item: item[1].since)
        return others[0] if others else (self._driver_ident, driver)

    def _watch(self) -> None:
        import faulthandler
        import signal
        import tempfile

        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            driver = self._driver
            idle = time.monotonic() - driver.since
            if idle < self.timeout_s:
                continue
            ident, culprit = self._culprit(driver)
            with tempfile.TemporaryFile("w+") as buf:
                faulthandler.dump_traceback(file=buf, all_threads=True)
                buf.seek(0)
                stack = _culprit_first(ident, culprit.thread, buf.read())
            self._message = self.on_hang(culprit.name, culprit.role, culprit.thread, idle, stack)
            if self._main is not None and self._previous_handler is not None:
                signal.pthread_kill(self._main, signal.SIGUSR1)
            return

    @property
    def fired(self) -> bool:
        """Whether a hang was reported (the run is being stopped)."""
        return bool(self._message)

    def error(self) -> HangError:
        return HangError(self._message or "the watchdog found no progress",
                         "see `rlctl runbook show hang`; the stack dump is in the hang event (`rlctl runs show RUN`)")

    def _raise_in_main(self, signum: int, frame: Any) -> None:
        raise self.error()

    def stop(self) -> None:
        import signal

        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if self._previous_handler is not None:
            signal.signal(signal.SIGUSR1, self._previous_handler)
            self._previous_handler = None


class _Phase:
    """Where one thread is: phase and role, since when (monotonic), and whether it waits for other threads."""

    __slots__ = ("name", "role", "thread", "waits_for_threads", "since")

    def __init__(self, name: str, role: str, thread: str, waits_for_threads: bool = False) -> None:
        self.name, self.role, self.thread, self.waits_for_threads = name, role, thread, waits_for_threads
        self.since = time.monotonic()

    def again(self) -> "_Phase":
        """The same phase, entered now (the driver is back in it after an inner phase)."""
        return _Phase(self.name, self.role, self.thread, self.waits_for_threads)


def _culprit_first(ident: int, thread: str, stacks: str) -> str:
    """The culprit thread's stack, then every thread's: a truncated report still shows where the hang is.

    With many threads alive (a worker pool, a tracker's flusher, Ray's
    clients) the full dump runs to tens of kilobytes; whoever stores a prefix
    of it must still see the culprit's frames.
    """
    import sys
    import traceback

    frame = sys._current_frames().get(ident)
    if frame is None:
        return stacks
    lines = traceback.format_stack(frame)[::-1]  # most recent call first, as faulthandler prints them
    return f"Culprit thread {thread} (0x{ident:x}), most recent call first:\n{''.join(lines)}\n{stacks}"
