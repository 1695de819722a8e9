"""Registers the built-in metric sinks."""

from __future__ import annotations

from rlctl import hookimpl


@hookimpl
def register_metric_sinks(register) -> None:
    from rlctl_sinks.jsonl import JsonlSink

    register("jsonl", lambda options, run_dir, run_id: JsonlSink(run_dir))
