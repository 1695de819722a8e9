"""The ``tools`` environment: the policy calls tools in its text, the environment appends their answers.

What this is: an Environment (rlctl.contracts.roles) with two call syntaxes.

* ``tags`` (default): the policy writes ``<NAME>ARGS</NAME>`` (e.g.
  ``<calc>37*48</calc>``); its turn stops at the closing tag (``stop``); the
  environment appends ``<out>RESULT</out>`` and the policy continues. The final
  answer is what the policy writes after the last ``</out>``, ended by EOS.
* ``hermes`` (chat models): ``<tool_call>{"name": NAME, "arguments": ARGS}</tool_call>``
  answered by ``<tool_response>RESULT</tool_response>``. ``arguments`` may be
  a string or an object; an object with one string value (``{"expression":
  "37*48"}``) passes that value, any other object its JSON text.

``observation`` (option) is the template of what the environment writes, with
``{result}`` in it; for a chat model it can close the assistant turn and open
the next one in the model's chat template.

Who is to blame: a call the policy got wrong (no opening tag, bad JSON, an
unknown tool, a bad expression, code that raised: ``BadToolCall``) is answered
like any result, as ``<out>error: WHY</out>``, with ``tool_status`` "invalid":
a normal observation the policy can learn from. A tool that times out
(``limits.step_timeout_s``, enforced here: a hung tool is a timeout), crashes
(``ToolError``, any other exception) or returns something that is not text
("garbage") is an infrastructure failure: ``step`` returns ``done`` with that
``tool_status`` and no observation, the state unchanged, so the episode driver
may retry the same step; still failing, the episode is flagged and never scored.

The environment encodes only what it writes (the observation) with the run's
tokenizer; it decodes the policy's turn to parse the call and never
re-encodes it. Every tool call goes through the ``tool.call`` fault site
(``rlctl inject --fault tool-timeout|tool-error``) inside the timed call.

What this is not: the episode driver (rlctl.engine.episodes) or a tool.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl.contracts.episodes import FAILED_TOOL_STATUSES
from rlctl.contracts.errors import BadToolCall, ToolError
from rlctl.contracts.types import EnvironmentContext, EnvStep, EpisodeLimits
from rlctl.kit import fault_site

VERSION = "1"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_CLOSING = re.compile(r"</([A-Za-z_][A-Za-z0-9_-]*)>\s*$")
_OBSERVATION = {"tags": "<out>{result}</out>", "hermes": "<tool_response>{result}</tool_response>"}


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tool: str | None = Field(None, description="Registered tool (calculator, python); default: the key itself.")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the tool.")


class LimitOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(4, ge=1, le=64, description="Policy turns per episode; past it the episode ends (length).")
    max_total_tokens: int = Field(256, ge=1, description="Tokens after the prompt, policy's and environment's; "
                                  "rollout.max_tokens caps it too.")
    step_timeout_s: float = Field(5.0, gt=0, le=600, description="Deadline of one tool call; past it: timeout.")


class ToolsEnvOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    tools: dict[str, ToolSpec] = Field(description="Name the policy writes -> the tool it calls, e.g. "
                                       "{calc: {tool: calculator}}.", min_length=1)
    syntax: Literal["tags", "hermes"] = Field("tags", description="tags: <NAME>ARGS</NAME> answered by "
                                              "<out>RESULT</out>; hermes: <tool_call>{json}</tool_call> answered by "
                                              "<tool_response>RESULT</tool_response>.")
    observation: str | None = Field(None, description="Template of what the environment writes, with {result}; "
                                    "default per syntax (tags: <out>{result}</out>).")
    max_result_chars: int = Field(400, ge=1, description="A longer tool result is cut to this many characters.")
    limits: LimitOptions = Field(default_factory=LimitOptions)

    @field_validator("tools")
    @classmethod
    def _names(cls, value: dict[str, ToolSpec]) -> dict[str, ToolSpec]:
        bad = [k for k in value if not _NAME.match(k) or k in ("out", "tool_call", "tool_response")]
        if bad:
            raise ValueError(f"tool name(s) {bad} cannot be written as a tag; use letters, digits, _ and -, "
                             "not out/tool_call/tool_response")
        return value

    @field_validator("observation")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if value is not None and "{result}" not in value:
            raise ValueError("observation must contain {result}, e.g. '<out>{result}</out>'")
        return value


class ToolsEnvironment:
    """Environment ``tools``; see the module docstring."""

    name = "tools"

    def __init__(self, options: ToolsEnvOptions, ctx: EnvironmentContext) -> None:
        self.options = options
        self.tokenizer = ctx.tokenizer
        self.tools = {key: ctx.build_tool(spec.tool or key, spec.options,
                                          f"rollout.environment.options.tools.{key}.options")
                      for key, spec in options.tools.items()}
        self.syntax = options.syntax
        self.stop = tuple(f"</{k}>" for k in self.tools) if self.syntax == "tags" else ("</tool_call>",)
        lim = options.limits
        self.limits = EpisodeLimits(max_turns=lim.max_turns, max_total_tokens=lim.max_total_tokens,
                                    step_timeout_s=lim.step_timeout_s)
        self.template = options.observation or _OBSERVATION[self.syntax]
        tools = ",".join(f"{k}={t.name}@{t.version}" for k, t in sorted(self.tools.items()))
        self.version = f"tools@{VERSION}:{self.syntax}:{tools}"
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or ()))
        self._counter = itertools.count()

    def start(self, prompt_id: str, prompt_tokens: Sequence[int], row: Any = None) -> "ToolsEpisode":
        return ToolsEpisode(self, f"{prompt_id}#{next(self._counter)}")

    def parse(self, text: str) -> tuple[str, str] | None:
        """The tool call ending ``text`` as (name, arguments); None when the text ends in no call.

        Raises BadToolCall (with the name when known) for a call the policy wrote wrong.
        """
        if self.syntax == "tags":
            closing = _CLOSING.search(text)
            if closing is None:
                return None
            name = closing.group(1)
            opening = text.rfind(f"<{name}>", 0, closing.start())
            if name not in self.tools:
                raise BadToolCall(f"unknown tool {name!r} (tools: {', '.join(sorted(self.tools))})")
            if opening < 0:
                raise BadToolCall(f"</{name}> without <{name}>")
            return name, text[opening + len(name) + 2:closing.start()]
        end = text.rstrip()
        if not end.endswith("</tool_call>"):
            return None
        opening = end.rfind("<tool_call>")
        if opening < 0:
            raise BadToolCall("</tool_call> without <tool_call>")
        try:
            call = json.loads(end[opening + len("<tool_call>"):-len("</tool_call>")])
        except ValueError as err:
            raise BadToolCall(f"the tool call is not JSON ({err})") from None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise BadToolCall('a tool call is {"name": ..., "arguments": ...}')
        name, args = call["name"], call.get("arguments", "")
        if name not in self.tools:
            raise BadToolCall(f"unknown tool {name!r} (tools: {', '.join(sorted(self.tools))})")
        if isinstance(args, dict) and len(args) == 1 and isinstance(next(iter(args.values())), str):
            args = next(iter(args.values()))
        return name, args if isinstance(args, str) else json.dumps(args)

    def observe(self, result: str) -> tuple[int, ...]:
        """The token ids of what the environment writes for ``result`` (encoded here, no special tokens added)."""
        if len(result) > self.options.max_result_chars:
            result = result[:self.options.max_result_chars] + "..."
        return tuple(self.tokenizer.encode(self.template.format(result=result), add_special_tokens=False))


class ToolsEpisode:
    """One episode of the ``tools`` environment (stateless between steps: a failed step can be retried)."""

    def __init__(self, env: ToolsEnvironment, episode_id: str) -> None:
        self.env = env
        self.id = episode_id

    def step(self, policy_tokens: Sequence[int]) -> EnvStep:
        env = self.env
        if policy_tokens and policy_tokens[-1] in env.eos_ids:
            return EnvStep(done=True)  # the policy ended its answer
        text = env.tokenizer.decode(list(policy_tokens), skip_special_tokens=True)
        try:
            call = env.parse(text)
        except BadToolCall as err:
            return EnvStep(observation=env.observe(f"error: {err.message}"), tool_status="invalid",
                           info={"error": err.message})
        if call is None:
            return EnvStep(done=True)
        name, arguments = call
        status, result, seconds = self._call(name, arguments)
        if status in FAILED_TOOL_STATUSES:
            return EnvStep(done=True, tool=name, tool_status=status, tool_seconds=seconds, info={"error": result})
        return EnvStep(observation=env.observe(result), tool=name, tool_status=status, tool_seconds=seconds)

    def _call(self, name: str, arguments: str) -> tuple[str, str, float]:
        """(status, result or why it failed, seconds) of one call, in a thread timed against step_timeout_s."""
        tool, timeout = self.env.tools[name], self.env.limits.step_timeout_s
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                injected = fault_site("tool.call", None, tool=name, arguments=arguments, episode=self.id)
                box["value"] = injected if injected is not None else tool.call(arguments, timeout)
            except BaseException as err:  # reported to the caller below, whatever it is
                box["error"] = err

        started = time.perf_counter()
        worker = threading.Thread(target=run, name=f"tool-{name}", daemon=True)  # a hung tool is left behind
        worker.start()
        worker.join(timeout)
        seconds = time.perf_counter() - started
        if worker.is_alive():
            return "timeout", f"no answer within step_timeout_s={timeout}s", seconds
        err = box.get("error")
        if isinstance(err, BadToolCall):
            return "invalid", f"error: {err.message}", seconds
        if isinstance(err, TimeoutError):
            return "timeout", str(err) or "the tool timed out", seconds
        if isinstance(err, ToolError):
            return "error", err.message, seconds
        if err is not None:
            return "error", f"{type(err).__name__}: {err}", seconds
        value = box.get("value")
        if not isinstance(value, str):
            return "garbage", f"the tool returned {type(value).__name__}, not text", seconds
        return "ok", value, seconds


class ScriptedToolsOptions(ToolsEnvOptions):
    call: str = Field(description="The arguments of the call every episode's first policy turn makes to the first "
                      "tool in `tools` (e.g. '6*7' for the calculator, 'print(6*7)' for python).")


class ScriptedToolsEnvironment(ToolsEnvironment):
    """Environment ``scripted-tools``: ``tools``, except that every episode's first policy turn counts as the call
    ``options.call`` to the first tool, whatever the policy wrote; the second turn ends the episode.

    For drills and tests of the tool machinery (the sandbox, step deadlines, the ``tool.call`` fault site,
    retries, dropped groups, metrics) with a policy that never writes the call syntax, such as the tiny model.
    The call runs exactly as a parsed one would (timed, through the fault site).
    """

    name = "scripted-tools"

    def __init__(self, options: ScriptedToolsOptions, ctx: EnvironmentContext) -> None:
        super().__init__(options, ctx)
        self.call = (next(iter(self.tools)), options.call)
        self.version = f"scripted-{self.version}:{options.call!r}"

    def start(self, prompt_id: str, prompt_tokens: Sequence[int], row: Any = None) -> "ScriptedEpisode":
        return ScriptedEpisode(self, f"{prompt_id}#{next(self._counter)}")


class ScriptedEpisode(ToolsEpisode):
    env: ScriptedToolsEnvironment
    answered = False  # set once the call succeeded: a failed step leaves the state as it was (retried)

    def step(self, policy_tokens: Sequence[int]) -> EnvStep:
        if self.answered:
            return EnvStep(done=True)
        name, arguments = self.env.call
        status, result, seconds = self._call(name, arguments)
        if status in FAILED_TOOL_STATUSES:
            return EnvStep(done=True, tool=name, tool_status=status, tool_seconds=seconds, info={"error": result})
        self.answered = True
        return EnvStep(observation=self.env.observe(result), tool=name, tool_status=status, tool_seconds=seconds)
