"""Registers the plain-torch learner as learner backend ``torch``."""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl_torch_learner.learner import TorchLearner

    return TorchLearner(ctx, options)


@hookimpl
def register_learner_backends(register) -> None:
    from rlctl_torch_learner.options import TorchLearnerOptions

    register("torch", _make, options=TorchLearnerOptions)
