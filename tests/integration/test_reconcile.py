"""Rollout behaviour log-probs and learner log-probs describe the same policy (DESIGN invariant 1)."""

from __future__ import annotations

import pytest

from rlctl.config.load import load_config
from tests.conftest import TINY_OVERRIDES
from tests.helpers import rollout_batch


def _session(plugins, tmp_home, extra):
    from tests.helpers import build_roles

    cfg = load_config(None, TINY_OVERRIDES + extra)
    return build_roles(cfg, plugins, tmp_home / "cache")


_rollout_batch = rollout_batch


# The local engine's slot scheduler (3 slots: groups of 4 split across slots, refilled mid-call) as well.
SLOTS = ["rollout.options.scheduler=slots", "rollout.options.max_batch_sequences=3"]


@pytest.mark.parametrize("scheduler", [[], SLOTS], ids=["batch", "slots"])
@pytest.mark.parametrize("sampling", [
    [],
    ["rollout.temperature=0.7", "rollout.top_k=8", "rollout.top_p=0.9"],
    ["rollout.temperature=1.3", "rollout.top_p=0.8"],
])
def test_behaviour_logprobs_match_learner_recompute(plugins, _rlctl_home, tiny_policy_dir, sampling, scheduler):
    session = _session(plugins, _rlctl_home, sampling + scheduler)
    trajectories, batch = _rollout_batch(session)
    assert all(t.verify() for t in trajectories)
    learner = session.learner.logprobs(batch)  # [N, T]
    mask = batch.action_mask > 0
    delta = (learner - batch.behavior_logprobs)[mask].abs()
    assert int(mask.sum()) > 0
    assert float(delta.max()) <= 1e-4, f"max |logpi - logmu| = {float(delta.max()):.2e}"


def test_first_ratio_is_one_and_mismatch_is_logged(plugins, _rlctl_home, tiny_policy_dir):
    session = _session(plugins, _rlctl_home, [])
    trajectories, batch = _rollout_batch(session, advantages=[1.0, -1.0] * 8)
    stats = session.learner.train_step(batch)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["ratio_max"] == pytest.approx(1.0, abs=1e-4)
    assert stats["clip_fraction"] == 0.0
    assert 0.0 <= stats["logprob_mismatch_max"] <= 1e-4
    assert stats["logprob_mismatch_mean"] <= stats["logprob_mismatch_max"]


def test_step_on_positive_advantage_raises_that_sequence_logprob(plugins, _rlctl_home, tiny_policy_dir):
    session = _session(plugins, _rlctl_home, ["train.optim.lr=1e-3"])
    trajectories, _ = _rollout_batch(session)
    advantages = [0.0] * len(trajectories)
    advantages[0] = 1.0
    from rlctl.engine.batching import build_batch

    batch = build_batch(trajectories, advantages, session.tokenizer.pad_token_id, session.sampling)
    before = (session.learner.logprobs(batch) * batch.action_mask).sum(-1)
    session.learner.train_step(batch)
    after = (session.learner.logprobs(batch) * batch.action_mask).sum(-1)
    assert float(after[0]) > float(before[0])


def test_weight_sync_keeps_rollout_and_learner_identical(plugins, _rlctl_home, tiny_policy_dir):
    session = _session(plugins, _rlctl_home, ["train.optim.lr=1e-3"])
    trajectories, batch = _rollout_batch(session, advantages=[1.0, -1.0] * 8)
    session.learner.train_step(batch)
    update = session.learner.export_weights()
    session.rollout.update_weights(update)
    assert session.rollout.health()["fingerprint"] == update.fingerprint
    assert session.rollout.policy_version == session.learner.policy_version == 1
    trajectories, batch = _rollout_batch(session)
    assert {t.policy_version for t in trajectories} == {1}
    delta = (session.learner.logprobs(batch) - batch.behavior_logprobs)[batch.action_mask > 0].abs()
    assert float(delta.max()) <= 1e-4
