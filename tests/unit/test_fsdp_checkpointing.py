"""FSDP2 with activation checkpointing (``gradient_checkpointing: true``, the 7B recipe's setting) on 2 CPU
ranks: recomputing each decoder layer in backward changes no number; 2 steps equal the single-process torch
learner without checkpointing (1e-5, fp32). The option also reaches the dry-run's memory terms."""

from __future__ import annotations

import pytest

from tests.helpers import learner_context, rollout_batch


def test_checkpointing_is_in_the_memory_terms():
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    assert FsdpLearnerOptions(gradient_checkpointing=True).memory_terms(gpu_plan=True).checkpointing
    assert not FsdpLearnerOptions().memory_terms(gpu_plan=True).checkpointing


@pytest.mark.slow
def test_checkpointed_fsdp2_steps_equal_the_torch_learner(tiny_session):
    from rlctl.kit import TorchLearner, TorchLearnerOptions
    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    ctx = learner_context(tiny_session, micro_batch_size=5)
    batch = rollout_batch(tiny_session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    single = TorchLearner(ctx, TorchLearnerOptions(share_prompt_prefill=False))
    fsdp = FsdpLearner(ctx, FsdpLearnerOptions(world_size=2, rank_timeout_s=30, gradient_checkpointing=True))
    try:
        assert fsdp.ranks.rank0.model.is_activation_checkpointing
        for step in range(2):
            a, b = single.train_step(batch), fsdp.train_step(batch)
            for key in ("loss", "grad_norm", "entropy"):
                assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])
        got, want = fsdp.export_weights().state_dict, single.export_weights().state_dict
        assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-5
    finally:
        fsdp.close()
