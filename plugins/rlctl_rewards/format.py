"""The "format" reward: 1.0 when a response is well formed, else 0.0.

What this is: a regex check on the response text (``re.search``, so anchor the
pattern yourself) plus, by default, a check that the response ended cleanly
(EOS, or a configured stop string) rather than being truncated or aborted.

What this is not: a correctness check (that is the "math" reward). The default
pattern is the arithmetic task's format: a bare number.
"""

from __future__ import annotations

import re
import time

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl import RewardResult, TerminalReason, Trajectory

VERSION = "1.0"
CLEAN_ENDINGS = frozenset({TerminalReason.EOS, TerminalReason.STOP})


class FormatOptions(BaseModel):
    """Options of the "format" reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pattern: str = Field(
        r"^\s*-?\d+(\.\d+)?\s*$",
        description="regex the response must match (re.search; anchor with ^...$). Default: a bare number",
    )
    require_eos: bool = Field(
        True, description="also require a clean ending (EOS or a stop string), not truncation or abort"
    )

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(
                f"pattern is not a valid Python regular expression ({err}); "
                "escape special characters such as ( [ + with a backslash"
            ) from None
        return value


class FormatReward:
    """1.0 when the text matches ``pattern`` (and ended cleanly if required), else 0.0."""

    name = "format"
    version = f"format@{VERSION}"

    def __init__(self, options: FormatOptions | None = None) -> None:
        self.options = options or FormatOptions()
        self._regex = re.compile(self.options.pattern)

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        matches = self._regex.search(trajectory.response_text) is not None
        clean = trajectory.terminal_reason in CLEAN_ENDINGS or not self.options.require_eos
        value = 1.0 if matches and clean else 0.0
        log = f"pattern={'ok' if matches else 'no match'} ending={trajectory.terminal_reason.value}"
        return RewardResult(total=value, components={"format": value}, grader_version=self.version,
                            latency_s=time.perf_counter() - started, log=log)
