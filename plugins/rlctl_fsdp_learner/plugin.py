"""Registers the FSDP2 learner as learner backend ``fsdp2``."""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl_fsdp_learner.learner import FsdpLearner

    return FsdpLearner(ctx, options)


@hookimpl
def register_learner_backends(register) -> None:
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    register("fsdp2", _make, options=FsdpLearnerOptions)
