"""Registers the built-in task sources through the ``rlctl`` entry-point group."""

from __future__ import annotations

from rlctl import hookimpl


@hookimpl
def register_task_sources(register) -> None:
    from rlctl_tasks.arith import ArithOptions, ArithTask
    from rlctl_tasks.hf_disk import HfDiskOptions, HfDiskTask
    from rlctl_tasks.humaneval import HumanevalOptions, HumanevalTask
    from rlctl_tasks.jsonl import JsonlOptions, JsonlTask
    from rlctl_tasks.parquet import ParquetOptions, ParquetTask

    register("arith", lambda options, seed=0: ArithTask(options or ArithOptions(), seed), options=ArithOptions)
    register("jsonl", lambda options, seed=0: JsonlTask(options, seed), options=JsonlOptions)
    register("parquet", lambda options, seed=0: ParquetTask(options, seed), options=ParquetOptions)
    register("hf_disk", lambda options, seed=0: HfDiskTask(options, seed), options=HfDiskOptions)
    register("humaneval", lambda options, seed=0: HumanevalTask(options, seed), options=HumanevalOptions)
