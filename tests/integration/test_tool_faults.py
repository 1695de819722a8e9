"""Injected tool timeouts end to end: flagged episodes are never scored, their groups are dropped and counted, the
tool-failures runbook fires live, and `rlctl diagnose` ranks tool failures first.

The tiny model does not write the tool syntax, so the environment is the built-in ``scripted-tools``: every
episode's first policy turn counts as a call (``6*7`` to the calculator; ``print(6*7)`` to the ``python`` tool in
the sandbox), made through the real timed call and the real ``tool.call`` fault site; the second turn ends it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES

BASE = [*TINY_OVERRIDES, "train.deterministic=true", "eval.at_end=false", "train.metric_sinks=[]",
        "checkpoint.every_steps=0", "algo.prompts_per_step=8", "rollout.max_tokens=16"]


def scripted(tool: str = "calculator", call: str = "6*7", step_timeout_s: float = 2) -> str:
    """The ``rollout.environment`` override: ``scripted-tools`` calling ``tool`` (named ``t``) with ``call``."""
    return (f"rollout.environment={{name: scripted-tools, options: {{tools: {{t: {{tool: {tool}}}}}, call: '{call}', "
            f"observation: '={{result}}', limits: {{max_turns: 2, max_total_tokens: 16, "
            f"step_timeout_s: {step_timeout_s}}}}}}}")


ENV = scripted()


def _train(home: Path, tmp: Path, *overrides: str, env: str = ENV):
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    cfg = load_config(None, [*BASE, env, *overrides])
    registry = Registry.open(f"sqlite:///{tmp / 'registry.db'}")
    run_dir = tmp / "run"
    result = train(cfg, registry=registry, plugins=load_plugins(),
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


@pytest.mark.ray
@pytest.mark.slow
def test_async_on_ray_with_the_python_tool_in_the_sandbox_survives_a_sigkilled_rollout_worker(
        ray_cluster, needs_sandbox, _rlctl_home, tmp_path, tiny_policy_dir):
    """Issue 24's acceptance: the tool-calling task trains in async mode on Ray with the ``python`` tool running
    the code in the bubblewrap sandbox inside the rollout actors; a rollout actor is SIGKILLed mid-run
    (``worker-crash``) and the audit finds nothing lost or trained twice. Tool timeouts injected at 10% are armed
    inside the rollout actors (the only place tools run): the timed-out episodes are flagged, never scored, and
    their groups dropped whole and counted."""
    from transformers import AutoTokenizer

    from rlctl.engine.ledger import audit
    from rlctl.engine.samples import read_samples
    from tests.integration.test_faults import _events

    pytest.importorskip("ray", reason="needs ray: pip install -e '.[ray]'")
    steps, g = 4, 4
    faults = [{"kind": "worker-crash", "at_step": 2, "count": 2}, {"kind": "tool-timeout", "rate": 0.1}]
    result, reg, run_dir = _train(
        _rlctl_home, tmp_path, "cluster.backend=ray", "cluster.rollout_num_cpus=0.5", "cluster.learner_num_cpus=0.5",
        "mode=async", "staleness.max_staleness=1", f"train.steps={steps}", "staleness.take_timeout_s=300",
        "faults.verifier_retries=0", "faults.inject=" + json.dumps(faults),
        env=scripted("python", "print(6*7)", step_timeout_s=10))
    assert result.run.status == "succeeded"
    crashed = [e for e in _events(reg, run_dir, "fault_injected") if e.data["kind"] == "worker-crash"]
    assert 1 <= len(crashed) <= 2 and all(e.data["worker"].startswith("ray-") for e in crashed), crashed
    lost = _events(reg, run_dir, "rollout_worker_lost")
    assert sum(e.data["failures"] for e in lost) == len(crashed)
    report = audit(run_dir / "queue")
    assert report.lost == () and report.double_counted == 0
    m = {(p.step, p.name): p.value for p in reg.metrics(result.run.id)}
    total = lambda name: sum(m[(s, name)] for s in range(steps))  # noqa: E731
    assert total("episode_tool_calls") >= steps * 8 * g / 2
    assert total("episode_dropped_groups") > 0 and total("time_tool_s") > 0
    for s in range(steps):
        assert m[(s, "episode_dropped_groups")] == m[(s, "groups_dropped")]
        assert m[(s, "reward_error_count")] == m[(s, "groups_dropped")] * g
    stored = [t for _, trajectories in read_samples(run_dir) for t in trajectories]
    ran = [t for t in stored if any(u.tool == "t" and u.tool_status == "ok" for u in t.turns)]
    # the sandboxed interpreter ran print(6*7): its stdout is the environment's answer
    tok = AutoTokenizer.from_pretrained(tiny_policy_dir)
    answers = {tok.decode(list(t.response_tokens[u.start:u.end])) for t in ran for u in t.turns
               if u.writer.value == "env"}
    assert answers and all(a.startswith("=42") for a in answers), answers
    timed_out = [t for t in stored if any(u.tool_status == "timeout" for u in t.turns)]
    assert timed_out and all(t.reward is None and t.reward_error.startswith("tool_timeout") for t in timed_out)
    print(f"\nRay async, python tool in the sandbox: {len(crashed)} rollout actor(s) SIGKILLed, "
          f"{int(total('episode_tool_calls'))} tool calls ({len(ran)} stored samples ran print(6*7)), "
          f"{total('episode_tool_error_rate') / steps:.0%} timed out, {int(total('episode_dropped_groups'))} groups "
          f"dropped; audit: {len(report.lost)} lost, {report.double_counted} trained twice")

