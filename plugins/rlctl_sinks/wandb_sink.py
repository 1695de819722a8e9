"""Weights & Biases metric sink, offline only: the run's metrics by step in W&B's local run files.

What this is: a MetricSink that runs ``wandb.init(mode="offline")`` with
WANDB_MODE=offline set for its lifetime, so it never opens a network
connection and never needs a login. The run is written under
``<run_dir>/wandb/offline-run-*-<rlctl run id>/`` (the ``.wandb`` transaction
log); upload it later with ``wandb sync <that dir>``. Every metric is logged
under its own name with the RL step as W&B's step; the run's config holds
rlctl's provenance (run id, config hash, code and dataset version, seed).
W&B's console capture, git probing, code saving and system stats are off.

Resume: the same W&B run id (the rlctl run id) is continued, in a new offline
directory. W&B keeps history steps increasing, so the sink reads the earlier
offline logs of this run with W&B's own reader (``wandb leet inspect --json``)
and does not log steps up to the highest one they hold: every step appears
once, with the first attempt's values.

What this is not: an online client (no ``mode`` option; sync is a separate, explicit step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlctl_sinks._common import ending, require_extra, run_params

_EXIT_CODE = {"finished": 0, "failed": 1, "interrupted": 130}
_QUIET = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}


class WandbOptions(BaseModel):
    """Options of the "wandb" metric sink."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    project: str = Field("rlctl", min_length=1, description="W&B project the run is synced to later.")
    dir: str | None = Field(None, description="Where W&B writes its wandb/ folder; default the run dir.")

    @model_validator(mode="after")
    def _installed(self) -> "WandbOptions":
        require_extra("wandb", "wandb", "wandb")
        return self


def offline_logs(root: str | Path, run_id: str) -> list[Path]:
    """The ``.wandb`` transaction logs of earlier offline attempts of this run, oldest first."""
    return sorted(Path(root).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def read_records(log: str | Path) -> Iterator[dict[str, Any]]:
    """Every record of a ``.wandb`` log, as W&B's own reader (``wandb leet inspect --json``) prints it."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
                         capture_output=True, text=True, check=True, timeout=300,
                         env={**os.environ, **_QUIET})
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            yield json.loads(line)


def history(log: str | Path) -> dict[int, dict[str, Any]]:
    """step -> the metrics logged at that step (W&B's own ``_step``/``_runtime``/``_timestamp`` dropped)."""
    steps: dict[int, dict[str, Any]] = {}
    for record in read_records(log):
        if record.get("type") == "history":
            item = record["history"]["item"]
            steps[int(item["_step"])] = {k: v for k, v in item.items() if not k.startswith("_")}
    return steps


class WandbSink:
    def __init__(self, run_dir: str | Path, run_id: str,
                 options: WandbOptions | None = None) -> None:
        options = options or WandbOptions()
        root = Path(options.dir) if options.dir else Path(run_dir)
        root.mkdir(parents=True, exist_ok=True)
        self.logged_through = max((max(history(log), default=-1) for log in offline_logs(root, run_id)), default=-1)
        self._saved_env = {k: os.environ.get(k) for k in _QUIET}
        os.environ.update(_QUIET)
        import wandb

        settings = wandb.Settings(mode="offline", console="off", disable_git=True, save_code=False,
                                  x_disable_stats=True, silent=True)
        params = run_params(run_dir, run_id)
        self.run = wandb.init(project=options.project, id=run_id, name=params.get("run_name", run_id),
                              dir=str(root), mode="offline", resume="allow", config=params, settings=settings,
                              reinit="create_new")
        self.log_path = Path(self.run.dir).parent / f"run-{run_id}.wandb"

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step <= self.logged_through:
            return  # the earlier attempt of a resumed run logged this step already
        self.run.log({name: float(value) for name, value in metrics.items()}, step=step)

    def close(self) -> None:
        if self.run is None:
            return
        code = _EXIT_CODE[ending()]
        try:
            self.run.finish(exit_code=code)
        finally:
            self.run = None
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
