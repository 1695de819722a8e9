"""Multi-turn episodes: who wrote which tokens, what an environment answers, and the episode roles.

What this is: frozen dataclasses a Trajectory (rlctl.contracts.types) carries when an environment wrote part
of its response and what an environment returns per policy turn; and the Environment, EpisodeState and
Tool protocols (re-exported by rlctl.contracts.roles with the other roles).

What this is not: the environments or the driver that runs episodes (plugins/rlctl_envs,
rlctl.engine.episodes). This module imports nothing from rlctl.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

_FROZEN = dict(frozen=True, slots=True, kw_only=True)

# Turn.tool_status values that are infrastructure failures (flag the episode; never scored). The others: "ok",
# "invalid" (the policy's own bad call, shown to it), None (no tool ran).
FAILED_TOOL_STATUSES = frozenset({"timeout", "error", "garbage"})


class Writer(str, enum.Enum):
    """Who wrote a span of an episode's tokens."""

    POLICY = "policy"  # sampled by the policy: trained on, has behaviour log-probs
    ENV = "env"  # appended by the environment (a tool's answer): never trained on


@dataclass(**_FROZEN)
class Turn:
    """One contiguous span ``[start, end)`` of an episode's ``response_tokens``, written by one side.

    A policy turn records the weight version that sampled it (an episode that
    straddles a weight update has several); an environment turn records the
    tool it ran, how that went (``tool_status``: "ok", "timeout", "error",
    "garbage"; None when no tool ran), its wall time and ``tool_retries``,
    the attempts of the same call that failed and were run again before the
    one recorded (the verifier retry policy): the turn stands for
    ``1 + tool_retries`` attempts, of which ``tool_retries`` failed (plus the
    last when its ``tool_status`` is a failure), and ``tool_seconds`` sums
    all of them. ``reward`` is the per-turn reward part (the sum of
    ``EnvStep.reward_parts``) the environment gave for that turn: the driver
    puts it on the policy turn the environment answered (None: none). It is
    part of the episode's return, never of the grader's ``Trajectory.reward``
    (rlctl.engine.batching.episode_return).

    >>> Turn(start=0, end=5, writer=Writer.POLICY, policy_version=3)
    Turn(start=0, end=5, writer=<Writer.POLICY: 'policy'>, policy_version=3, reward=None, tool=None, tool_status=None, tool_seconds=0.0, tool_retries=0)
    """

    start: int
    end: int
    writer: Writer
    policy_version: int | None = None  # policy turns: the version that sampled it; env turns: None
    reward: float | None = None
    tool: str | None = None
    tool_status: str | None = None
    tool_seconds: float = 0.0  # every attempt's, retried ones included
    tool_retries: int = 0  # failed attempts of this call that were run again (hashed only when set)


@dataclass(**_FROZEN)
class EpisodeLimits:
    """Bounds on one multi-turn episode; whichever comes first ends it (``TerminalReason.LENGTH``)."""

    max_turns: int = 4  # policy turns
    max_total_tokens: int = 256  # every token after the prompt, policy's and environment's
    step_timeout_s: float = 5.0  # one environment step (a tool call included)


@dataclass(**_FROZEN)
class EnvStep:
    """What an environment returns for one policy turn.

    ``observation`` are token ids appended after the policy's turn (may be
    empty); ``done`` ends the episode; ``reward_parts`` are per-turn reward
    components; ``tool``/``tool_status``/``tool_seconds`` describe the tool
    call this turn made, if any (``tool_status``: "ok", "timeout", "error",
    "garbage"); ``info`` is free-form (JSON-like values).
    """

    observation: tuple[int, ...] = ()
    done: bool = False
    reward_parts: Mapping[str, float] = field(default_factory=dict)
    tool: str | None = None
    tool_status: str | None = None
    tool_seconds: float = 0.0
    info: Mapping[str, Any] = field(default_factory=dict)


@runtime_checkable
class EpisodeState(Protocol):
    """One running episode of an environment (per-episode state lives here, not in the Environment).

    ``step`` gets the tokens the policy wrote in its last turn, exactly as the
    engine sampled them, and returns what the environment appends (token ids,
    never the policy's text re-tokenized). It must return within the
    environment's ``step_timeout_s``; a tool that fails is reported in
    ``EnvStep.tool_status``, not hidden, and leaves the state as it was: the
    episode driver may run the same step again (the verifier retry policy).
    """

    def step(self, policy_tokens: Sequence[int]) -> EnvStep: ...


@runtime_checkable
class Environment(Protocol):
    """Drives multi-turn episodes: the policy writes, the environment answers, until done or a limit.

    ``stop`` are the strings that end a policy turn (a tool call's closing
    marker) on top of the sampling config's own; ``limits`` bound every
    episode (turns, total tokens, per-step timeout).
    """

    name: str
    version: str
    stop: tuple[str, ...]
    limits: EpisodeLimits

    def start(self, prompt_id: str, prompt_tokens: Sequence[int], row: Any = None) -> EpisodeState:
        """Begin one episode of a task row (``row``: its PromptRecord when the caller has it)."""
        ...


@runtime_checkable
class Tool(Protocol):
    """One callable tool (``calculator``, ``python``): text arguments in, text result out."""

    name: str
    version: str

    def call(self, arguments: str, timeout_s: float) -> str:
        """The tool's answer; raise ToolError (bad call, crash, garbage) or TimeoutError. Never return a fake answer."""
        ...
