"""Sharded checkpoints of the FSDP2 learner (2 CPU processes, gloo): save, reshard on load, export.

A 2-rank learner trains 2 steps and writes its shards through the checkpoint
store (COMMITTED manifest, per-file sha256); a 1-rank learner loads that
checkpoint (2 -> 1) and must hold bitwise the saved weights, then one more step
must agree with the 2-rank learner's own next step to 1e-6. The 1-rank learner
checkpoints again and a 2-rank learner loads it (1 -> 2). The consolidated
export of the sharded checkpoint equals the gathered full weights.
"""

from __future__ import annotations

import pytest
import torch

from rlctl.contracts.types import LearnerContext
from rlctl.contracts.checkpoints import CheckpointState
from tests.helpers import learner_context, rollout_batch

pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session


def _ctx(session) -> LearnerContext:
    return learner_context(session, micro_batch_size=8)


def _learner(session, world: int):
    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    return FsdpLearner(_ctx(session), FsdpLearnerOptions(world_size=world, rank_timeout_s=60))


def _commit(store, learner, step: int, session) -> str:
    """Write the learner's shards through the store's commit protocol (the rest of the state is a stand-in)."""
    from rlctl.contracts.checkpoints import ShadowBatch

    state = learner.save_shards(store.stage_shards(step))
    z = torch.zeros((1, 2))
    store.save(CheckpointState(
        step=step, learner=state, rollout=None, cursor={"epoch": 0, "position": 0}, rng={},
        shadow=ShadowBatch(input_ids=z.long(), attention_mask=z.long(), action_mask=z.clone(), logprobs=z.clone(),
                           sampling=session.sampling),
        run_id="r", config={}, config_hash="c", code_version="v", dataset_version="d", tokenizer_hash="t",
        tokenizer_dir=str(session.policy_dir)))
    store.wait()
    return str(store.root / f"step-{step:06d}")


def _two_ranks_commit_then_step(store, two, batch, session):
    """Two steps on ``two`` (a 2-rank learner, closed after), a sharded checkpoint of step 2 checked for one
    manifest file per rank, then one more step: (path, weights saved, stats after, weights after)."""
    from rlctl.engine.checkpoint import verify

    try:
        for _ in range(2):
            two.train_step(batch)
        path = _commit(store, two, 2, session)
        saved = two.export_weights().state_dict
        after_two = two.train_step(batch)
        next_two = two.export_weights().state_dict
    finally:
        two.close()

    manifest = verify(path)
    shard_files = [f.path for f in manifest.files if f.path.startswith("shards/")]
    assert len(shard_files) == 2, shard_files  # one file per rank, each in the manifest with its sha256
    assert not any(f.path == "model/model.safetensors" for f in manifest.files)
    return path, saved, after_two, next_two


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_save_reshard_two_to_one_and_one_to_two_then_export(session, tmp_path):
    from safetensors.torch import load_file

    from rlctl.engine.checkpoint import DiskCheckpointStore, export_hf, load_checkpoint

    batch = rollout_batch(session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    store = DiskCheckpointStore(tmp_path / "ckpt", keep_last=5, async_save=False)

    two = _learner(session, 2)
    path, saved, after_two, next_two = _two_ranks_commit_then_step(store, two, batch, session)

    # 2 -> 1: the one rank reads both pieces of every tensor
    one = _learner(session, 1)
    try:
        one.load_shards(load_checkpoint(path).learner)
        assert one.policy_version == 2
        assert _max_diff(one.export_weights().state_dict, saved) == 0.0
        after_one = one.train_step(batch)
        assert abs(after_one["loss"] - after_two["loss"]) <= 1e-6
        assert _max_diff(one.export_weights().state_dict, next_two) <= 1e-6
        path_one = _commit(store, one, 3, session)
        saved_one = one.export_weights().state_dict
    finally:
        one.close()

    # 1 -> 2: each rank reads its half of the one rank's file
    again = _learner(session, 2)
    try:
        again.load_shards(load_checkpoint(path_one).learner)
        assert again.policy_version == 3
        assert _max_diff(again.export_weights().state_dict, saved_one) == 0.0
    finally:
        again.close()

    exported = export_hf(path, tmp_path / "hf")
    weights = load_file(exported / "model.safetensors")
    assert set(weights) <= set(saved) and "model.embed_tokens.weight" in weights
    assert max(float((v - saved[k]).abs().max()) for k, v in weights.items()) == 0.0
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(exported)
    assert float((model.lm_head.weight.detach() - saved["model.embed_tokens.weight"]).abs().max()) == 0.0


def test_a_sharded_checkpoint_is_refused_by_the_torch_learner(session, tmp_path):
    """Loading shards needs a sharded learner; the error names the way out."""
    from rlctl.contracts.errors import CheckpointError
    from rlctl.engine.snapshot import restore
    from rlctl.contracts.checkpoints import LearnerState

    state = LearnerState(policy_version=1, weights={}, model_files={}, optimizer={}, scheduler={},
                         shard_dir=str(tmp_path))
    fake = CheckpointState(step=1, learner=state, rollout=None, cursor={}, rng={}, shadow=None, run_id="r",
                           config={}, config_hash="c", code_version="v", dataset_version="d", tokenizer_hash="t",
                           tokenizer_dir="")
    with pytest.raises(CheckpointError, match="sharded"):
        restore(session, fake, 1e-4)
