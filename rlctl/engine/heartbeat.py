"""Progress beats: the loops say which phase of a step they are in and which role they wait on.

What this is: the ``Heartbeat`` protocol the loops call around every call
that can block on another role (``with heartbeat.phase("train", "learner"):
...``), and ``NO_HEARTBEAT``, the default that does nothing. Both the
synchronous loop (rlctl.engine.loop, rlctl.engine.groups) and the
overlapped driver (rlctl.engine.overlap: the driver thread and its rollout
producer threads) beat through the one object they are given, so a watcher
sees the same phases whatever a placement built behind the roles (a fleet of
rollout workers, a Ray actor handle).

Phases (``name``, with the ``role`` the caller waits on):

- ``generate`` (rollout): a rollout call; in an overlapped run the driver's
  wait for a batch of trajectories from the producer threads, opened with
  ``waits_for_threads=True``;
- ``score`` (reward): grading a rollout's samples (retries included);
- ``train`` (learner, or critic): the learner's (critic's) update, with the
  log-prob pass an overlapped step may need before it;
- ``publish`` (learner: exporting the weights; rollout: handing them to the
  rollout side, or a producer loading them);
- ``save`` (checkpoint): the checkpoint after a step;
- ``restore`` (learner): an overlapped run bringing a lost learner back;
  (checkpoint): a NaN rollback loading the last good checkpoint;
- ``start`` (placement): an overlapped run starting its rollout workers (on
  Ray: the cluster, placement group and actors).

Between phases the loop does its own work (advantages, logging, step-end
observers); a watcher calls that ``loop`` (role driver).

What this is not: the watchdog that acts on the beats (rlctl.incidents.recovery),
or a profiler (phase timings are metrics, rlctl.engine.metrics).
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Protocol


class Heartbeat(Protocol):
    """Told when the calling thread enters and leaves a phase of the loop.

    ``waits_for_threads``: the caller blocks on work other threads of this
    process do (the overlapped driver waiting for its rollout producers), so a
    watcher may name what those threads are doing.

    Example::

        with heartbeat.phase("save", "checkpoint"):
            checkpoint.after_step(step + 1, metrics)
    """

    def phase(self, name: str, role: str, *, waits_for_threads: bool = False) -> ContextManager[None]: ...


class _Silent:
    """The heartbeat of a run without a watcher: every phase is a no-op."""

    def phase(self, name: str, role: str, *, waits_for_threads: bool = False) -> ContextManager[None]:
        return contextlib.nullcontext()


NO_HEARTBEAT: Heartbeat = _Silent()
