"""MLflow metric sink: the run's metrics by step and its provenance as params, in an MLflow run.

What this is: a MetricSink that opens (or, on resume, finds again by its
``rlctl_run_id`` tag) one MLflow run per rlctl run and logs every metric under
its own name with the RL step as MLflow's step. Params: rlctl run id and name,
config hash, code version, dataset version, tokenizer hash, seed.

Where: ``options.tracking_uri``, else ``MLFLOW_TRACKING_URI``, else a local
SQLite store ``sqlite:///<run_dir>/mlflow.db`` (MLflow's file store is in
maintenance mode and refuses to open by default). Each step is sent with
``synchronous=False`` (at most one in flight), so a slow store does not hold up
the training step; ``close()`` waits for the last one.

Resume: MLflow cannot delete metric points, so the sink finds the highest step
the run already holds and does not send steps up to it again: every step
appears once, with the first attempt's values. The MLflow run ends FINISHED,
FAILED or KILLED (interrupted) like the rlctl run.

What this is not: the registry (the metrics always go there too) or a model registry client.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlctl_sinks._common import ending, require_extra, run_params

RUN_TAG = "rlctl_run_id"
_STATUS = {"finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}


class MlflowOptions(BaseModel):
    """Options of the "mlflow" metric sink."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tracking_uri: str | None = Field(
        None, description="MLflow tracking URI; default MLFLOW_TRACKING_URI, else sqlite:///<run_dir>/mlflow.db."
    )
    experiment: str = Field("rlctl", min_length=1, description="MLflow experiment name (created when missing).")

    @model_validator(mode="after")
    def _installed(self) -> "MlflowOptions":
        require_extra("mlflow", "mlflow", "mlflow")
        return self


def tracking_uri(options: MlflowOptions, run_dir: str | Path) -> str:
    return (options.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(Path(run_dir) / 'mlflow.db').resolve()}")


class MlflowSink:
    def __init__(self, run_dir: str | Path, run_id: str,
                 options: MlflowOptions | None = None) -> None:
        from mlflow.tracking import MlflowClient

        options = options or MlflowOptions()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.uri = tracking_uri(options, run_dir)
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(options.experiment)
        experiment_id = (experiment.experiment_id if experiment is not None
                         else self.client.create_experiment(options.experiment))
        found = self.client.search_runs([experiment_id], filter_string=f"tags.{RUN_TAG} = '{run_id}'", max_results=1)
        if found:  # a resume: the same MLflow run continues
            self.mlflow_run_id = found[0].info.run_id
            self.client.update_run(self.mlflow_run_id, status="RUNNING")
            self.logged_through = max(
                (m.step for key in found[0].data.metrics for m in self.client.get_metric_history(self.mlflow_run_id, key)),
                default=-1,
            )
        else:
            params = run_params(run_dir, run_id)
            created = self.client.create_run(experiment_id, run_name=params.get("run_name", run_id),
                                             tags={RUN_TAG: run_id})
            self.mlflow_run_id = created.info.run_id
            from mlflow.entities import Param

            self.client.log_batch(self.mlflow_run_id, params=[Param(k, str(v)) for k, v in params.items()])
            self.logged_through = -1
        self._pending: Any = None

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        if step <= self.logged_through:
            return  # the earlier attempt of a resumed run logged this step already
        stamp = int(time.time() * 1000)
        batch = [Metric(name, float(value), stamp, step) for name, value in metrics.items()]
        self._wait()
        self._pending = self.client.log_batch(self.mlflow_run_id, metrics=batch, synchronous=False)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()

    def close(self) -> None:
        status = _STATUS[ending()]
        self._wait()
        self.client.set_terminated(self.mlflow_run_id, status=status)
