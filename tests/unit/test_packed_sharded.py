"""Packed micro-batches in the sharded learners: FSDP2 and DeepSpeed ZeRO-3 ranks (2 CPU processes, gloo)
inherit the torch learner's packing, and every rank packs the whole batch the same way, so all ranks run
the same collectives. Two steps must equal the single-process packed torch learner (1e-5, fp32)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import learner_context, rollout_batch


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_sharded_packed_steps_equal_the_single_process_packed_learner(tiny_session, backend):
    from rlctl.kit import TorchLearner, TorchLearnerOptions

    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
        from rlctl_deepspeed_learner.learner import DeepSpeedLearner as Sharded
        from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions as Options
        options = Options(zero_stage=3, world_size=2, rank_timeout_s=60)
    else:
        from rlctl_fsdp_learner.learner import FsdpLearner as Sharded
        from rlctl_fsdp_learner.options import FsdpLearnerOptions as Options
        options = Options(world_size=2, rank_timeout_s=60)
    ctx = replace(learner_context(tiny_session, micro_batch_size=64), micro_batch_tokens=45)
    batch = rollout_batch(tiny_session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    single = TorchLearner(ctx, TorchLearnerOptions(share_prompt_prefill=False))
    sharded = Sharded(ctx, options)
    try:
        torch.testing.assert_close(sharded.logprobs(batch), single.logprobs(batch), rtol=0, atol=1e-5)
        for step in range(2):
            a, b = single.train_step(batch), sharded.train_step(batch)
            for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
                assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])
        got, want = sharded.export_weights().state_dict, single.export_weights().state_dict
        assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-5
    finally:
        sharded.close()
