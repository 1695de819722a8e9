"""Operating multi-turn episodes: tool fault kinds, episode metrics, the tool-failures runbook and its place in
the diagnosis, the stored episodes and `rlctl episodes`, the profile's tool stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rlctl import hookimpl
from rlctl.contracts.errors import ToolError
from rlctl.contracts.types import TerminalReason, Trajectory, Turn, Writer
from rlctl.engine.faults import FaultContext, fault_site
from rlctl.engine.metrics import episode_metrics
from rlctl.engine.samples import SampleLog
from rlctl.incidents.diagnose import diagnose, render_html
from rlctl.incidents.runbooks import load_runbooks
from rlctl.incidents.triggers import History
from rlctl.lifecycle.episodes import stored_episodes
from tests.unit.test_engine_parts import traj

REPO = Path(__file__).resolve().parents[2]


class _Echo:
    """A tiny tool: answers its arguments."""

    name, version = "echo", "echo@1"

    def __init__(self, options=None) -> None:
        pass

    def call(self, arguments: str, timeout_s: float) -> str:
        return arguments


class _ToolPlugin:
    @hookimpl
    def register_tools(self, register):
        register("echo", _Echo)


def _call(tool, arguments: str, episode: str) -> str:
    """What an environment does for one tool call: the fault site, then the tool."""
    fault_site("tool.call", None, tool=tool.name, arguments=arguments, episode=episode)
    return tool.call(arguments, timeout_s=1.0)


def _armed(plugins, kind: str, rate: float, target: str | None = None, **options):
    ctx = FaultContext(kind=kind, at_step=0, count=None, rate=rate, target=target, options=None, seed=0,
                       step=lambda: 0, record=lambda m, d: None)
    fault = plugins.build("fault", kind, options, "faults.inject.0.options")
    return ctx, fault.arm(ctx)


@pytest.mark.parametrize(("kind", "error"), [("tool-timeout", TimeoutError), ("tool-error", ToolError)])
def test_tool_faults_fail_a_rate_of_episode_attempts_at_the_tool_call_site(kind, error) -> None:
    from rlctl.hooks.manager import load_plugins

    plugins = load_plugins(extra={"test_tools": _ToolPlugin()})
    tool = plugins.build("tool", "echo", {}, "rollout.environment.options.tools.echo")
    ctx, disarm = _armed(plugins, kind, rate=0.1)
    try:
        outcomes = []
        for i in range(400):
            try:
                outcomes.append(_call(tool, "2+2", f"p{i}/0") == "2+2")
            except error as err:
                assert "injected fault" in str(err) and "echo" in str(err)
                outcomes.append(False)
        failed = outcomes.count(False)
        assert 20 <= failed <= 65 and ctx.num_fired == failed  # ~10% of (episode, attempt) pairs
        # a retry of a failed episode draws a fresh coin: with rate 0.1 almost every one then succeeds
        retried = sum(1 for i, ok in enumerate(outcomes) if not ok and _try(tool, f"p{i}/0", error))
        assert retried >= failed - 10
    finally:
        disarm()
    assert _call(tool, "x", "p0/0") == "x"  # disarmed


def _try(tool, episode: str, error) -> bool:
    try:
        return _call(tool, "1", episode) == "1"
    except error:
        return False


def test_a_tool_fault_with_a_target_hits_only_that_tool_and_is_deterministic() -> None:
    from rlctl.hooks.manager import load_plugins

    plugins = load_plugins(extra={"test_tools": _ToolPlugin()})
    tool = plugins.build("tool", "echo", {}, "x")
    ctx, disarm = _armed(plugins, "tool-timeout", rate=1.0, target="calculator")
    try:
        assert _call(tool, "a", "e1") == "a" and ctx.num_fired == 0  # echo is not the target
    finally:
        disarm()
    first = []
    for _ in range(2):  # same seed, same episodes: the same calls fail
        ctx, disarm = _armed(plugins, "tool-error", rate=0.5)
        try:
            first.append([_try(tool, f"e{i}", ToolError) for i in range(40)])
        finally:
            disarm()
    assert first[0] == first[1] and 5 < first[0].count(False) < 35


def _episode(pid: str, index: int, *, status: str | None = "ok", seconds: float = 0.5,
             reason: TerminalReason = TerminalReason.EOS, **scored) -> Trajectory:
    """policy 3 tokens, env 2 tokens (a tool answer), policy 2 tokens."""
    turns = (Turn(start=0, end=3, writer=Writer.POLICY, policy_version=1),
             Turn(start=3, end=5, writer=Writer.ENV, tool="calculator", tool_status=status, tool_seconds=seconds),
             Turn(start=5, end=7, writer=Writer.POLICY, policy_version=2))
    return traj(pid, index, response=(5, 6, 7, 8, 9, 10, 11), mask=(1, 1, 1, 0, 0, 1, 1),
                logprobs=(-0.5, -0.5, -0.5, 0.0, 0.0, -0.5, -0.5), reason=reason, policy_version=1, turns=turns,
                **scored)


def test_episode_metrics_from_hand_built_episodes() -> None:
    ok = [_episode("a", 0, reward=1.0), _episode("a", 1, reason=TerminalReason.LENGTH, reward=0.0)]
    flagged = [_episode("b", 0, status="timeout", seconds=1.0, reward_error="tool_timeout: calculator"),
               _episode("b", 1, reward=1.0)]
    single = [traj("c", 0, reward=1.0), traj("c", 1, reward=0.0)]
    m = episode_metrics([*ok, *single, *flagged], dropped=flagged, group_size=2, step_time_s=10.0)
    assert m["episode_turns_mean"] == pytest.approx((2 * 4 + 1 * 2) / 6)  # two policy turns, or one
    assert m["episode_tool_calls"] == 4 and m["episode_tool_call_rate"] == pytest.approx(4 / 6)
    assert m["episode_tool_error_rate"] == pytest.approx(1 / 4)
    assert m["episode_turn_cap_rate"] == pytest.approx(1 / 6)  # a single-turn LENGTH is not a turn cap
    assert m["episode_env_tokens"] == 8 and m["episode_dropped_groups"] == 1
    assert m["time_tool_s"] == pytest.approx(2.5) and m["time_tool_frac"] == pytest.approx(0.25)
    quiet = episode_metrics(single, group_size=2)
    assert quiet["episode_turns_mean"] == 1 and quiet["episode_tool_calls"] == 0 == quiet["episode_dropped_groups"]


def test_every_step_metric_dict_carries_the_episode_names() -> None:
    import torch

    from rlctl.engine.metrics import step_metrics

    scored = [_episode("a", 0, reward=1.0), _episode("a", 1, reward=0.0)]
    out = step_metrics(scored=scored, learner_stats={}, adv_stats={}, advantages=torch.ones(2),
                       verify_latencies=[], learner_version=1,
                       times={"T_r": 2.0, "T_v": 0.0, "T_l": 1.0, "T_s": 1.0},
                       dropped=[_episode("b", 0, status="error"), _episode("b", 1)], group_size=2)
    assert out["episode_dropped_groups"] == 1 and out["groups_dropped"] == 1
    assert out["time_tool_s"] == pytest.approx(2.0) and out["time_tool_frac"] == pytest.approx(0.5)
    assert {"episode_turns_mean", "episode_tool_calls", "episode_tool_call_rate", "episode_tool_error_rate",
            "episode_turn_cap_rate", "episode_env_tokens"} <= set(out)


def test_retried_attempts_count_in_the_error_rate_retries_and_tool_time() -> None:
    """A call that failed once and then answered is 2 attempts with 1 failure; its first try's seconds count."""
    def episode(index: int, status: str, retries: int, seconds: float, **scored) -> Trajectory:
        t = _episode("a", index, **scored)
        turns = list(t.turns)
        turns[1] = Turn(start=3, end=5, writer=Writer.ENV, tool="calculator", tool_status=status,
                        tool_seconds=seconds, tool_retries=retries)
        return t.updated(turns=tuple(turns))

    eps = [episode(0, "ok", 1, 1.5, reward=1.0), episode(1, "ok", 0, 0.5, reward=0.0),
           episode(2, "timeout", 2, 3.0, reward_error="tool_timeout: calculator")]
    m = episode_metrics(eps)
    assert m["episode_tool_calls"] == 3 and m["episode_tool_retries"] == 3
    assert m["episode_tool_error_rate"] == pytest.approx((1 + 0 + 3) / (2 + 1 + 3))
    assert m["time_tool_s"] == pytest.approx(5.0)
    # without the retries the same step would have looked clean but for the final failure: 1 of 3 calls
    assert episode_metrics([eps[1]])["episode_tool_error_rate"] == 0.0
    # an environment step that crashed (no tool named) is a failed attempt too
    crashed = _episode("b", 0).updated(turns=(Turn(start=0, end=7, writer=Writer.POLICY, policy_version=1),
                                              Turn(start=7, end=7, writer=Writer.ENV, tool_status="error")))
    assert episode_metrics([crashed])["episode_tool_error_rate"] == 1.0
    recovered = crashed.updated(turns=(crashed.turns[0], Turn(start=7, end=7, writer=Writer.ENV, tool_retries=1)))
    assert episode_metrics([recovered])["episode_tool_error_rate"] == 0.5  # crashed once, then ended the episode
    # `rlctl episodes` and the diagnosis report show the retries and the failed step that named no tool
    from rlctl.incidents.diagnose import tool_label
    from rlctl.lifecycle.episodes import episode_json

    assert tool_label(episode_json(0, eps[2])["turns"][1]) == " calculator timeout 3.000s after 2 retries"
    assert tool_label(episode_json(0, crashed)["turns"][1]) == " environment error 0.000s"
    assert tool_label(episode_json(0, eps[1])["turns"][0]) == ""


def test_length_and_token_rate_metrics_count_the_policys_tokens() -> None:
    """An episode of 5 policy tokens and 2 environment tokens is 5 tokens long for the rollout metrics."""
    import torch

    from rlctl.engine.metrics import rollout_tokens, step_metrics

    eps = [_episode("a", 0, reward=1.0), _episode("a", 1, reward=0.0)]
    assert [t.num_policy_tokens for t in eps] == [5, 5] and eps[0].num_response_tokens == 7
    single = traj("c", 0, response=(3, 4, 5), reward=1.0)
    assert single.num_policy_tokens == 3
    out = step_metrics(scored=eps, learner_stats={}, adv_stats={}, advantages=torch.ones(2), verify_latencies=[],
                       learner_version=1, times={"T_r": 2.0, "T_v": 0.0, "T_l": 1.0, "T_s": 1.0}, group_size=2)
    assert out["response_length_mean"] == 5 and out["response_length_max"] == 5
    assert out["generated_tokens_per_s"] == 10 / 2.0 and out["learned_tokens_per_s"] == 10 / 1.0
    assert out["episode_env_tokens"] == 4
    tokens = rollout_tokens([*eps, single])
    assert tokens["rollout_real_tokens"] == 13 and tokens["rollout_computed_tokens"] == 3 * 5
    assert tokens["rollout_padding_waste"] == pytest.approx(1 - 13 / 15)
    assert tokens["rollout_prefill_tokens"] == 2 + 2 + 4  # prompts a and c once each, the 4 environment tokens


def test_per_turn_rewards_are_reported_apart_from_the_graders_reward() -> None:
    t = _episode("a", 0, reward=1.0)
    turns = list(t.turns)
    turns[0] = Turn(start=0, end=3, writer=Writer.POLICY, policy_version=1, reward=-0.25)
    m = episode_metrics([t.updated(turns=tuple(turns)), _episode("a", 1, reward=0.0)])
    assert m["episode_turn_reward"] == pytest.approx(-0.125)


def test_a_live_grader_alert_caused_by_tool_failures_says_it_follows_them() -> None:
    from types import SimpleNamespace

    from rlctl.incidents.recovery import _Alerts

    def run(tool_groups: int) -> tuple[list[str], list[dict]]:
        warnings, events = [], []
        registry = SimpleNamespace(add_event=lambda run_id, kind, message, data: events.append(data))
        alerts = _Alerts(registry, "r", warnings.append, start_step=0)
        alerts.books = [b for b in load_runbooks(REPO / "runbooks") if b.name in ("tool-failures", "verifier-timeouts")]
        for step in range(3):
            alerts.observe(step, {"episode_dropped_groups": tool_groups, "groups_dropped": 1,
                                  "episode_tool_error_rate": 0.0, "reward_error_frac": 0.05,
                                  "verifier_fail_frac": 0.0}, [])
        return warnings, events

    warnings, events = run(tool_groups=1)
    grader = next(w for w in warnings if "runbook verifier-timeouts" in w)
    assert "follows tool-failures" in grader and "likely a consequence" in grader
    assert any(e.get("follows") == "tool-failures" for e in events)
    assert not any("follows" in w for w in warnings if "runbook tool-failures" in w)
    warnings, events = run(tool_groups=0)  # the grader's own drops: no tool trigger fires, nothing follows
    assert any("runbook verifier-timeouts" in w for w in warnings) and not any("follows" in w for w in warnings)


def test_a_step_with_every_group_dropped_names_the_causes() -> None:
    from rlctl.engine.groups import unscorable_batch

    err = unscorable_batch([traj("a", 0, reward_error="tool_timeout: calc failed after retries"),
                            traj("a", 1, reward_error="tool_timeout: calc failed after retries"),
                            traj("b", 0, reward_error="timeout"), traj("b", 1, reward=1.0)], verifier_retries=1)
    assert "2 sample(s) whose tool call failed after 1 retries (2 x tool_timeout" in err.message
    assert "1 sample(s) the grader could not score" in err.message and "tool-failures" in err.hint
    err = unscorable_batch([traj("b", 0, reward_error="timeout")], verifier_retries=0)
    assert "tool" not in err.message and "verifier-timeouts" in err.hint


def _history(steps: int, **series) -> History:
    return History(metrics={k: [(s, float(v[s] if isinstance(v, list) else v)) for s in range(steps)]
                            for k, v in series.items()}, events=[])


def test_the_tool_failures_runbook_fires_on_each_trigger() -> None:
    book = next(b for b in load_runbooks(REPO / "runbooks") if b.name == "tool-failures")
    from rlctl.incidents.runbooks import fire

    fired = {f.trigger.id for f in fire(book, _history(4, episode_dropped_groups=[0, 0, 1, 0],
                                                       episode_tool_error_rate=0.1, episode_turn_cap_rate=0.8,
                                                       time_tool_frac=[0.1, 0.6, 0.7, 0.9]))}
    assert fired == {"tool-groups-dropped", "tool-error-rate", "turn-cap-rate", "tool-latency-share"}
    assert not fire(book, _history(6, episode_dropped_groups=0, episode_tool_error_rate=0.01,
                                   episode_turn_cap_rate=0.1, time_tool_frac=0.2))


def test_diagnose_ranks_tool_failures_first_and_the_grader_symptoms_as_their_consequence() -> None:
    # what 10% tool timeouts look like: flagged episodes have no reward, their groups are dropped
    h = _history(8, episode_tool_error_rate=0.1, episode_dropped_groups=2, groups_dropped=2, reward_error_frac=0.12,
                 verifier_fail_frac=0.0, reward_mean=0.5)
    d = diagnose("r", h, load_runbooks(REPO / "runbooks"))
    assert d.findings[0].runbook == "tool-failures" and d.findings[0].branch == "tools"
    grader = next(f for f in d.findings if f.branch == "grader")
    assert "follows tools" in grader.follows and "same step" in grader.follows
    # a grader that itself fails on first tries is its own root, not the tools' consequence
    h.metrics["verifier_fail_frac"] = [(s, 0.3) for s in range(8)]
    d = diagnose("r", h, load_runbooks(REPO / "runbooks"))
    assert not next(f for f in d.findings if f.branch == "grader").follows


def _store(run_dir: Path, steps: dict[int, list[Trajectory]]) -> None:
    log = SampleLog(run_dir, per_step=8)
    for step, trajectories in steps.items():
        log.write_samples(step, trajectories)
    log.close()


def _flagged(pid: str, index: int) -> Trajectory:
    """An episode whose tool call timed out for good: an empty env turn, no reward (its group was dropped)."""
    turns = (Turn(start=0, end=3, writer=Writer.POLICY, policy_version=1),
             Turn(start=3, end=3, writer=Writer.ENV, tool="calculator", tool_status="timeout", tool_seconds=2.0))
    return traj(pid, index, response=(5, 6, 7), reason=TerminalReason.EOS, policy_version=1, turns=turns,
                reward_error="tool_timeout: calculator failed after retries")


def test_stored_episodes_turn_by_turn_newest_last_with_the_runs_tokens(tmp_path) -> None:
    _store(tmp_path, {s: [_episode("a", 0, reward=1.0), _episode("b", 1, reward=0.0), _flagged("b", 0)]
                      for s in range(3)} | {3: [traj("c", 0, reward=1.0, text="42", response=(9, 9))]})
    eps = stored_episodes(tmp_path, n=4, decode=lambda ids: "".join(chr(96 + i) for i in ids))
    assert [(e["step"], e["id"]) for e in eps] == [(2, "a/0"), (2, "b/1"), (2, "b/0"), (3, "c/0")]
    assert [e["status"] for e in eps] == ["trained", "dropped", "dropped", "trained"]  # b's group was dropped
    eps = [eps[0], *eps[2:]]
    assert [e["step"] for e in stored_episodes(tmp_path, step=-2, n=9, decode=str)] == [2, 2, 2]
    assert stored_episodes(tmp_path, step=7, decode=str) == []
    ep, flagged, one = eps
    assert [t["writer"] for t in ep["turns"]] == ["policy", "env", "policy"] and ep["status"] == "trained"
    assert ep["turns"][1] | {"text": ep["turns"][1]["text"]} == {
        "writer": "env", "start": 3, "end": 5, "tokens": [8, 9], "text": "hi", "policy_version": None,
        "reward": None, "tool": "calculator", "tool_status": "ok", "tool_seconds": 0.5, "tool_retries": 0}
    assert ep["policy_tokens"] == 5 and ep["env_tokens"] == 2 and ep["policy_versions"] == [1, 2]
    assert flagged["status"] == "dropped" and flagged["reward"] is None
    assert flagged["turns"][1]["tool_status"] == "timeout" and flagged["turns"][1]["tokens"] == []
    assert not one["multi_turn"] and [t["text"] for t in one["turns"]] == ["ii"]
    plain = stored_episodes(tmp_path, step=3)[0]  # no tokenizer in this run directory: ids, the answer's text
    assert plain["prompt"] == "1 2" and plain["turns"][0]["text"] == "42"
    page = render_html(diagnose("r", History(metrics={}, events=[]), []), History(metrics={}, events=[]), eps)
    episodes = page.split("<h2>Episodes</h2>")[1]
    assert "<div class='turn policy'>" in episodes and "<div class='turn env'>hi</div>" in episodes
    assert "<div class='turn failed'>" in episodes and "tool_timeout" in episodes


def test_rlctl_episodes_renders_and_prints_json(tmp_path) -> None:
    from rlctl.cli.app import build_app
    from rlctl.registry.store import Registry

    with Registry.open(f"sqlite:///{tmp_path / 'reg.db'}") as reg:
        run = reg.create_run(name="t", config={}, config_hash="h", code_version="c", dataset_version="d",
                             tokenizer_hash="t", seed=0, run_dir=str(tmp_path / "run"))
    _store(tmp_path / "run", {0: [_episode("a", 0, reward=1.0, reward_components={"correct": 1.0}),
                                  _flagged("b", 0)]})
    app, url = build_app(with_plugins=False), f"sqlite:///{tmp_path / 'reg.db'}"
    out = CliRunner().invoke(app, ["episodes", run.id, "--json", "--registry", url])
    assert out.exit_code == 0, out.output
    body = json.loads(out.output)
    assert [e["id"] for e in body["episodes"]] == ["a/0", "b/0"]
    assert body["episodes"][1]["reward"] is None and body["episodes"][1]["turns"][1]["tool_status"] == "timeout"
    text = CliRunner().invoke(app, ["episodes", run.id, "--step", "0", "--n", "1", "--registry", url])
    assert text.exit_code == 0 and "b/0" in text.output and "env calculator timeout 2.000s" in text.output
    assert "a/0" not in text.output and "tool_timeout" in text.output
    empty = CliRunner().invoke(app, ["episodes", run.id, "--step", "7", "--registry", url])
    assert empty.exit_code == 0 and "no stored episodes at step 7" in empty.output


@pytest.mark.parametrize(("kind", "options", "status"), [("tool-timeout", {}, "timeout"), ("tool-error", {}, "error"),
                                                          ("tool-error", {"delay_s": 0.5}, "timeout")])
def test_the_tools_environment_flags_an_injected_failure_of_the_real_calculator(kind, options, status) -> None:
    """The built-in environment's timed call: an injected TimeoutError or ToolError is the matching tool_status;
    a fault slower than the step deadline is a timeout however it ends."""
    from rlctl.config.models import EnvironmentConfig
    from rlctl.engine.episodes import build_environment
    from rlctl.hooks.manager import load_plugins

    plugins = load_plugins()
    env = build_environment(plugins, EnvironmentConfig(name="tools", options={
        "tools": {"calc": {"tool": "calculator"}}, "limits": {"step_timeout_s": 0.2}}), tokenizer=None)
    episode = env.start("p1", (1, 2))
    assert episode._call("calc", "6*7")[:2] == ("ok", "42")
    ctx, disarm = _armed(plugins, kind, rate=1.0, target="calc", **options)
    try:
        got, why, _ = episode._call("calc", "6*7")
    finally:
        disarm()
    assert got == status and ctx.num_fired == 1, why


def test_rlctl_inject_builds_tool_fault_specs_and_refuses_bad_options() -> None:
    from rlctl.contracts.errors import ConfigError
    from rlctl.hooks.manager import load_plugins
    from rlctl.incidents.inject import fault_override, make_spec

    plugins = load_plugins()
    spec = make_spec("tool-timeout", at_step=None, count=None, rate=0.1, target="calc", options=["delay_s=0.5"],
                     plugins=plugins)
    assert json.loads(fault_override(spec).partition("=")[2]) == [
        {"kind": "tool-timeout", "rate": 0.1, "target": "calc", "options": {"delay_s": 0.5}}]
    with pytest.raises(ConfigError, match="delay"):
        make_spec("tool-error", at_step=None, count=None, rate=None, target=None, options=["delay=1"],
                  plugins=plugins)
