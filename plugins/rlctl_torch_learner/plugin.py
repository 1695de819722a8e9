"""Registers the plain-torch learner and critic as learner backend and critic backend ``torch``.

The learner itself is the kit's (rlctl.kit.TorchLearner, which sharded learners extend); the critic is this
plugin's own (rlctl_torch_learner.critic).
"""

from __future__ import annotations

from rlctl import hookimpl


def _make(options, ctx):
    from rlctl.kit import TorchLearner

    return TorchLearner(ctx, options)


def _make_critic(options, ctx):
    from rlctl_torch_learner.critic import TorchCritic

    return TorchCritic(ctx, options)


@hookimpl
def register_critic_backends(register) -> None:
    register("torch", _make_critic)


@hookimpl
def register_learner_backends(register) -> None:
    from rlctl.kit import TorchLearnerOptions

    register("torch", _make, options=TorchLearnerOptions)
