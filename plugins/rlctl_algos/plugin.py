"""Registers the built-in advantage estimators through the same hook a third-party package would use."""

from __future__ import annotations

from rlctl import hookimpl


def _factory(class_name: str):
    def make(options, algo):
        from rlctl_algos import estimators

        return getattr(estimators, class_name)(algo, options)

    return make


@hookimpl
def register_advantage_estimators(register) -> None:
    from rlctl_algos.options import DAPOOptions, GSPOOptions

    register("grpo", _factory("GRPO"))
    register("dr_grpo", _factory("DrGRPO"))
    register("rloo", _factory("RLOO"))
    register("reinforce_pp", _factory("ReinforcePP"))
    register("gspo", _factory("GSPO"), options=GSPOOptions)
    register("dapo", _factory("DAPO"), options=DAPOOptions)
    register("ppo", _factory("PPO"))
