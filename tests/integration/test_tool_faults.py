"""Injected tool timeouts end to end: flagged episodes are never scored, their groups are dropped and counted, the
tool-failures runbook fires live, and `rlctl diagnose` ranks tool failures first.

The tiny model does not know the tool syntax, so the environment here is the built-in ``tools`` environment with
one change: every episode's first policy turn counts as a call ``<calc>6*7</calc>`` (the real calculator, through
the real ``tool.call`` fault site, timed against the real step deadline); the second turn ends the episode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlctl import hookimpl
from tests.conftest import TINY_OVERRIDES

BASE = [*TINY_OVERRIDES, "train.deterministic=true", "eval.at_end=false", "train.metric_sinks=[]",
        "checkpoint.every_steps=0", "algo.prompts_per_step=8", "rollout.max_tokens=16"]
ENV = ("rollout.environment={name: first_turn_calls, options: {tools: {calc: {tool: calculator}}, "
       "observation: '={result}', limits: {max_turns: 2, max_total_tokens: 16, step_timeout_s: 2}}}")


class _FirstTurnCalls:
    @hookimpl
    def register_environments(self, register):
        from rlctl_envs.tools_env import FAILED, ToolsEnvironment, ToolsEnvOptions, ToolsEpisode

        from rlctl.contracts.types import EnvStep

        class Episode(ToolsEpisode):
            answered = False

            def step(self, policy_tokens):
                if self.answered:
                    return EnvStep(done=True)
                status, result, seconds = self._call("calc", "6*7")  # the real timed call
                if status in FAILED:  # a retry (same episode object) calls again
                    return EnvStep(done=True, tool="calc", tool_status=status, tool_seconds=seconds,
                                   info={"error": result})
                self.answered = True
                return EnvStep(observation=self.env.observe(result), tool="calc", tool_status=status,
                               tool_seconds=seconds)

        class Env(ToolsEnvironment):
            def start(self, prompt_id, prompt_tokens, row=None):
                return Episode(self, f"{prompt_id}#{next(self._counter)}")

        register("first_turn_calls", lambda options, ctx: Env(options, ctx), options=ToolsEnvOptions)


def _train(home: Path, tmp: Path, *overrides: str):
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    cfg = load_config(None, [*BASE, ENV, *overrides])
    registry = Registry.open(f"sqlite:///{tmp / 'registry.db'}")
    run_dir = tmp / "run"
    result = train(cfg, registry=registry, plugins=load_plugins(extra={"first_turn_calls": _FirstTurnCalls()}),
                   home=home, run_dir=run_dir)
    return result, registry, run_dir


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ten_percent_tool_timeouts_are_flagged_dropped_whole_counted_alerted_and_diagnosed(_rlctl_home, tmp_path,
                                                                                            mode):
    from rlctl.engine.samples import read_samples
    from rlctl.incidents.diagnose import diagnose_run

    steps, g = 4, 4
    result, reg, run_dir = _train(_rlctl_home, tmp_path, f"mode={mode}", f"train.steps={steps}",
                                  "faults.verifier_retries=0",
                                  "faults.inject=[{kind: tool-timeout, rate: 0.1}]")
    assert result.run.status == "succeeded"
    run_id = result.run.id
    m = {(p.step, p.name): p.value for p in reg.metrics(run_id)}
    total = lambda name: sum(m[(s, name)] for s in range(steps))  # noqa: E731
    # every episode whose first turn left room in its token budget called the tool
    assert total("episode_tool_calls") >= steps * 8 * g / 2
    assert 0.02 < total("episode_tool_error_rate") / steps < 0.25  # ~10% of calls timed out
    assert total("episode_dropped_groups") > 0
    for s in range(steps):
        # every dropped group was a tool failure's, and none of its samples was scored (no zero reward)
        assert m[(s, "episode_dropped_groups")] == m[(s, "groups_dropped")]
        assert m[(s, "reward_error_count")] == m[(s, "groups_dropped")] * g
        assert m[(s, "episode_turns_mean")] >= 1 and m[(s, "time_tool_s")] >= 0
    stored = [t for _, trajectories in read_samples(run_dir) for t in trajectories]
    flagged = [t for t in stored if t.reward_error is not None]
    timed_out = [t for t in flagged if any(u.tool_status == "timeout" for u in t.turns)]
    assert timed_out and all(t.reward is None and t.reward_error.startswith("tool_timeout") for t in timed_out)
    alerts = [e for e in reg.events(run_id) if e.kind == "alert" and e.data["runbook"] == "tool-failures"]
    assert alerts, [e.message for e in reg.events(run_id) if e.kind == "alert"]
    # the grader's alerts on the drops the tool failures cause say so, live; the drop events name the cause
    grader = [e for e in reg.events(run_id) if e.kind == "alert" and e.data["trigger"] == "groups-dropped"]
    assert grader and all(e.data.get("follows") == "tool-failures" for e in grader), [e.message for e in grader]
    drops = [e for e in reg.events(run_id) if e.kind == "groups_dropped"]
    assert drops and all("tool call failed" in e.message and "grader" not in e.message for e in drops)
    diagnosis = diagnose_run(reg, run_id)
    assert diagnosis.findings[0].runbook == "tool-failures", [f.headline for f in diagnosis.findings]
    assert json.loads((run_dir / "samples.jsonl").read_text().splitlines()[0])["samples"][0]["turns"]
