"""Sharded checkpoints of the DeepSpeed learner (CPU processes, gloo): save, reshard on load, export.

A 2-rank ZeRO-3 learner trains 2 steps and writes its shards through the
checkpoint store (COMMITTED manifest, per-file sha256), in the FSDP2 learner's
layout. A 1-rank ZeRO-3 learner loads it (2 -> 1) and must hold bitwise the
saved weights; its next step must agree with the 2-rank learner's own next
step to 1e-6. It checkpoints again and a 2-rank ZeRO-2 learner loads that
(1 -> 2, and a different stage): bitwise the saved weights, AdamW moments
included (its next step agrees with the 1-rank learner's to 1e-6). The
consolidated ``export_hf`` equals the gathered weights, and since the layout is
the FSDP2 learner's, a 1-rank FSDP2 learner loads the ZeRO-3 checkpoint too
(bitwise; its next step within 1e-6). Skipped without the deepspeed extra.
"""

from __future__ import annotations

import pytest

from tests.helpers import learner_context, rollout_batch
from tests.unit.test_fsdp_checkpoint import _commit, _max_diff, _two_ranks_commit_then_step

pytest.importorskip("deepspeed", reason="needs deepspeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session


def _learner(session, world: int, stage: int):
    from rlctl_deepspeed_learner.learner import DeepSpeedLearner
    from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions

    return DeepSpeedLearner(learner_context(session, micro_batch_size=8),
                            DeepSpeedLearnerOptions(zero_stage=stage, world_size=world, rank_timeout_s=60))


def test_zero3_save_reshard_two_to_one_then_one_to_two_under_zero2_then_export(session, tmp_path):
    from safetensors.torch import load_file

    from rlctl.engine.checkpoint import DiskCheckpointStore, export_hf, load_checkpoint

    batch = rollout_batch(session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    store = DiskCheckpointStore(tmp_path / "ckpt", keep_last=5, async_save=False)

    two = _learner(session, 2, 3)
    path, saved, after_two, next_two = _two_ranks_commit_then_step(store, two, batch, session)

    one = _learner(session, 1, 3)  # 2 -> 1: the one rank reads both pieces of every tensor
    try:
        one.load_shards(load_checkpoint(path).learner)
        assert one.policy_version == 2
        assert _max_diff(one.export_weights().state_dict, saved) == 0.0
        after_one = one.train_step(batch)
        assert abs(after_one["loss"] - after_two["loss"]) <= 1e-6
        assert _max_diff(one.export_weights().state_dict, next_two) <= 1e-6
        path_one = _commit(store, one, 3, session)
        saved_one = one.export_weights().state_dict
        next_one = (one.train_step(batch), one.export_weights().state_dict)
    finally:
        one.close()

    again = _learner(session, 2, 2)  # 1 -> 2 under ZeRO-2: each rank keeps its partition of the full tensors
    try:
        again.load_shards(load_checkpoint(path_one).learner)
        assert again.policy_version == 3
        assert _max_diff(again.export_weights().state_dict, saved_one) == 0.0
        stats = again.train_step(batch)  # the moments, step count and LR came back too
        assert abs(stats["loss"] - next_one[0]["loss"]) <= 1e-6
        assert _max_diff(again.export_weights().state_dict, next_one[1]) <= 1e-6
    finally:
        again.close()

    exported = export_hf(path, tmp_path / "hf")
    weights = load_file(exported / "model.safetensors")
    assert set(weights) <= set(saved) and "model.embed_tokens.weight" in weights
    assert max(float((v - saved[k]).abs().max()) for k, v in weights.items()) == 0.0

    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    fsdp = FsdpLearner(learner_context(session, micro_batch_size=8), FsdpLearnerOptions(world_size=1,
                                                                                        rank_timeout_s=60))
    try:
        fsdp.load_shards(load_checkpoint(path).learner)
        assert fsdp.policy_version == 2
        assert _common_diff(fsdp.export_weights().state_dict, saved) == 0.0
        stats = fsdp.train_step(batch)
        assert abs(stats["loss"] - after_two["loss"]) <= 1e-6
        assert _common_diff(fsdp.export_weights().state_dict, next_two) <= 1e-6
    finally:
        fsdp.close()


def _common_diff(a: dict, b: dict) -> float:
    """Largest difference over the names both hold (the learners differ in listing a tied alias)."""
    common = set(a) & set(b)
    assert "model.embed_tokens.weight" in common and len(common) >= len(b) - 1
    return max(float((a[k] - b[k]).abs().max()) for k in common)



def test_bf16_zero2_checkpoint_restores_the_fp32_masters_and_moments(session, tmp_path):
    """bf16 mode: the checkpoint holds the fp32 master weights (not the bf16 compute copy); a fresh learner that
    loads it steps exactly like the one that saved it (1 rank, ZeRO-2: the bf16 copy is refreshed from the master)."""
    from dataclasses import replace

    from rlctl_deepspeed_learner.learner import DeepSpeedLearner
    from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions

    from rlctl import CheckpointError
    from rlctl.engine import shards
    from rlctl.engine.checkpoint import DiskCheckpointStore, load_checkpoint

    def bf16():
        return DeepSpeedLearner(learner_context(session, micro_batch_size=8),
                                DeepSpeedLearnerOptions(zero_stage=2, world_size=1, dtype="bfloat16"))

    batch = rollout_batch(session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    store = DiskCheckpointStore(tmp_path / "ckpt", keep_last=5, async_save=False)
    first = bf16()
    try:
        for _ in range(2):
            first.train_step(batch)
        path = _commit(store, first, 2, session)
        saved = first.export_weights().state_dict
        after = (first.train_step(batch), first.export_weights().state_dict)
    finally:
        first.close()
    import torch

    assert {dtype for _, dtype in shards.shapes(f"{path}/shards").values()} == {torch.float32}
    second = bf16()
    try:
        second.load_shards(load_checkpoint(path).learner)
        assert _max_diff(second.export_weights().state_dict, saved) == 0.0
        stats = second.train_step(batch)
        assert stats["loss"] == after[0]["loss"]
        assert _max_diff(second.export_weights().state_dict, after[1]) == 0.0
        other = tmp_path / "other-model"  # shards of a model with another shape: one error naming the tensor
        shards.dcp_save({"model.model.norm.weight": torch.ones(7)}, other)
        with pytest.raises(CheckpointError, match=r"model shape changed since the checkpoint: .* is missing"):
            second.load_shards(replace(load_checkpoint(path).learner, shard_dir=str(other)))
    finally:
        second.close()
