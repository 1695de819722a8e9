"""Registers the built-in metric sinks: jsonl, and the trackers tensorboard, mlflow, wandb (each an extra)."""

from __future__ import annotations

from rlctl import hookimpl


@hookimpl
def register_metric_sinks(register) -> None:
    # Importing the modules is cheap: each tracker package is imported only when its sink is built.
    from rlctl_sinks.jsonl import JsonlSink
    from rlctl_sinks.mlflow_sink import MlflowOptions, MlflowSink
    from rlctl_sinks.tensorboard_sink import TensorBoardOptions, TensorBoardSink
    from rlctl_sinks.wandb_sink import WandbOptions, WandbSink

    register("jsonl", lambda options, run_dir, run_id, **_: JsonlSink(run_dir))
    register("tensorboard", lambda options, run_dir, run_id, **_: TensorBoardSink(run_dir, options),
             options=TensorBoardOptions)
    register("mlflow", lambda options, run_dir, run_id, **_: MlflowSink(run_dir, run_id, options),
             options=MlflowOptions)
    register("wandb", lambda options, run_dir, run_id, **_: WandbSink(run_dir, run_id, options),
             options=WandbOptions)
