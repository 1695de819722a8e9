"""Registers the local torch rollout engine as rollout backend ``local``."""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl_local_engine.engine import LocalEngine

    return LocalEngine(ctx, options)


@hookimpl
def register_rollout_backends(register) -> None:
    from rlctl_local_engine.options import LocalEngineOptions

    register("local", _make, options=LocalEngineOptions)
