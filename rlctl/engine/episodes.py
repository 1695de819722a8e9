"""The episode driver: any rollout backend plus an environment make multi-turn episodes.

What this is: ``EpisodeDriver``, a RolloutBackend that wraps the configured
backend (local, sglang, vllm, ...) when ``rollout.environment`` is set, and
``build_rollout``, the one place every placement (sync, one_step_off, async;
local and Ray) and the evaluator build a rollout backend, wrapped or not.

How an episode runs: the first policy turn of a request is one backend call
with ``group_size`` G (the G samples of a prompt together, as single-turn).
Each later turn is a backend call on the episode's token ids so far (prompt +
every earlier turn, exactly as sampled and appended: never re-tokenized from
text), group size 1, stopping at the environment's ``stop`` strings too. The
environment's answer (``EpisodeState.step``) runs in a thread pool, so an
episode waiting on a slow tool does not hold up the others: each engine call
takes the episodes that are ready. Rounds are formed by waiting for the first
pending step and then up to ``GATHER_S`` for the rest, so with tools faster
than that (the calculator) the same seed gives the same episodes; which
episodes share an engine call can change samples (the batch's random draws),
so a deterministic run (``train.deterministic``, ``RolloutContext.deterministic``)
forms rounds in lockstep instead: each round waits for every pending step
(up to its deadline), and the same seed gives the same episodes whatever the
tools' latency, at the price of a slow tool holding the others.

An episode is one Trajectory: ``response_tokens`` every token after the prompt,
``action_mask`` 1 on the policy's tokens and 0 on the environment's,
``behavior_logprobs`` the engine's on policy tokens and 0.0 elsewhere, a Turn
per span with the weight version that sampled each policy turn, and
``response_text`` the final answer (the policy's text after the last
environment turn), which is what rewards grade. Limits: ``max_turns`` policy
turns and ``min(max_total_tokens, sampling max_tokens)`` tokens; whichever ends
the episode first makes it TerminalReason.LENGTH.

Tool failures: a step whose ``tool_status`` is "timeout", "error" or
"garbage" is run again (the same step, up to ``retries`` more times, the
reward config's retries); still failing, the episode ends with that status on
an (empty) environment turn, and scoring marks it unscored (``reward_error``
``tool_timeout: ...``), so its whole group is dropped, never scored 0. Every
attempt is accounted: the environment turn records how many failed attempts
were run again (``Turn.tool_retries``) and the seconds of all of them
(``Turn.tool_seconds``), so a failure a retry recovered still counts in
``episode_tool_error_rate`` and its time in ``time_tool_s``. A step that hangs
past ``step_timeout_s`` + STEP_GRACE_S counts the seconds it was waited for.

What this is not: an environment (plugins/rlctl_envs) or an engine.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from rlctl.contracts.errors import ConfigError, PluginError, RoleError
from rlctl.contracts.episodes import FAILED_TOOL_STATUSES
from rlctl.contracts.roles import Environment, EpisodeState, RolloutBackend
from rlctl.contracts.types import (
    EnvironmentContext,
    EnvStep,
    RolloutContext,
    RolloutRequest,
    SamplingConfig,
    TerminalReason,
    Trajectory,
    Turn,
    Writer,
)

if TYPE_CHECKING:
    from rlctl.config.models import EnvironmentConfig, RolloutConfig
    from rlctl.hooks.manager import Plugins

GATHER_S = 0.05  # after the first pending step ends, how long a round waits for the others
STEP_GRACE_S = 1.0  # a step past step_timeout_s + this is a timeout even if the environment never returns
# inner verbs that would bypass the episodes
_HIDDEN = frozenset({"generate_cancellable", "stream", "open_session", "supports_sessions"})


def build_rollout(plugins: "Plugins", rollout: "RolloutConfig", ctx: RolloutContext, retries: int = 0
                  ) -> RolloutBackend:
    """The configured rollout backend; wrapped in an EpisodeDriver when ``rollout.environment`` is set."""
    backend = plugins.build("rollout_backend", rollout.backend, rollout.options, "rollout.options", ctx=ctx)
    if rollout.environment is None:
        return backend
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir, local_files_only=True)
    env = build_environment(plugins, rollout.environment, tokenizer, seed=ctx.seed)
    return EpisodeDriver(backend, env, tokenizer, retries=retries, lockstep=ctx.deterministic)


def build_environment(plugins: "Plugins", environment: "EnvironmentConfig", tokenizer: Any, seed: int = 0
                      ) -> Environment:
    """The environment ``rollout.environment`` names, its tools built by name (unknown names: one clear error)."""
    def build_tool(name: str, options: Mapping[str, Any], where: str) -> Any:
        try:
            plugins.get("tool", name)
        except PluginError as err:
            raise ConfigError(f"{where.rsplit('.options', 1)[0]}: {err.message}", err.hint) from None
        return plugins.build("tool", name, options, where)

    try:
        plugins.get("environment", environment.name)
    except PluginError as err:
        raise ConfigError(f"rollout.environment.name: {err.message}", err.hint) from None
    ctx = EnvironmentContext(tokenizer=tokenizer, build_tool=build_tool, seed=seed)
    return plugins.build("environment", environment.name, environment.options, "rollout.environment.options",
                         ctx=ctx)


@dataclass(eq=False)
class _Episode:
    index: int  # in the call's output
    request: RolloutRequest
    group_index: int
    state: EpisodeState
    budget: int  # tokens after the prompt this episode may hold
    first: Trajectory | None = None
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    policy_turns: int = 0
    last_reason: TerminalReason = TerminalReason.EOS
    reason: TerminalReason | None = None  # set when the episode is over
    attempts: int = 0  # tries of the pending step
    retry_seconds: float = 0.0  # tool seconds of the pending step's failed tries

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)


class EpisodeDriver:
    """RolloutBackend: ``generate`` returns one multi-turn episode per sample (see the module docstring).

    Everything else (weights, health, state, memory) is the wrapped backend's;
    attributes the driver does not define are the backend's too, so optional
    protocols it implements (StatefulRollout, ReadableWeights, RunDirAware)
    still apply.
    """

    def __init__(self, backend: RolloutBackend, environment: Environment, tokenizer: Any, *, retries: int = 0,
                 workers: int = 32, lockstep: bool = False) -> None:
        self.backend = backend
        self.lockstep = lockstep  # rounds wait for every pending step: timing-independent episodes
        self.environment = environment
        self.tokenizer = tokenizer
        self.retries = retries
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env-step")

    def __getattr__(self, name: str) -> Any:
        if name in _HIDDEN or name.startswith("__") or name in ("backend", "environment", "tokenizer", "_pool",
                                                                 "lockstep"):
            raise AttributeError(name)
        return getattr(self.backend, name)

    @property
    def policy_version(self) -> int:
        return self.backend.policy_version

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self.backend.policy_version = value

    def update_weights(self, update: Any) -> None:
        self.backend.update_weights(update)

    def health(self) -> Mapping[str, Any]:
        return {**self.backend.health(), "environment": self.environment.version}

    def resident_tensors(self) -> Mapping[str, Sequence[Any]]:
        return self.backend.resident_tensors()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.backend.close()

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        """One episode per sample, ``group_size`` per request, grouped in request order."""
        env = self.environment
        episodes: list[_Episode] = []
        for req in requests:
            budget = min(env.limits.max_total_tokens, req.sampling.max_tokens)
            episodes += [_Episode(index=len(episodes) + g, request=req, group_index=g, budget=budget,
                                  state=env.start(req.prompt_id, req.prompt_tokens))
                         for g in range(req.group_size)]
        if not episodes:
            return []
        pending: dict[Future[EnvStep], tuple[_Episode, float]] = {}
        firsts = self._call([dataclasses.replace(r, sampling=self._turn_sampling(r.sampling, min(
            env.limits.max_total_tokens, r.sampling.max_tokens))) for r in requests])
        for ep, traj in zip(episodes, firsts):
            ep.first = traj
            self._policy_turn(ep, traj, pending)
        while pending:
            ready = self._gather(pending)
            if not ready:
                continue
            by_sampling: dict[SamplingConfig, list[_Episode]] = {}
            for ep in ready:
                by_sampling.setdefault(ep.request.sampling, []).append(ep)
            for base, group in by_sampling.items():
                turn = self._turn_sampling(base, max(ep.remaining for ep in group))
                results = self._call([RolloutRequest(
                    prompt_id=ep.request.prompt_id, prompt_tokens=tuple(ep.request.prompt_tokens) + tuple(ep.tokens),
                    group_size=1, sampling=turn, dataset_version=ep.request.dataset_version) for ep in group])
                for ep, traj in zip(group, results):
                    self._policy_turn(ep, traj, pending)
        return [self._trajectory(ep) for ep in episodes]

    def _turn_sampling(self, base: SamplingConfig, max_tokens: int) -> SamplingConfig:
        stop = tuple(dict.fromkeys(base.stop + tuple(self.environment.stop)))
        return dataclasses.replace(base, max_tokens=max_tokens, stop=stop)

    def _call(self, requests: list[RolloutRequest]) -> list[Trajectory]:
        out = self.backend.generate(requests)
        if len(out) != sum(r.group_size for r in requests):
            raise RoleError(f"the rollout backend returned {len(out)} samples for "
                            f"{sum(r.group_size for r in requests)} asked", "fix the rollout backend")
        return out

    def _policy_turn(self, ep: _Episode, traj: Trajectory, pending: dict[Future[EnvStep], tuple[_Episode, float]]
                     ) -> None:
        """Append a policy turn (cut to the episode's budget); end the episode or ask the environment."""
        tokens = list(traj.response_tokens[:max(ep.remaining, 0)])
        cut = len(tokens) < len(traj.response_tokens)
        start = len(ep.tokens)
        ep.tokens += tokens
        ep.mask += [1] * len(tokens)
        ep.logprobs += list(traj.behavior_logprobs[:len(tokens)])
        ep.turns.append(Turn(start=start, end=len(ep.tokens), writer=Writer.POLICY, policy_version=traj.policy_version))
        ep.policy_turns += 1
        ep.last_reason = traj.terminal_reason
        if traj.terminal_reason is TerminalReason.ABORT:
            ep.reason = TerminalReason.ABORT
        elif cut or traj.terminal_reason is TerminalReason.LENGTH:
            ep.reason = TerminalReason.LENGTH
        else:
            self._submit(ep, tokens, pending)

    def _submit(self, ep: _Episode, tokens: list[int], pending: dict[Future[EnvStep], tuple[_Episode, float]]
                ) -> None:
        ep.attempts += 1
        pending[self._pool.submit(ep.state.step, tuple(tokens))] = (ep, time.monotonic())

    def _gather(self, pending: dict[Future[EnvStep], tuple[_Episode, float]]) -> list[_Episode]:
        """Wait for the first pending step (or a deadline), then up to GATHER_S for the rest; apply those done.
        In lockstep, wait for every pending step (or its deadline) instead.

        Returns the episodes ready for their next policy turn, in a fixed order.
        """
        limit = self.environment.limits.step_timeout_s + STEP_GRACE_S
        if self.lockstep:
            latest = max(t for _, t in pending.values()) + limit - time.monotonic()
            wait(list(pending), timeout=max(latest, 0.0), return_when=ALL_COMPLETED)
        else:
            nearest = min(t for _, t in pending.values()) + limit - time.monotonic()
            done, _ = wait(list(pending), timeout=max(nearest, 0.0), return_when=FIRST_COMPLETED)
            if done:
                wait(list(pending), timeout=GATHER_S)
        now = time.monotonic()
        finished = []
        for fut, (ep, started) in list(pending.items()):
            if fut.done():
                finished.append((ep, fut, 0.0))
            elif now - started >= limit:  # the environment itself hangs: a timeout, its thread left behind
                finished.append((ep, None, now - started))
            else:
                continue
            del pending[fut]
        ready = []
        for ep, fut, waited in sorted(finished, key=lambda x: x[0].index):
            if fut is None:
                step = EnvStep(done=True, tool_status="timeout", tool_seconds=waited,
                               info={"error": "the environment step hung"})
            else:
                try:
                    step = fut.result()
                except Exception as err:  # an environment that crashed is a failed tool call of this turn
                    step = EnvStep(done=True, tool_status="error", info={"error": f"{type(err).__name__}: {err}"})
            if self._env_turn(ep, step, pending):
                ready.append(ep)
        return ready

    def _env_turn(self, ep: _Episode, step: EnvStep, pending: dict[Future[EnvStep], tuple[_Episode, float]]
                  ) -> bool:
        """Apply one environment step; True when the episode wants its next policy turn."""
        if step.tool_status in FAILED_TOOL_STATUSES and ep.attempts <= self.retries:
            ep.retry_seconds += step.tool_seconds  # accounted on the turn the call finally makes
            last = ep.turns[-1]
            self._submit(ep, ep.tokens[last.start:last.end], pending)  # the same call again
            return False
        retries, seconds = ep.attempts - 1, ep.retry_seconds + step.tool_seconds
        ep.attempts, ep.retry_seconds = 0, 0.0
        if step.reward_parts:
            ep.turns[-1] = dataclasses.replace(ep.turns[-1], reward=float(sum(step.reward_parts.values())))
        if step.tool_status in FAILED_TOOL_STATUSES:  # still failing: flagged on an empty environment turn, episode over
            n = len(ep.tokens)
            ep.turns.append(Turn(start=n, end=n, writer=Writer.ENV, tool=step.tool, tool_status=step.tool_status,
                                 tool_seconds=seconds, tool_retries=retries))
            ep.reason = ep.last_reason
            return False
        obs = list(step.observation)
        if len(obs) > ep.remaining:
            ep.reason = TerminalReason.LENGTH  # the answer does not fit: the episode is over, cut
            return False
        if obs or step.tool is not None or retries:
            start = len(ep.tokens)
            ep.tokens += obs
            ep.mask += [0] * len(obs)
            ep.logprobs += [0.0] * len(obs)
            ep.turns.append(Turn(start=start, end=len(ep.tokens), writer=Writer.ENV, tool=step.tool,
                                 tool_status=step.tool_status, tool_seconds=seconds, tool_retries=retries))
        if step.done:
            ep.reason = ep.last_reason
            return False
        if ep.policy_turns >= self.environment.limits.max_turns or ep.remaining <= 0:
            ep.reason = TerminalReason.LENGTH
            return False
        return True

    def _trajectory(self, ep: _Episode) -> Trajectory:
        first = ep.first
        assert first is not None and ep.reason is not None
        last_env = max((i for i, t in enumerate(ep.turns) if t.writer is Writer.ENV), default=-1)
        answer = [tok for t in ep.turns[last_env + 1:] for tok in ep.tokens[t.start:t.end]]
        versions = [t.policy_version for t in ep.turns if t.writer is Writer.POLICY and t.policy_version is not None]
        req = ep.request
        return Trajectory.create(
            id=first.id, prompt_id=req.prompt_id, group_index=ep.group_index, dataset_version=req.dataset_version,
            policy_version=min(versions), tokenizer_hash=first.tokenizer_hash, prompt_tokens=tuple(req.prompt_tokens),
            response_tokens=tuple(ep.tokens), response_text=self.tokenizer.decode(answer, skip_special_tokens=True),
            action_mask=tuple(ep.mask), behavior_logprobs=tuple(ep.logprobs), sampling_config=req.sampling,
            terminal_reason=ep.reason, rollout_started_at=first.rollout_started_at, turns=tuple(ep.turns),
        )


def episode_failure(traj: Trajectory) -> str | None:
    """``tool_<status>: ...`` when a tool call of the episode failed for good (infrastructure), else None."""
    for turn in traj.turns:
        if turn.writer is Writer.ENV and turn.tool_status in FAILED_TOOL_STATUSES:
            return f"tool_{turn.tool_status}: {turn.tool or 'environment'} failed after retries"
    return None
