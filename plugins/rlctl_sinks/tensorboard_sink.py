"""TensorBoard metric sink: one scalar per metric per logged step, in event files under the run dir.

What this is: a MetricSink writing ``<run_dir>/tensorboard/events.out.tfevents.*``
with torch's SummaryWriter (the ``tensorboard`` package's event format); the tag
of each scalar is the metric name unchanged and its step is the RL step.
Every write is flushed, so a crash loses at most the step being written.

Resume: the writer is opened at the first step written with TensorBoard's
purge step, so the values an earlier attempt logged at that step and later are
hidden by TensorBoard's readers (its own purge of orphaned data): each step
shows once, like the JSONL sink.

What this is not: a reader (tensorboard's EventAccumulator reads the files).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlctl_sinks._common import require_extra


class TensorBoardOptions(BaseModel):
    """Options of the "tensorboard" metric sink."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    log_dir: str = Field("tensorboard", description="Event file directory: relative to the run dir, or absolute.")

    @model_validator(mode="after")
    def _installed(self) -> "TensorBoardOptions":
        require_extra("tensorboard", "tensorboard", "tensorboard")
        return self


class TensorBoardSink:
    def __init__(self, run_dir: str | Path, options: TensorBoardOptions | None = None) -> None:
        options = options or TensorBoardOptions()
        self.log_dir = Path(run_dir) / options.log_dir  # an absolute log_dir replaces run_dir
        self._writer: Any = None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides what an earlier attempt logged at steps >= this one (resume)
            self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=step)
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
