"""Registers the plain-torch learner and critic as learner backend and critic backend ``torch``."""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl_torch_learner.learner import TorchLearner

    return TorchLearner(ctx, options)


def _make_critic(options, ctx):
    from rlctl_torch_learner.critic import TorchCritic

    return TorchCritic(ctx, options)


@hookimpl
def register_critic_backends(register) -> None:
    register("torch", _make_critic)


@hookimpl
def register_learner_backends(register) -> None:
    from rlctl_torch_learner.options import TorchLearnerOptions

    register("torch", _make, options=TorchLearnerOptions)
