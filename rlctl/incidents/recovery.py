"""A run's guard: injected faults, recovery events, NaN rollback, live alerts and the hang watchdog.

What this is: ``RunGuard``, which ``rlctl.lifecycle.train.execute`` starts around the
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
  run back to the newest committed checkpoint, lowers the learning rate by
  ``faults.rollback_lr_factor`` and requires the next step (the canary) to be
  finite; a failed canary or too many rollbacks stop the run with the runbook
  to open;
- evaluates the runbooks' triggers over a sliding window after every step
  (live alerts: shown in the progress display, recorded as ``alert`` events);
- runs the watchdog (rlctl.incidents.watchdog) when ``faults.watchdog_timeout_s``
  > 0: the loops (synchronous and overlapped) beat their phases through
  ``heartbeat``; a phase that makes no progress for that long is reported by
  role and phase with a faulthandler stack dump of every thread (``hang``
  event) and the run stops with ``HangError`` instead of hanging.

What this is not: the loop (rlctl.engine.loop), the fault kinds (plugins), or
the recoveries that live in the roles themselves (OOM in the learner, verifier
retries and group drops in rlctl.engine.scoring / batching).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping

from rlctl.contracts.errors import RlctlError, RoleError
from rlctl.engine.faults import ArmedFault, FaultContext, armed_counts, drain_recoveries, note_step, publish
from rlctl.engine.heartbeat import NO_HEARTBEAT, Heartbeat
from rlctl.engine.roles import ResumePoint
from rlctl.incidents.causes import EXPLAINED_IN_STEP, WALL_CLOCK_METRICS, machine_busy
from rlctl.incidents.triggers import History
from rlctl.incidents.watchdog import HangError, Watchdog

ALERT_WINDOW = 40  # steps of history the live alerts look at
REALERT_AFTER = 10  # quiet steps before a trigger that fires again is a new alert (not the same episode)


class NanRollback(Exception):
    """Raised from the step observer: K NaN steps in a row, roll back before the next step."""


class RunGuard:
    """See the module docstring. ``run(loop, start_step)`` runs the loop with rollback handling."""

    def __init__(self, roles: Any, run_id: str, directory: Path, registry: Any, plugins: Any,
                 warn: Callable[[str], None], start_step: int = 0) -> None:
        self.roles, self.run_id, self.directory = roles, run_id, directory
        self.registry, self.plugins, self.warn = registry, plugins, warn
        self.config = roles.config.faults
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
        ctx = FaultContext(kind=spec.kind, at_step=spec.at_step, count=_count(spec), rate=spec.rate,
                           target=spec.target, options=spec.options, seed=self.roles.config.run.seed,
                           step=lambda: self.step, record=self._recorder(index), fired_steps=fired, index=index)
        before = armed_counts()
        disarm = fault.arm(ctx)
        sites = tuple(sorted(site for site, n in armed_counts().items() if n > before.get(site, 0)))
        armed = ArmedFault(index=index, kind=spec.kind, options=spec.options, where=where, at_step=spec.at_step,
                           count=_count(spec), rate=spec.rate, target=spec.target, seed=self.roles.config.run.seed,
                           sites=sites)
        try:
            withdraw = publish(armed, ctx)  # a Ray placement re-arms it inside its actors
        except BaseException:
            disarm()  # a placement that cannot carry it refused it: armed nowhere
            raise
        self._disarm += [disarm, withdraw]

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
            try:
                self._arm_one(index, spec, None, f"{path}: options")
            except RoleError as err:  # this run's placement cannot carry it: the run goes on without it
                path.rename(path.with_suffix(".refused"))
                self.registry.add_event(self.run_id, "fault_refused", f"not armed: {err}",
                                        {"step": self.step, "fault_index": index, **spec.model_dump(mode="json")})
                self.warn(f"injected fault {spec.kind} not armed: {err.message}")
                continue
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
        tools = int(min(m.get("episode_dropped_groups", 0), m.get("groups_dropped", 0)))  # by cause
        retries = self.config.verifier_retries
        causes = [f"{tools} with an episode whose tool call failed after {retries} retries"] if tools else []
        if m.get("groups_dropped", 0) > tools:
            causes.append(f"{int(m['groups_dropped']) - tools} with a sample the grader could not score after "
                          f"{retries} retries")
        for kind, counter, message, data in (
            ("groups_dropped", "groups_dropped",
             "dropped {groups_dropped} whole group(s): " + "; ".join(causes) + " (not scored 0, not trained)",
             {"groups_dropped": "groups_dropped", "tool_groups": "episode_dropped_groups",
              "verifier_retries": "verifier_retries"}),
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

    def run(self, loop: Callable[[ResumePoint], dict[str, float]], start: ResumePoint, checkpointer: Any = None
            ) -> dict[str, float]:
        """Run ``loop(start)``; on NanRollback restore the newest committed checkpoint and continue from it."""
        first = start
        while True:
            try:
                return loop(first)
            except NanRollback as stop:
                with self.heartbeat.phase("restore", "checkpoint"):
                    first = self._roll_back(int(stop.args[0]), int(stop.args[1]), checkpointer)
            except BaseException as err:
                if self.watchdog is not None and self.watchdog.fired and not isinstance(err, HangError):
                    # the watchdog's HangError can surface mangled when its signal lands inside C code (in a
                    # Ray call it became a SystemError): report the hang, keep what surfaced as the cause
                    raise self.watchdog.error() from err
                raise

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

    def _roll_back(self, step: int, streak_start: int, checkpointer: Any) -> ResumePoint:
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
        report = restore(self.roles, state, self.roles.config.checkpoint.shadow_tolerance)
        learner = self.roles.learner
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
        return report.resume

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
                "stack": stack[:6000], "dump": str(dump) if dump else None})
        except RlctlError:
            pass  # the registry may be what hangs; the error below still names the phase
        return message


def _count(spec: Any) -> int | None:
    """Steps a fault spans: verifier and tool faults and stragglers by default the whole run, others one step."""
    if "count" in spec.model_fields_set:
        return spec.count
    return None if spec.kind in ("verifier-timeout", "verifier-error", "tool-timeout", "tool-error") else spec.count


class _Event:
    def __init__(self, kind: str, message: str, data: Mapping[str, Any]) -> None:
        self.kind, self.message, self.data = kind, message, data


class _Alerts:
    """Live alerts: the runbook triggers over a sliding window, reported when they start firing.

    A trigger that keeps firing, or falls silent for a few steps and fires again (a noisy series flickering
    at its bound), is one episode and one report; it is reported again only after ``REALERT_AFTER`` quiet
    steps, or when the run went back to an earlier step (a rollback or resume).
    """

    def __init__(self, registry: Any, run_id: str, warn: Callable[[str], None], start_step: int) -> None:
        from rlctl.incidents.runbooks import load_runbooks

        self.registry, self.run_id, self.warn = registry, run_id, warn
        self.books = load_runbooks()
        self.series: dict[str, list[tuple[int, float]]] = {}
        self.events: list[Any] = []
        self.last_fired: dict[tuple[str, str], int] = {}  # trigger -> the last step it fired at
        if start_step:
            for p in registry.metrics(run_id):
                if p.step < start_step:
                    self.series.setdefault(p.name, []).append((p.step, p.value))

    def observe(self, step: int, metrics: Mapping[str, float], events: list[Any]) -> None:
        from rlctl.incidents.triggers import evaluate

        for name, value in metrics.items():
            kept = [sv for sv in self.series.setdefault(name, []) if sv[0] < step][-ALERT_WINDOW:]
            self.series[name] = kept + [(step, float(value))]
        self.events = (self.events + [e for e in events])[-ALERT_WINDOW:]
        history = History(metrics=self.series, events=[e for e in self.events if (e.data or {}).get("step") == step])
        fired = [(book, trigger, firing) for book in self.books for trigger in book.triggers
                 if (firing := evaluate(trigger, history)) is not None and firing.last_step == step]
        firing_books = {book.branch_of(trigger): book.name for book, trigger, _ in fired}
        for book, trigger, firing in fired:
            key = (book.name, trigger.id)
            last, self.last_fired[key] = self.last_fired.get(key), step
            if last is not None and 0 < step - last <= REALERT_AFTER:
                continue  # the same episode
            message = f"[{trigger.severity}] {trigger.summary} ({firing.detail}); runbook {book.name}"
            data = {"step": step, "runbook": book.name, "trigger": trigger.id, "severity": trigger.severity}
            if trigger.metric in WALL_CLOCK_METRICS and (busy := machine_busy(firing, history)):
                message += f"; {busy}"  # a busy machine, not the engine (rlctl.incidents.causes)
            cause, moved = EXPLAINED_IN_STEP.get(book.branch_of(trigger), ("", frozenset()))
            if trigger.metric in moved and cause in firing_books:  # as `rlctl diagnose` ranks it
                message += (f"; follows {firing_books[cause]}, firing at this step (its failures leave samples "
                            "unscored in the same step): likely a consequence, fix that first")
                data["follows"] = firing_books[cause]
            self.warn(f"ALERT {message}")
            self.registry.add_event(self.run_id, "alert", message, data)
