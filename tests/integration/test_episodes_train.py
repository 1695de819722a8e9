"""``rlctl train`` with ``rollout.environment``: the tiny model trains on multi-turn episodes with the calculator,
in every mode (and async on Ray), and the async queue carries whole episodes (turns, masks) with a clean audit."""

from __future__ import annotations

import pytest

from tests.conftest import TINY_OVERRIDES

TOOLS = """
rollout:
  max_tokens: 16
  environment:
    name: tools
    options:
      tools: {calc: {tool: calculator}}
      limits: {max_turns: 3, max_total_tokens: 16, step_timeout_s: 2}
"""


@pytest.mark.parametrize("mode", ["sync", "one_step_off", "async"])
def test_train_two_steps_on_tool_episodes(plugins, _rlctl_home, tmp_path, tiny_policy_dir, mode):
    from rlctl.config.load import load_config
    from rlctl.engine.ledger import audit
    from rlctl.engine.queue import TrajectoryQueue
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS)
    config = load_config(path, [*[o for o in TINY_OVERRIDES if not o.startswith("rollout.max_tokens")],
                                f"mode={mode}", "train.steps=2", "eval.at_end=false", "checkpoint.every_steps=0",
                                "staleness.max_staleness=1"])
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        result = train(config, registry=reg, plugins=plugins, home=_rlctl_home, run_dir=tmp_path / "run")
        assert result.run.status == "succeeded"
        steps = {p.step for p in reg.metrics(result.run.id)}
    assert steps == {0, 1}
    if mode == "sync":  # no queue: the async path below checks what the queue carries
        return
    report = audit(tmp_path / "run" / "queue")
    assert report.double_counted == 0 and report.lost == () and report.trained == 8
    queue = TrajectoryQueue(tmp_path / "run" / "queue")
    try:
        samples = [t for g in queue._iter_log() for t in g.trajectories]
    finally:
        queue.close()
    assert samples and all(t.turns and t.verify() for t in samples)
    for t in samples:
        assert len(t.response_tokens) <= 16
        for turn in t.turns:
            assert set(t.action_mask[turn.start:turn.end]) <= ({1} if turn.writer.value == "policy" else {0})


@pytest.mark.ray
def test_ray_async_rollout_actors_run_episodes(ray_cluster, plugins, _rlctl_home, tmp_path, tiny_policy_dir):
    """The Ray placement builds each rollout actor's backend with the episode driver (the actor gets the whole
    rollout section), so async training on Ray runs episodes and the audit stays clean."""
    from rlctl.engine.ledger import audit
    from rlctl.engine.queue import TrajectoryQueue
    from tests.integration.test_ray import run_ray

    env = ("rollout.environment={name: tools, options: {tools: {calc: {tool: calculator}}, "
           "limits: {max_turns: 3, max_total_tokens: 6}}}")
    done = run_ray(plugins, _rlctl_home, tmp_path / "ray", "mode=async", "train.steps=2", env)
    assert [s for s, _ in done.rows] == [0, 1] and done.version == 2
    report = audit(tmp_path / "ray" / "queue")
    assert report.lost == () and report.double_counted == 0 and report.trained == 8
    queue = TrajectoryQueue(tmp_path / "ray" / "queue")
    try:
        assert all(t.turns and t.verify() for g in queue._iter_log() for t in g.trajectories)
    finally:
        queue.close()
