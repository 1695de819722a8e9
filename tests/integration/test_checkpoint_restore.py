"""Restoring a real tiny session from a checkpoint continues it bit for bit (in-process, a few seconds).

The CLI-level kill / resume tests are in test_resume.py (slow); these check the
engine pieces directly: capture -> store -> load -> restore, the shadow
forward, the model-shape check and the Hugging Face export.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rlctl.config.load import load_config
from rlctl.contracts.errors import CheckpointError
from rlctl.engine.checkpoint import DiskCheckpointStore, export_hf
from rlctl.engine.snapshot import Provenance, StepCheckpointer, restore
from tests.conftest import TINY_OVERRIDES

LEARNING = ("reward_mean", "reward_std", "loss", "grad_norm", "entropy", "kl_ref", "clip_fraction",
            "response_length_mean", "policy_version", "lr")


class ListSink:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def write(self, step, metrics) -> None:
        self.rows[step] = dict(metrics)

    def close(self) -> None:
        pass


def _session(plugins, home: Path, *extra: str):
    from tests.helpers import build_roles

    cfg = load_config(None, [*TINY_OVERRIDES, "train.steps=4", "train.deterministic=true", "algo.kl.coef=0.05",
                             "train.optim.lr=1e-3", *extra])
    return build_roles(cfg, plugins, home / "cache")


def _params(session) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in session.learner.model.state_dict().items()}


@pytest.fixture(scope="module")
def straight(plugins, _rlctl_home, tmp_path_factory, tiny_policy_dir):
    """4 steps with a (synchronous) checkpoint every 2 steps: final params, metrics, checkpoint dir."""
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    root = tmp_path_factory.mktemp("ck") / "checkpoints"
    session = _session(plugins, _rlctl_home)
    store = DiskCheckpointStore(root, keep_last=5, async_save=False)
    checkpointer = StepCheckpointer(session, store, Provenance(run_id="r", config_hash="h", code_version="c"),
                                    every_steps=2, total_steps=4)
    sink = ListSink()
    run_sync(session, LoopSpec.from_config(session.config), [sink], checkpoint=checkpointer)
    checkpointer.close()
    assert [b > 0 for b in checkpointer.blocking_s] == [True, True]
    return _params(session), sink.rows, root


def test_restore_continues_bit_for_bit(plugins, _rlctl_home, straight):
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    final, rows, root = straight
    state = DiskCheckpointStore(root).load(str(root / "step-000002"))
    session = _session(plugins, _rlctl_home)
    report = restore(session, state, shadow_tolerance=0.0)
    assert report.shadow_max_abs_diff == 0.0 and report.notes == ()
    assert session.rollout.policy_version == session.learner.policy_version == 2
    assert session.rollout.health()["fingerprint"] == session.learner.export_weights().fingerprint
    sink = ListSink()
    run_sync(session, LoopSpec.from_config(session.config), [sink], start_step=2)
    assert sorted(sink.rows) == [2, 3]
    for step in (2, 3):
        for name in LEARNING:
            assert sink.rows[step][name] == rows[step][name], (step, name)
    now = _params(session)
    assert all(torch.equal(now[k], final[k]) for k in final)


def test_tied_weights_are_saved_once_and_the_export_loads_with_from_pretrained(straight, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    final, _, root = straight
    saved = load_file(root / "step-000004" / "model" / "model.safetensors")
    assert "lm_head.weight" not in saved and "model.embed_tokens.weight" in saved
    out = export_hf(root / "step-000004", tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer("1+2=")["input_ids"]
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], final[k]) for k in final)
    with pytest.raises(CheckpointError, match="not an empty directory"):
        export_hf(root / "step-000004", out)


def test_shadow_forward_mismatch_refuses_to_continue(plugins, _rlctl_home, straight):
    _, _, root = straight
    state = DiskCheckpointStore(root).load(str(root / "step-000002"))
    moved = replace(state, shadow=replace(state.shadow, logprobs=state.shadow.logprobs - 0.01))
    with pytest.raises(CheckpointError, match="shadow forward.*differs.*shadow_tolerance"):
        restore(_session(plugins, _rlctl_home), moved, shadow_tolerance=1e-5)


def test_model_shape_change_is_refused(plugins, _rlctl_home, straight):
    _, _, root = straight
    state = DiskCheckpointStore(root).load(str(root / "step-000002"))
    weights = dict(state.learner.weights)
    weights["model.norm.weight"] = torch.ones(7)
    bad = replace(state, learner=replace(state.learner, weights=weights))
    with pytest.raises(CheckpointError, match=r"model shape changed since the checkpoint: model.norm.weight is \[7\]"):
        restore(_session(plugins, _rlctl_home), bad, shadow_tolerance=1e-5)
