"""The hang watchdog: only the driver thread's phases are progress; what a waiting driver's report names.

The loops beat through the watchdog as their Heartbeat (rlctl.engine.heartbeat);
here the phases are opened by hand, on the test's main thread (the driver) and on
a stand-in producer thread.
"""

from __future__ import annotations

import threading
import time

import pytest

from rlctl.engine.heartbeat import NO_HEARTBEAT
from rlctl.incidents.watchdog import HangError, Watchdog


def _watch(reports: list[tuple[str, str, str]], stacks: list[str] | None = None) -> Watchdog:
    def on_hang(phase: str, role: str, thread: str, idle_s: float, stack: str) -> str:
        reports.append((phase, role, thread))
        if stacks is not None:
            stacks.append(stack)
        return f"hung in {phase}"

    dog = Watchdog(0.5, on_hang)
    dog.start()
    return dog


def _producer(dog: Watchdog, phase: str, role: str, stop: threading.Event, hold_s: float) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            with dog.phase(phase, role):
                stop.wait(hold_s)

    thread = threading.Thread(target=run, name=f"rollout-{phase}", daemon=True)
    thread.start()
    return thread


def _wait_for_threads_until_the_hang(dog: Watchdog) -> None:
    with pytest.raises(HangError):
        with dog.phase("generate", "rollout", waits_for_threads=True):
            time.sleep(60)  # interrupted by the watchdog


def test_producer_beats_do_not_mask_a_stuck_driver_phase():
    reports: list[tuple[str, str, str]] = []
    dog = _watch(reports)
    stop = threading.Event()
    producer = _producer(dog, "generate", "rollout", stop, hold_s=0.01)  # beats ~100 times a second
    try:
        with pytest.raises(HangError, match="hung in train"):
            with dog.phase("train", "learner"):
                time.sleep(60)  # interrupted by the watchdog
    finally:
        stop.set()
        dog.stop()
        producer.join()
    assert reports == [("train", "learner", "MainThread")]


def test_a_driver_waiting_for_threads_is_reported_with_the_longest_open_producer_phase_and_its_stack_first():
    """A stored prefix of the dump must show the hang: the culprit's frames come before every thread's dump."""
    reports: list[tuple[str, str, str]] = []
    stacks: list[str] = []
    stop = threading.Event()
    for i in range(40):  # bystanders: a worker pool, trackers' flushers, Ray's clients
        threading.Thread(target=stop.wait, name=f"bystander-{i}", daemon=True).start()
    dog = _watch(reports, stacks)
    grader = _producer(dog, "score", "reward", stop, hold_s=60)  # one grading call that never returns
    try:
        _wait_for_threads_until_the_hang(dog)
    finally:
        stop.set()
        dog.stop()
        grader.join()
    assert reports == [("score", "reward", "rollout-score")]
    [stack] = stacks
    assert stack.startswith("Culprit thread rollout-score")
    assert "test_watchdog.py" in stack[:2000]  # the producer's own frames, first
    assert len(stack) > 6000  # the full dump follows, so a tail would have missed the culprit


def test_a_driver_waiting_for_idle_threads_is_reported_with_its_own_phase():
    reports: list[tuple[str, str, str]] = []
    dog = _watch(reports)
    try:
        with pytest.raises(HangError):
            with dog.phase("generate", "rollout", waits_for_threads=True):
                time.sleep(60)
    finally:
        dog.stop()
    assert reports == [("generate", "rollout", "MainThread")]


def test_leaving_a_phase_puts_the_driver_back_in_the_loop():
    reports: list[tuple[str, str, str]] = []
    dog = _watch(reports)
    try:
        with dog.phase("save", "checkpoint"):
            pass
        with pytest.raises(HangError):
            time.sleep(60)
    finally:
        dog.stop()
    assert reports == [("loop", "driver", "MainThread")]


def test_without_a_watchdog_phases_do_nothing():
    with NO_HEARTBEAT.phase("train", "learner", waits_for_threads=True):
        pass


