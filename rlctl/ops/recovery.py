"""A run's guard: injected faults, recovery events, NaN rollback, live alerts and the hang watchdog.

What this is: ``RunGuard``, which ``rlctl.ops.train.execute`` starts around the
loop. It

- arms the run's injected faults (``faults.inject`` / ``rlctl inject``) from
  the fault plugins, recording every firing as a ``fault_injected`` event (a
  fault that already fired at a step never fires again when that step is
  re-run after a crash, restart or rollback);
- after each step, turns the recoveries roles reported (``oom_recovered``,
  ``rollout_server_lost``...) and the step's recovery counters (dropped
  groups, verifier retries, rollout worker failures) into registry events, so
  no recovery is silent;
- after ``faults.nan_rollback_after`` NaN/Inf-skipped steps in a row, rolls the
  session back to the newest committed checkpoint, lowers the learning rate by
  ``faults.rollback_lr_factor`` and requires the next step (the canary) to be
  finite; a failed canary or too many rollbacks stop the run with the runbook
  to open;
- evaluates the runbooks' triggers over a sliding window after every step
  (live alerts: shown in the progress display, recorded as ``alert`` events);
- runs a watchdog thread when ``faults.watchdog_timeout_s`` > 0: the loops
  (synchronous and overlapped) beat their phases through ``heartbeat``; a
  phase that makes no progress for that long is reported by role and phase
  with a faulthandler stack dump of every thread (``hang`` event) and the run
  stops with ``HangError`` instead of hanging.

What this is not: the loop (rlctl.engine.loop), the fault kinds (plugins), or
the recoveries that live in the roles themselves (OOM in the learner, verifier
retries and group drops in rlctl.engine.scoring / batching).
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from rlctl.contracts.errors import RlctlError, RoleError
from rlctl.engine.faults import ArmedFault, FaultContext, drain_recoveries, note_step, publish
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.ops.triggers import History

ALERT_WINDOW = 40  # steps of history the live alerts look at


class NanRollback(Exception):
    """Raised from the step observer: K NaN steps in a row, roll back before the next step."""


class HangError(RoleError):
    """A role made no progress within faults.watchdog_timeout_s."""


class RunGuard:
    """See the module docstring. ``run(loop, start_step)`` runs the loop with rollback handling."""

    def __init__(self, session: Any, run_id: str, directory: Path, registry: Any, plugins: Any,
                 warn: Callable[[str], None], start_step: int = 0) -> None:
        self.session, self.run_id, self.directory = session, run_id, directory
        self.registry, self.plugins, self.warn = registry, plugins, warn
        self.config = session.config.faults
        self._step = start_step  # the step running now (the fault window is checked against it)
        self.nan_streak = 0
        self.last_nan_count: float | None = None
        self.rollbacks = 0
        self.worker_failures = 0.0  # rollout_worker_failures already turned into events
        self.learner_restarts = 0.0  # learner_restarts (Ray: the learner actor died) already turned into events
        self.canary = False
        self._disarm: list[Callable[[], None]] = []
        self._num_armed = 0
        self.alerts = _Alerts(registry, run_id, warn, start_step) if self.config.alerts else None
        self.watchdog: Watchdog | None = None

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        note_step(value)  # faults armed in other processes (Ray actors) follow the driver's step

    # -- lifecycle -----------------------------------------------------------

    @property
    def heartbeat(self) -> Heartbeat:
        """What the loop beats through: the watchdog when ``faults.watchdog_timeout_s`` > 0, else a no-op."""
        return self.watchdog if self.watchdog is not None else NO_HEARTBEAT

    def start(self) -> "RunGuard":
        """Arm the faults and start the watchdog; call it on the thread that will run the loop."""
        self._arm_faults()
        if self.config.watchdog_timeout_s > 0:
            self.watchdog = Watchdog(self.config.watchdog_timeout_s, self._on_hang)
            self.watchdog.start()
        return self

    def close(self) -> None:
        for disarm in self._disarm:
            disarm()
        self._disarm.clear()
        if self.watchdog is not None:
            self.watchdog.stop()
        self._record_recoveries()

    def _arm_faults(self) -> None:
        fired: dict[int, set[int]] = {}
        if self.config.inject:
            for event in self.registry.events(self.run_id):
                data = event.data or {}
                if event.kind == "fault_injected" and isinstance(data.get("fault_index"), int):
                    fired.setdefault(data["fault_index"], set()).add(int(data.get("step", -1)))
        for i, spec in enumerate(self.config.inject):
            self._arm_one(i, spec, fired.get(i), f"faults.inject.{i}.options")
        self._num_armed = len(self.config.inject)

    def _arm_one(self, index: int, spec: Any, fired: set[int] | None, where: str) -> None:
        fault = self.plugins.build("fault", spec.kind, spec.options, where)
        armed = ArmedFault(index=index, kind=spec.kind, options=spec.options, where=where, at_step=spec.at_step,
                           count=_count(spec), rate=spec.rate, target=spec.target, seed=self.session.config.run.seed)
        ctx = FaultContext(kind=spec.kind, at_step=spec.at_step, count=armed.count, rate=spec.rate,
                           target=spec.target, options=spec.options, seed=armed.seed,
                           step=lambda: self.step, record=self._recorder(index), fired_steps=fired, index=index)
        self._disarm.append(fault.arm(ctx))
        self._disarm.append(publish(armed, ctx))  # a Ray placement re-arms it inside its actors

    def _arm_live(self) -> None:
        """Arm faults ``rlctl inject --run RUN`` dropped into ``<run_dir>/inject/`` while this run is training."""
        import json

        from rlctl.config.models import FaultSpec

        inbox = self.directory / "inject"
        if not inbox.is_dir():
            return
        for path in sorted(inbox.glob("*.json")):
            spec = FaultSpec.model_validate(json.loads(path.read_text(encoding="utf-8")))
            if spec.at_step < self.step:
                spec = spec.model_copy(update={"at_step": self.step})
            index = self._num_armed
            self._num_armed += 1
            self._arm_one(index, spec, None, f"{path}: options")
            path.rename(path.with_suffix(".armed"))
            self.registry.add_event(self.run_id, "fault_armed", f"armed {spec.kind} from step {spec.at_step} "
                                    f"(rlctl inject on the running run)", {"step": self.step, "fault_index": index,
                                                                           **spec.model_dump(mode="json")})

    def _recorder(self, index: int) -> Callable[[str, dict[str, Any]], None]:
        def record(message: str, data: dict[str, Any]) -> None:
            self.registry.add_event(self.run_id, "fault_injected", message, {"fault_index": index, **data})
        return record

    # -- after each step -----------------------------------------------------

    def on_step_end(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record recoveries, check the NaN streak and the canary, evaluate alerts; may raise NanRollback."""
        self.step = step + 1
        self._arm_live()
        events = self._record_recoveries(step, metrics)
        if self.alerts is not None:
            self.alerts.observe(step, metrics, events)
        self._check_nan(step, metrics)

    def _record_recoveries(self, step: int | None = None, metrics: Mapping[str, float] | None = None) -> list[Any]:
        recorded = []
        for kind, message, data in drain_recoveries():
            data = {"step": step, **data} if step is not None else data
            self.registry.add_event(self.run_id, kind, message, data)
            recorded.append(_Event(kind, message, data))
        m = metrics or {}
        for kind, counter, message, data in (
            ("groups_dropped", "groups_dropped",
             "dropped {groups_dropped} whole group(s) with a sample the grader could not score after "
             f"{self.config.verifier_retries} retries (not scored 0, not trained)",
             {"groups_dropped": "groups_dropped", "verifier_retries": "verifier_retries"}),
            ("verifier_retry", "verifier_retries",
             "{retries} grader retries with a fresh grader, {recovered} sample(s) recovered",
             {"retries": "verifier_retries", "recovered": "verifier_recovered"}),
        ):
            if m.get(counter, 0) > 0:
                values = {key: int(m.get(name, 0)) for key, name in data.items()}
                event = _Event(kind, f"step {step}: " + message.format(**values), {"step": step, **values})
                self.registry.add_event(self.run_id, kind, event.message, event.data)
                recorded.append(event)
        failures = m.get("rollout_worker_failures", 0)  # overlapped runs: a cumulative count per process
        if failures > self.worker_failures:
            lost, self.worker_failures = int(failures - self.worker_failures), failures
            event = _Event("rollout_worker_lost", f"step {step}: {lost} rollout worker failure(s); their in-flight "
                           f"prompts were re-queued ({int(m.get('requeued_prompts', 0))} so far) and the worker "
                           f"restarted before serving again", {"step": step, "failures": lost,
                                                               "requeued_prompts": int(m.get("requeued_prompts", 0))})
            self.registry.add_event(self.run_id, event.kind, event.message, event.data)
            recorded.append(event)
        restarts = m.get("learner_restarts", 0)  # overlapped runs: the learner actor died and was restored
        if restarts > self.learner_restarts:
            lost, self.learner_restarts = int(restarts - self.learner_restarts), restarts
            event = _Event("learner_restarted", f"step {step}: the learner died {lost} time(s); it was restarted, "
                           "restored from the newest committed checkpoint and the steps since were trained again",
                           {"step": step, "restarts": lost})
            self.registry.add_event(self.run_id, event.kind, event.message, event.data)
            recorded.append(event)
        return recorded

    def _check_nan(self, step: int, metrics: Mapping[str, float]) -> None:
        count = metrics.get("nan_inf_skipped_steps")
        if count is None:
            return
        skipped = self.last_nan_count is not None and count > self.last_nan_count
        self.last_nan_count = count
        if self.canary:
            self.canary = False
            if skipped:
                raise RoleError(f"the canary step {step} after a NaN rollback was NaN/Inf again",
                                "the run cannot recover by itself; see `rlctl runbook show reward-drop-or-nan`")
            self.registry.add_event(self.run_id, "canary_passed", f"canary step {step} after the rollback is finite",
                                    {"step": step})
        self.nan_streak = self.nan_streak + 1 if skipped else 0
        if self.nan_streak >= self.config.nan_rollback_after:
            raise NanRollback(step, step + 1 - self.nan_streak)

    # -- NaN rollback ------------------------------------------------------

    def run(self, loop: Callable[[int], dict[str, float]], start_step: int, checkpointer: Any = None
            ) -> dict[str, float]:
        """Run ``loop(first_step)``; on NanRollback restore the newest committed checkpoint and continue."""
        first = start_step
        while True:
            try:
                return loop(first)
            except NanRollback as stop:
                with self.heartbeat.phase("restore", "checkpoint"):
                    first = self._roll_back(int(stop.args[0]), int(stop.args[1]), checkpointer)

    def _last_good(self, before: int) -> tuple[str, Any, list[str]]:
        """The newest committed checkpoint taken before step ``before`` (the streak's first NaN step) that loads.

        Checkpoints taken during the streak hold skipped steps; they and any newer
        ones are moved to ``checkpoints/rolled-back/`` (their registry rows dropped),
        so the re-run steps can commit their own.
        """
        import os

        from rlctl.contracts.errors import CheckpointError
        from rlctl.engine.checkpoint import DiskCheckpointStore, load_checkpoint

        store = DiskCheckpointStore(self.directory / "checkpoints")
        chosen, skipped = None, []
        for path, manifest in reversed(store.list_committed()):
            if manifest.step <= before:
                try:
                    chosen = (path, load_checkpoint(path))
                    break
                except CheckpointError as err:
                    skipped.append(f"{Path(path).name}: {err.message}")
            aside = store.root / "rolled-back" / f"{Path(path).name}.{time.strftime('%Y%m%d-%H%M%S')}"
            aside.parent.mkdir(exist_ok=True)
            os.rename(path, aside)
            self.registry.delete_checkpoint(self.run_id, manifest.step)
            skipped.append(f"{Path(path).name} set aside in {aside}")
        if chosen is None:
            raise RoleError(f"{self.config.nan_rollback_after} NaN/Inf steps in a row and no committed checkpoint "
                            f"from before step {before} to roll back to",
                            "set checkpoint.every_steps; see `rlctl runbook show reward-drop-or-nan`")
        return chosen[0], chosen[1], skipped

    def _roll_back(self, step: int, streak_start: int, checkpointer: Any) -> int:
        from rlctl.contracts.roles import LrScalable
        from rlctl.engine.snapshot import restore

        hint = "see `rlctl runbook show reward-drop-or-nan`"
        k = self.config.nan_rollback_after
        if self.rollbacks >= self.config.max_rollbacks:
            raise RoleError(f"{k} NaN/Inf steps in a row again at step {step} after {self.rollbacks} rollback(s) "
                            f"(faults.max_rollbacks={self.config.max_rollbacks})", hint)
        if checkpointer is not None:
            checkpointer.close()
        path, state, skipped = self._last_good(streak_start)
        restore(self.session, state, self.session.config.checkpoint.shadow_tolerance)
        learner = self.session.learner
        new_lr = learner.scale_lr(self.config.rollback_lr_factor) if isinstance(learner, LrScalable) else None
        self.registry.delete_metrics_from(self.run_id, state.step)
        self.rollbacks += 1
        self.nan_streak = 0
        self.last_nan_count = float(state.learner.counters.get("nan_skips", 0))
        self.canary = True
        self.step = state.step
        self.registry.add_event(self.run_id, "nan_rollback", (
            f"{k} NaN/Inf steps in a row (last step {step}): rolled back to {Path(path).name}, learning rate x"
            f"{self.config.rollback_lr_factor:g}" + (f" = {new_lr:.3g}" if new_lr is not None else "")
            + "; the next step is the canary"), {"step": step, "to_step": state.step, "checkpoint": path,
                                                 "lr": new_lr, "rollbacks": self.rollbacks, "skipped": skipped})
        self.warn(f"NaN rollback #{self.rollbacks}: back to step {state.step} with a lower learning rate")
        return state.step

    # -- hang ----------------------------------------------------------------

    def _on_hang(self, phase: str, role: str, thread: str, idle_s: float, stack: str) -> str:
        dump = self.directory / f"hang-step{self.step}-{int(time.time())}.txt"
        try:
            dump.write_text(stack, encoding="utf-8")
        except OSError:
            dump = None  # type: ignore[assignment]
        message = (f"no progress for {idle_s:.0f}s: role {role}, rank 0, phase {phase}, step {self.step} "
                   f"(thread {thread})" + (f"; stack dump in {dump}" if dump else ""))
        try:
            self.registry.add_event(self.run_id, "hang", message, {
                "step": self.step, "role": role, "rank": 0, "phase": phase, "thread": thread, "idle_s": idle_s,
                "stack": stack[-6000:], "dump": str(dump) if dump else None})
        except RlctlError:
            pass  # the registry may be what hangs; the error below still names the phase
        return message


def _count(spec: Any) -> int | None:
    """Steps a fault spans: verifier faults and stragglers by default the whole run, others one step."""
    if "count" in spec.model_fields_set:
        return spec.count
    return None if spec.kind in ("verifier-timeout", "verifier-error") else spec.count


class _Event:
    def __init__(self, kind: str, message: str, data: Mapping[str, Any]) -> None:
        self.kind, self.message, self.data = kind, message, data


class _Alerts:
    """Live alerts: the runbook triggers over a sliding window, reported once when they start firing."""

    def __init__(self, registry: Any, run_id: str, warn: Callable[[str], None], start_step: int) -> None:
        from rlctl.ops.runbooks import load_runbooks

        self.registry, self.run_id, self.warn = registry, run_id, warn
        self.books = load_runbooks()
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.events: list[Any] = []
        self.active: set[tuple[str, str]] = set()
        if start_step:
            for p in registry.metrics(run_id):
                if p.step < start_step:
                    self.series.setdefault(p.name, []).append((p.step, p.value))

    def observe(self, step: int, metrics: Mapping[str, float], events: list[Any]) -> None:
        from rlctl.ops.triggers import evaluate

        for name, value in metrics.items():
            kept = [sv for sv in self.series.setdefault(name, []) if sv[0] < step][-ALERT_WINDOW:]
            self.series[name] = kept + [(step, float(value))]
        self.events = (self.events + [e for e in events])[-ALERT_WINDOW:]
        history = History(metrics=self.series, events=[e for e in self.events if (e.data or {}).get("step") == step])
        now = set()
        for book in self.books:
            for trigger in book.triggers:
                firing = evaluate(trigger, history)
                if firing is None or firing.last_step != step:
                    continue
                key = (book.name, trigger.id)
                now.add(key)
                if key in self.active:
                    continue
                message = f"[{trigger.severity}] {trigger.summary} ({firing.detail}); runbook {book.name}"
                self.warn(f"ALERT {message}")
                self.registry.add_event(self.run_id, "alert", message, {
                    "step": step, "runbook": book.name, "trigger": trigger.id, "severity": trigger.severity})
        self.active = now


class Watchdog:
    """Reports a phase of the loop that makes no progress within ``timeout_s`` (role, phase, stacks), then stops the run.

    The loops beat through it (it is the run's ``Heartbeat``,
    rlctl.engine.heartbeat): ``with watchdog.phase("train", "learner"): ...``
    around every call that can block on a role, in the synchronous loop and in
    the overlapped driver alike, so the phases are the same whatever objects a
    placement swapped in behind ``session.rollout`` / ``session.learner`` (a
    worker pool, a Ray actor handle). The timer runs on the driver thread (the
    one that started the watchdog and runs the loop): entering or leaving a
    phase there is progress; between phases the driver is in ``loop`` (role
    driver: advantages, logging, step-end observers), before its first phase
    in ``start``. A hang is the driver spending ``timeout_s`` in one phase.

    Beats from other threads (the overlapped run's rollout producers) never
    reset the timer; they only record what each thread is doing. Producers
    keep generating and grading while the learner trains -- that is what
    overlapping is for -- so if their beats counted as progress, a learner
    stuck in ``train`` would go unreported for as long as they have work (and
    a grader stuck in one producer would be masked by the others). The
    producers matter only when the driver waits for them: in a phase opened
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
                self._others[me] = entered
            try:
                yield
            finally:
                with self._lock:
                    self._others.pop(me, None)
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

    def _culprit(self, driver: _Phase) -> _Phase:
        """The driver's phase, or when it waits for other threads, the longest-open phase of one of them."""
        if not driver.waits_for_threads:
            return driver
        with self._lock:
            others = sorted(self._others.values(), key=lambda p: p.since)
        return others[0] if others else driver

    def _watch(self) -> None:
        import faulthandler
        import signal
        import tempfile

        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            driver = self._driver
            idle = time.monotonic() - driver.since
            if idle < self.timeout_s:
                continue
            culprit = self._culprit(driver)
            with tempfile.TemporaryFile("w+") as buf:
                faulthandler.dump_traceback(file=buf, all_threads=True)
                buf.seek(0)
                stack = buf.read()
            self._message = self.on_hang(culprit.name, culprit.role, culprit.thread, idle, stack)
            if self._main is not None and self._previous_handler is not None:
                signal.pthread_kill(self._main, signal.SIGUSR1)
            return

    def _raise_in_main(self, signum: int, frame: Any) -> None:
        raise HangError(self._message or "the watchdog found no progress",
                        "see `rlctl runbook show hang`; the stack dump is in the hang event (`rlctl runs show RUN`)")

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
