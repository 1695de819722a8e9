"""The commit protocol around a sharded learner's files, without processes (one "rank" writes with DCP here).

The shard files are listed in COMMITTED with their sha256 like every other file: a flipped byte in one
is named by verify and a resume falls back to the previous checkpoint; a sharded checkpoint needs no
model/model.safetensors, exports by consolidating its pieces, and restores only into a sharded learner.
"""

from __future__ import annotations

import pytest
import torch

from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.types import SamplingConfig
from rlctl.contracts.checkpoints import CheckpointState, LearnerState, ShadowBatch
from rlctl.engine import shards
from rlctl.engine.checkpoint import DiskCheckpointStore, export_hf, load_checkpoint, verify


def _state(step: int, shard_dir: str, model_dir) -> CheckpointState:
    z = torch.zeros((1, 2))
    return CheckpointState(
        step=step, learner=LearnerState(policy_version=step, weights={}, model_files={"config.json": "{}"},
                                        optimizer={"param_groups": []}, scheduler={}, shard_dir=shard_dir),
        rollout=None, cursor={"epoch": 0, "position": 0}, rng={},
        shadow=ShadowBatch(input_ids=z.long(), attention_mask=z.long(), action_mask=z.clone(), logprobs=z.clone(),
                           sampling=SamplingConfig(max_tokens=4)),
        run_id="r", config={}, config_hash="c", code_version="v", dataset_version="d", tokenizer_hash="t",
        tokenizer_dir=str(model_dir))


def _save(store, step, weights, tmp_path):
    directory = store.stage_shards(step)
    shards.dcp_save({shards.MODEL + k: v for k, v in weights.items()} | {"optim.w.exp_avg": torch.ones(3)},
                    directory)
    store.save(_state(step, directory, tmp_path))
    store.wait()
    return store.root / f"step-{step:06d}"


def test_shard_files_are_committed_verified_exported_and_fall_back_when_corrupt(tmp_path):
    store = DiskCheckpointStore(tmp_path / "ckpt", keep_last=3, async_save=True)
    first = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.tensor([1.0, 2.0])}
    _save(store, 1, first, tmp_path)
    path = _save(store, 2, {k: v + 1 for k, v in first.items()}, tmp_path)
    manifest = verify(path)
    listed = {f.path for f in manifest.files}
    assert "model/model.safetensors" not in listed and any(p.startswith("shards/") for p in listed)
    state = load_checkpoint(path)
    assert state.learner.shard_dir == str(path / "shards") and state.learner.weights == {}
    assert torch.equal(shards.read_full_model(path / "shards")["w"], first["w"] + 1)
    from safetensors.torch import load_file

    exported = load_file(export_hf(path, tmp_path / "hf") / "model.safetensors")
    assert set(exported) == {"w", "b"} and torch.equal(exported["b"], first["b"] + 1)

    shard = next(p for p in sorted(listed) if p.startswith("shards/"))
    data = bytearray((path / shard).read_bytes())
    data[-1] ^= 0xFF
    (path / shard).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard}: sha256 mismatch"):
        verify(path)
    used, restored, warnings = store.load_latest()
    assert restored.step == 1 and "step-000002" in warnings[0]


def test_a_sharded_learner_must_write_into_the_staged_directory(tmp_path):
    store = DiskCheckpointStore(tmp_path / "ckpt", async_save=False)
    store.stage_shards(1)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    with pytest.raises(CheckpointError, match="not to"):
        store.save(_state(1, str(elsewhere), tmp_path))
    assert not (tmp_path / "ckpt" / "step-000001").exists()  # nothing half-written is left
