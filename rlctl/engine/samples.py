"""A few of each logged step's trained samples, kept in the run directory to be looked at later.

What this is: ``SampleLog``, which the run adds beside its metric sinks: at
every step the sinks get (``StepEnd.log``), it writes the step's first
trained samples to ``<run_dir>/samples.jsonl``, one line
``{"step": s, "samples": [trajectory, ...]}`` with each Trajectory as the
queue log writes it (rlctl.engine.queue_log.trajectory_to_dict: token ids,
action mask, behaviour log-probs, rewards and, for a multi-turn episode, its
turns with writer, span, policy version, tool, tool status, tool seconds and
per-turn reward), so a renderer can show an episode turn by turn with the
policy's and the environment's tokens apart. A re-run step replaces its line
(rlctl.storage.step_lines). ``read_samples`` reads them back as
Trajectories, checksums verified.

What this is not: a renderer (the CLI's), or a record of every sample (the
queue's log holds those while they are needed).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from rlctl.contracts.types import Trajectory
from rlctl.engine.queue_log import trajectory_from_dict, trajectory_to_dict
from rlctl.storage.step_lines import StepLines

FILE = "samples.jsonl"


class SampleLog:
    """Writes up to ``per_step`` trained samples (whole groups first) of each logged step to ``samples.jsonl``.

    It sits in the run's list of sinks (closed with them; ``write`` of metrics
    does nothing); ``StepEnd.log`` calls ``write_samples``.
    """

    def __init__(self, run_dir: str | Path, per_step: int = 8) -> None:
        self.per_step = per_step
        self._lines = StepLines(Path(run_dir) / FILE)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        return None

    def write_samples(self, step: int, trajectories: Sequence[Trajectory]) -> None:
        self._lines.write(step, {"samples": [trajectory_to_dict(t) for t in trajectories[:self.per_step]]})

    def close(self) -> None:
        self._lines.close()


def read_samples(run_dir: str | Path) -> Iterator[tuple[int, list[Trajectory]]]:
    """``(step, trajectories)`` per line of ``<run_dir>/samples.jsonl`` in file (step) order; none if absent."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            try:
                body = json.loads(line)
            except ValueError:  # a torn last line from a crash
                return
            yield int(body["step"]), [trajectory_from_dict(t) for t in body["samples"]]
