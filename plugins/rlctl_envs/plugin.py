"""Built-in environments and tools: environment ``tools``, tool ``calculator``.

What this is: the entry point ``envs = "rlctl_envs.plugin"``; it registers each
with its options model, exactly as a third-party plugin would. (The ``python``
tool is registered by rlctl_rewards, next to the sandbox it runs code in.)

What this is not: the episode driver (rlctl.engine.episodes).
"""

from __future__ import annotations

from typing import Callable

from rlctl import hookimpl


def _tools_env(options, ctx):
    from rlctl_envs.tools_env import ToolsEnvironment

    return ToolsEnvironment(options, ctx)


@hookimpl
def register_environments(register: Callable[..., None]) -> None:
    from rlctl_envs.tools_env import ToolsEnvOptions

    register("tools", _tools_env, options=ToolsEnvOptions)


@hookimpl
def register_tools(register: Callable[..., None]) -> None:
    from rlctl_envs.calculator import Calculator, CalculatorOptions

    register("calculator", Calculator, options=CalculatorOptions)
