"""A sharded learner (fsdp2, deepspeed) under cluster.backend=ray: its ranks are Ray actors.

1. Through the Ray ranks, FSDP2 and DeepSpeed ZeRO-3 on 2 rank actors give the
   same losses, log-probs and parameters as the single-process torch learner
   (<= 1e-5 in fp32). A rank killed while idle is never served from its
   initial state: the next call is LearnerLost, the group is restarted and
   rejoined, and restoring its sharded checkpoint puts it back on the same
   trajectory as the learner that was never killed.
2. A whole run, mode=async with the fsdp2 ranks as Ray actors: a rank is
   SIGKILLed mid-step by the learner-crash fault; the run restores the newest
   sharded checkpoint into the restarted group and finishes, nothing lost or
   trained twice; the final policy is written and `rlctl resume` is not needed.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace
from functools import partial

import pytest
import torch

from tests.helpers import learner_context, rollout_batch
from tests.integration.test_faults import _events, _run_id, _train

pytestmark = [pytest.mark.ray, pytest.mark.slow]
pytest.importorskip("ray", reason="needs ray: pip install -e '.[ray]'")


def _ray_ctx(session):
    from rlctl.config.models import ClusterConfig
    from rlctl.placement.ray_ranks import RayRanks

    cluster = ClusterConfig(backend="ray", learner_num_cpus=0.5, max_restarts=2)
    return replace(learner_context(session, micro_batch_size=5), rank_launcher=partial(RayRanks, cluster))


def _sharded(name: str, ctx):
    if name == "fsdp2":
        from rlctl_fsdp_learner.learner import FsdpLearner
        from rlctl_fsdp_learner.options import FsdpLearnerOptions

        return FsdpLearner(ctx, FsdpLearnerOptions(world_size=2, rank_timeout_s=30))
    pytest.importorskip("deepspeed")
    from rlctl_deepspeed_learner.learner import DeepSpeedLearner
    from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions

    return DeepSpeedLearner(ctx, DeepSpeedLearnerOptions(world_size=2, zero_stage=3, rank_timeout_s=30))


def _assert_same_step(a, b, step):
    assert a["grad_norm"] > 0.05, "clipping must be active for this test to mean anything"
    for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
        assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])


def _wait_restarted(ranks, rank: int, old: int) -> None:
    """Ray restarts a rank killed while idle without any call failing; wait for the new process."""
    import ray

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if ray.get(ranks.actors[rank].pid.remote(), timeout=5) != old:
                return
        except Exception:  # noqa: BLE001 - restarting
            time.sleep(0.2)
    raise AssertionError("Ray did not restart the killed rank")


@pytest.mark.parametrize("name", ["fsdp2", "deepspeed"])
def test_rank_actors_match_the_torch_learner_and_a_killed_rank_is_restored_from_its_shards(
        ray_cluster, tiny_session, tmp_path, name):
    from rlctl.contracts.errors import LearnerLost
    from rlctl.kit import TorchLearner, TorchLearnerOptions
    from rlctl.placement.ray_actors import StoredWeights

    session = tiny_session
    batch = rollout_batch(session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    single = TorchLearner(learner_context(session, micro_batch_size=5), TorchLearnerOptions(share_prompt_prefill=False))
    learner = _sharded(name, _ray_ctx(session))
    try:
        assert learner.ranks.remote and learner.resident_tensors() == {}  # no shard in the driver
        torch.testing.assert_close(learner.logprobs(batch), single.logprobs(batch), rtol=0, atol=1e-5)
        before = single.logprobs(batch)
        stats, captured = learner.train_step_with_logprobs(batch)  # one pass: the update and log pi before it
        _assert_same_step(single.train_step(batch), stats, 0)
        on = batch.action_mask > 0
        assert float((captured - before)[on].abs().max()) <= 1e-5
        _assert_same_step(single.train_step(batch), learner.train_step(batch), 1)
        (tmp_path / "shards").mkdir()
        state = learner.save_shards(str(tmp_path / "shards"))
        assert state.shard_dir and state.counters["world_size"] == 2 and state.policy_version == 2

        pid = learner.ranks.pids()[1]
        os.kill(pid, signal.SIGKILL)  # while idle: Ray restarts it silently, holding its initial weights
        _wait_restarted(learner.ranks, 1, pid)
        with pytest.raises(LearnerLost, match="learner rank 1"):
            learner.train_step(batch)
        with pytest.raises(LearnerLost):  # every rank of the new group waits for its state
            learner.logprobs(batch)
        learner.load_shards(state)  # what the overlapped loop's recovery does
        assert learner.policy_version == 2

        _assert_same_step(single.train_step(batch), learner.train_step(batch), 2)
        got, want = learner.export_weights(), single.export_weights()
        assert isinstance(got.state_dict, StoredWeights) and got.version == want.version == 3
        worst = max(float((got.state_dict[k] - v).abs().max()) for k, v in want.state_dict.items())
        assert worst <= 1e-5, worst
        learner.save_pretrained(str(tmp_path / "policy"))
        assert (tmp_path / "policy" / "model.safetensors").is_file()
    finally:
        learner.close()
    with pytest.raises(Exception, match="down|closed"):
        learner.logprobs(batch)


def test_async_run_with_fsdp2_rank_actors_survives_a_rank_killed_mid_step(ray_cluster, _rlctl_home, tmp_path):
    from rlctl.engine.ledger import audit

    steps = 4
    result, reg, run_dir = _train(
        _rlctl_home, tmp_path, "ray-fsdp2", "cluster.backend=ray", "cluster.rollout_num_cpus=0.5",
        "cluster.learner_num_cpus=0.5", "cluster.num_rollout_workers=2", "mode=async", "staleness.max_staleness=1",
        "train.learner=fsdp2", "train.learner_options.world_size=2", "train.learner_options.rank_timeout_s=60",
        f"train.steps={steps}", "checkpoint.every_steps=1", "staleness.take_timeout_s=300",
        "faults.inject=" + json.dumps([{"kind": "learner-crash", "at_step": 2}]))
    assert result.run.status == "succeeded"
    [fired] = _events(reg, run_dir, "fault_injected")
    assert fired.data["kind"] == "learner-crash" and fired.data["step"] == 2  # in one rank actor, once
    [restart] = _events(reg, run_dir, "learner_restarted")
    assert restart.data["restarts"] == 1
    m = {(p.step, p.name): p.value for p in reg.metrics(_run_id(run_dir))}
    assert sorted({s for s, name in m if name == "reward_mean"}) == list(range(steps))
    assert m[(steps - 1, "learner_restarts")] == 1
    report = audit(run_dir / "queue")
    assert report.lost == () and report.double_counted == 0
    shards = sorted((run_dir / "checkpoints").glob("*/shards"))
    assert shards and all(any(p.iterdir()) for p in shards)  # every checkpoint of the run is sharded
    assert (run_dir / "policy" / "final" / "model.safetensors").is_file()
