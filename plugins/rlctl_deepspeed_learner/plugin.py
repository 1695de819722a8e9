"""Registers the DeepSpeed ZeRO learner as learner backend ``deepspeed`` (deepspeed itself is imported only when built)."""

from __future__ import annotations

from rlctl import ConfigError, hookimpl


def _make(options, ctx):
    from rlctl_deepspeed_learner.options import INSTALL_HINT, deepspeed_missing

    missing = deepspeed_missing()
    if missing:
        raise ConfigError(f"train.learner is 'deepspeed' but {missing}", INSTALL_HINT)
    from rlctl_deepspeed_learner.learner import DeepSpeedLearner

    return DeepSpeedLearner(ctx, options)


@hookimpl
def register_learner_backends(register) -> None:
    from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions

    register("deepspeed", _make, options=DeepSpeedLearnerOptions)
