"""The episode driver on the local engine: turns and masks, limits, slow tools, determinism, failures, and the
learner's log-probs on multi-turn episodes (token in / token out, never re-tokenized)."""

from __future__ import annotations

import threading
import time

import pytest

from rlctl.contracts.roles import Environment
from rlctl.contracts.types import EnvStep, EpisodeLimits, RolloutContext, RolloutRequest, SamplingConfig, \
    TerminalReason, Writer
from rlctl.engine.episodes import EpisodeDriver, episode_failure
from rlctl.engine.scoring import score_all
from rlctl.models.tokenizer import tokenizer_hash

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=24)


class EchoEnv:
    """A test environment: a policy turn stops at any digit or minus sign and the environment answers ``obs``.

    ``slow`` names a prompt whose steps take ``slow_s``; ``failing`` maps a prompt to how many of its steps
    report a tool timeout before one succeeds; ``done_after`` ends every episode with the first observation;
    ``answer_eos`` answers a turn that ended in EOS too (the tiny policy's greedy first token often is EOS).
    """

    name = "echo"
    version = "echo@1"

    def __init__(self, tokenizer, obs: str = ";", limits: EpisodeLimits | None = None, slow: str | None = None,
                 slow_s: float = 0.0, failing: dict | None = None, done_after: bool = False, obs_ids=None,
                 answer_eos: bool = False) -> None:
        self.tokenizer = tokenizer
        self.obs = tuple(obs_ids) if obs_ids is not None else tuple(tokenizer.encode(obs, add_special_tokens=False))
        self.stop = tuple("0123456789-")
        self.limits = limits or EpisodeLimits(max_turns=3, max_total_tokens=24, step_timeout_s=5.0)
        self.slow, self.slow_s, self.failing, self.done_after = slow, slow_s, dict(failing or {}), done_after
        self.answer_eos = answer_eos
        self.log: list[tuple[str, int, float, float]] = []  # (prompt, step number, started, ended)
        self.lock = threading.Lock()

    def start(self, prompt_id, prompt_tokens, row=None):
        return EchoEpisode(self, prompt_id)


class EchoEpisode:
    def __init__(self, env: EchoEnv, prompt_id: str) -> None:
        self.env, self.prompt_id, self.steps = env, prompt_id, 0

    def step(self, policy_tokens):
        env = self.env
        started = time.monotonic()
        if policy_tokens[-1] == env.tokenizer.eos_token_id and not env.answer_eos:
            return EnvStep(done=True)
        if self.prompt_id == env.slow:
            time.sleep(env.slow_s)
        with env.lock:
            if env.failing.get(self.prompt_id, 0) > 0:
                env.failing[self.prompt_id] -= 1
                return EnvStep(done=True, tool="echo", tool_status="timeout")
            self.steps += 1
            env.log.append((self.prompt_id, self.steps, started, time.monotonic()))
        return EnvStep(observation=env.obs, tool="echo", tool_status="ok", tool_seconds=time.monotonic() - started,
                       done=env.done_after)


def _engine(plugins, policy_dir, seed=0):
    return plugins.build("rollout_backend", "local", {}, "rollout.options",
                         ctx=RolloutContext(model_dir=str(policy_dir), tokenizer_hash=tokenizer_hash(policy_dir),
                                            seed=seed))


def _requests(session, n=4, g=4, sampling=SAMPLING):
    return [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(session.tokenizer(p.text)["input_ids"]), group_size=g,
                           sampling=sampling, dataset_version=session.task.version) for p in session.task.train[:n]]


def _driver(session, env, **kw):
    driver = EpisodeDriver(session.rollout, env, session.tokenizer, **kw)
    assert isinstance(env, Environment)
    return driver


def _check_structure(t, env):
    n = len(t.response_tokens)
    assert t.verify() and len(t.action_mask) == n == len(t.behavior_logprobs)
    assert t.turns[0].start == 0 and t.turns[-1].end == n
    assert all(a.end == b.start for a, b in zip(t.turns, t.turns[1:]))
    for turn in t.turns:
        span = range(turn.start, turn.end)
        if turn.writer is Writer.POLICY:
            assert all(t.action_mask[i] == 1 and t.behavior_logprobs[i] <= 0.0 for i in span)
            assert turn.policy_version == 0
        else:
            assert all(t.action_mask[i] == 0 and t.behavior_logprobs[i] == 0.0 for i in span)
            assert t.response_tokens[turn.start:turn.end] == env.obs and turn.tool == "echo"
    policy_turns = [x for x in t.turns if x.writer is Writer.POLICY]
    assert 1 <= len(policy_turns) <= env.limits.max_turns and t.policy_versions == (0,)


def test_episodes_hold_every_turn_with_masks_logprobs_and_versions(tiny_session):
    env = EchoEnv(tiny_session.tokenizer)
    out = _driver(tiny_session, env).generate(_requests(tiny_session))
    assert [(t.prompt_id, t.group_index) for t in out] == [(p.id, g) for p in tiny_session.task.train[:4]
                                                             for g in range(4)]
    for t in out:
        _check_structure(t, env)
        last_env = max((i for i, x in enumerate(t.turns) if x.writer is Writer.ENV), default=-1)
        answer = [tok for x in t.turns[last_env + 1:] for tok in t.response_tokens[x.start:x.end]]
        assert t.response_text == tiny_session.tokenizer.decode(answer, skip_special_tokens=True)
        if sum(x.writer is Writer.POLICY for x in t.turns) == env.limits.max_turns and t.turns[-1].writer is Writer.ENV:
            assert t.terminal_reason is TerminalReason.LENGTH  # the turn cap, not the policy, ended it
    assert max(sum(x.writer is Writer.ENV for x in t.turns) for t in out) >= 2  # really multi-turn


@pytest.mark.parametrize("max_turns, max_total", [(1, 24), (3, 5), (8, 12)])
def test_limits_end_episodes_as_length(tiny_session, max_turns, max_total):
    env = EchoEnv(tiny_session.tokenizer, obs=";;", limits=EpisodeLimits(max_turns=max_turns,
                                                                          max_total_tokens=max_total))
    out = _driver(tiny_session, env).generate(_requests(tiny_session, n=3))
    for t in out:
        _check_structure(t, env)
        assert len(t.response_tokens) <= max_total
        if t.response_tokens[-1] != tiny_session.tokenizer.eos_token_id:
            assert t.terminal_reason is TerminalReason.LENGTH
    # rollout.max_tokens bounds the whole episode too
    short = _driver(tiny_session, EchoEnv(tiny_session.tokenizer)).generate(
        _requests(tiny_session, n=2, sampling=SamplingConfig(max_tokens=3)))
    assert all(len(t.response_tokens) <= 3 for t in short)


def test_a_slow_tool_does_not_hold_up_the_other_episodes(tiny_session):
    slow = tiny_session.task.train[0].id
    env = EchoEnv(tiny_session.tokenizer, slow=slow, slow_s=1.5,
                  limits=EpisodeLimits(max_turns=4, max_total_tokens=24, step_timeout_s=5.0))
    started = time.monotonic()
    out = _driver(tiny_session, env).generate(_requests(tiny_session, n=3))
    slow_steps = [(s, e) for p, _, s, e in env.log if p == slow]
    assert slow_steps, "the slow prompt's episodes made no tool call"
    first_slow_end = min(e for _, e in slow_steps)
    # other episodes took later turns (their second step) while the first slow step was still running
    assert any(p != slow and n >= 2 and s < first_slow_end for p, n, s, _ in env.log)
    assert all(t.verify() for t in out) and time.monotonic() - started < 1.5 * (env.limits.max_turns + 1)


def test_same_seed_same_episodes(plugins, tiny_session, tiny_policy_dir):
    def run(seed):
        engine = _engine(plugins, tiny_policy_dir, seed)
        try:
            out = EpisodeDriver(engine, EchoEnv(tiny_session.tokenizer), tiny_session.tokenizer).generate(
                _requests(tiny_session))
        finally:
            engine.close()
        return [(t.response_tokens, t.behavior_logprobs, t.terminal_reason, t.response_text,
                 [(x.start, x.end, x.writer, x.tool_status) for x in t.turns]) for t in out]  # not the tool's time

    first = run(0)
    assert run(0) == first
    assert run(1) != first


def test_a_failing_tool_is_retried_then_flags_the_episode_unscored(tiny_session):
    ids = [p.id for p in tiny_session.task.train[:2]]
    env = EchoEnv(tiny_session.tokenizer, failing={ids[0]: 1, ids[1]: 100}, done_after=True, answer_eos=True)
    out = _driver(tiny_session, env, retries=1).generate(_requests(tiny_session, n=2, g=1,
                                                                   sampling=SamplingConfig(temperature=0.0,
                                                                                           max_tokens=24)))
    recovered, failed = out
    assert recovered.turns[-1].tool_status == "ok" and episode_failure(recovered) is None
    flagged = failed.turns[-1]
    assert (flagged.writer, flagged.tool_status, flagged.start, flagged.end) == (
        Writer.ENV, "timeout", len(failed.response_tokens), len(failed.response_tokens))
    assert episode_failure(failed).startswith("tool_timeout:")
    from rlctl_rewards.math import MathReward

    scored, _ = score_all(out, {t.prompt_id: "0" for t in out}, MathReward(), truncation_penalty=0.0)
    assert scored[1].reward is None and scored[1].reward_error.startswith("tool_timeout:")
    assert scored[0].reward_error is None and scored[0].reward is not None


def test_text_the_environment_wrote_is_never_graded_as_the_answer(tiny_session):
    prompt = tiny_session.task.train[0]
    env = EchoEnv(tiny_session.tokenizer, obs=f"<out>{prompt.answer}</out>", done_after=True, answer_eos=True)
    out = _driver(tiny_session, env).generate(_requests(tiny_session, n=1, g=4, sampling=SamplingConfig(
        temperature=0.0, max_tokens=24)))
    from rlctl_rewards.math import MathReward

    for t in out:
        assert t.turns[-1].writer is Writer.ENV  # the policy wrote nothing after the tool's answer
        assert t.response_text == "" and MathReward().score(t, prompt.answer).total == 0.0


def test_learner_logprobs_match_the_engine_on_multi_turn_episodes(tiny_session):
    """Reconciliation: log pi recomputed by the learner over prompt + every turn equals the engine's behaviour
    log-probs on the policy's tokens (the environment's tokens are masked out), max |delta| <= 1e-5 in fp32."""
    from rlctl.engine.batching import build_batch

    env = EchoEnv(tiny_session.tokenizer, obs="; ")
    out = _driver(tiny_session, env).generate(_requests(tiny_session))
    assert sum(x.writer is Writer.ENV for t in out for x in t.turns) >= 8
    batch = build_batch(out, [0.0] * len(out), tiny_session.tokenizer.pad_token_id, SAMPLING)
    learner = tiny_session.learner.logprobs(batch)
    mask = batch.action_mask > 0
    assert int((batch.attention_mask > 0).sum() - mask.sum()) > int(sum(len(t.prompt_tokens) for t in out))
    delta = (learner - batch.behavior_logprobs)[mask].abs()
    assert float(delta.max()) <= 1e-5, f"max |logpi - logmu| = {float(delta.max()):.2e}"


def test_a_text_round_trip_would_change_the_ids_the_episode_path_keeps_them(tiny_session):
    """The environment writes a newline, which the character tokenizer encodes as <unk>, and an <eos> id: decoding
    the episode and re-encoding the text gives other ids (the learner would score tokens the engine never saw);
    the episode keeps the engine's and environment's ids as they were, and the learner still reconciles."""
    from rlctl.engine.batching import build_batch

    tok = tiny_session.tokenizer
    obs = tuple(tok.encode(" \n", add_special_tokens=False)) + (tok.eos_token_id,)
    assert tok.unk_token_id in obs
    env = EchoEnv(tok, obs_ids=obs)
    out = _driver(tiny_session, env).generate(_requests(tiny_session, n=2))
    episodes = [t for t in out if any(x.writer is Writer.ENV for x in t.turns)]
    assert episodes
    for t in episodes:
        env_turn = next(x for x in t.turns if x.writer is Writer.ENV)
        assert t.response_tokens[env_turn.start:env_turn.end] == obs  # the environment's ids, untouched
        ids = t.prompt_tokens + t.response_tokens
        round_trip = tuple(tok(tok.decode(list(ids), skip_special_tokens=True))["input_ids"])
        assert round_trip != ids
    batch = build_batch(episodes, [0.0] * len(episodes), tok.pad_token_id, SAMPLING)
    delta = (tiny_session.learner.logprobs(batch) - batch.behavior_logprobs)[batch.action_mask > 0].abs()
    assert float(delta.max()) <= 1e-5
