"""Built-in reward functions: "math", "digit_credit", "format", "length", "code" and
"reward_model"; and the ``python`` tool (it runs code in this plugin's sandbox).

What this is: the entry point ``rewards = "rlctl_rewards.plugin"``; it registers
each reward with its options model, exactly as a third-party plugin would.

What this is not: MixedReward (rlctl.engine.reward_mix), which the engine composes
from the configured components and is not registered here.
"""

from __future__ import annotations

from typing import Callable

from rlctl import hookimpl
from rlctl_rewards.code import CodeOptions, CodeReward
from rlctl_rewards.digit_credit import DigitCreditReward
from rlctl_rewards.format import FormatOptions, FormatReward
from rlctl_rewards.length import LengthOptions, LengthPenalty
from rlctl_rewards.math import MathOptions, MathReward
from rlctl_rewards.python_tool import PythonTool, PythonToolOptions
from rlctl_rewards.reward_model import RewardModelOptions, RewardModelReward


@hookimpl
def register_reward_functions(register: Callable[..., None]) -> None:
    """Register "math", "digit_credit", "format", "length", "code" and "reward_model".

    Each factory is called as ``factory(options=...)``.
    """
    register("math", MathReward, options=MathOptions)
    register("digit_credit", DigitCreditReward)
    register("format", FormatReward, options=FormatOptions)
    register("length", LengthPenalty, options=LengthOptions)
    register("code", CodeReward, options=CodeOptions)
    register("reward_model", RewardModelReward, options=RewardModelOptions)


@hookimpl
def register_tools(register: Callable[..., None]) -> None:
    """Register the ``python`` tool (multi-turn environments call it; it runs code in the sandbox)."""
    register("python", PythonTool, options=PythonToolOptions)
