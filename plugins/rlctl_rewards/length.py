"""The "length" reward: a penalty (<= 0) for responses longer than a target.

What this is: value = -max_penalty * max(0, n - target) / max(1, max_tokens - target),
clamped to [-max_penalty, 0], with n the number of response tokens and max_tokens
the sampling limit the response was drawn under. A response at the limit gets
the full penalty.

What this is not: a truncation rule (use the "format" reward's ``require_eos``)
or a reward for being short: at or under the target the value is 0.
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from rlctl import RewardResult, Trajectory

VERSION = "1.0"


class LengthOptions(BaseModel):
    """Options of the "length" reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    target_tokens: int = Field(ge=0, description="responses up to this many tokens are not penalised")
    max_penalty: float = Field(1.0, ge=0, allow_inf_nan=False, description="penalty at max_tokens (positive)")


class LengthPenalty:
    """Linear penalty from 0 at ``target_tokens`` to ``-max_penalty`` at the sampling max_tokens."""

    name = "length"
    version = f"length@{VERSION}"

    def __init__(self, options: LengthOptions) -> None:
        self.options = options

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        target, cap = self.options.target_tokens, self.options.max_penalty
        n = trajectory.num_policy_tokens  # an episode: the tokens the policy wrote, not its tools' answers
        span = max(1, trajectory.sampling_config.max_tokens - target)
        value = min(0.0, max(-cap, -cap * max(0, n - target) / span))
        return RewardResult(total=value, components={"length": value}, grader_version=self.version,
                            latency_s=time.perf_counter() - started, log=f"tokens={n} target={target}")
