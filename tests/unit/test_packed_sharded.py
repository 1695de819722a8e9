"""Packed micro-batches in the sharded learners: FSDP2 and DeepSpeed ZeRO-3 ranks (2 CPU processes, gloo)
inherit the torch learner's packing, and every rank packs the whole batch the same way, so all ranks run
the same collectives. Two steps must equal the single-process packed torch learner and the single-process
padded one (1e-5, fp32: the packed-vs-padded maths is pinned at 1e-6 in fp64 by test_packed_micro_batches),
and the sharded steps must really be packed (no padding computed)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.helpers import learner_context, rollout_batch


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["fsdp2", "deepspeed"])
def test_sharded_packed_steps_equal_the_single_process_packed_and_padded_learners(tiny_session, backend):
    from rlctl.kit import TorchLearner, TorchLearnerOptions

    if backend == "deepspeed":
        pytest.importorskip("deepspeed", reason="needs deepspeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")
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
    padded = TorchLearner(replace(ctx, micro_batch_tokens=None), TorchLearnerOptions(share_prompt_prefill=False))
    sharded = Sharded(ctx, options)
    try:
        assert sharded.ranks.get0("micro_batch_tokens") == 45
        on = batch.action_mask > 0
        got = sharded.logprobs(batch)
        torch.testing.assert_close(got, single.logprobs(batch), rtol=0, atol=1e-5)
        torch.testing.assert_close(got[on], padded.logprobs(batch)[on], rtol=0, atol=1e-5)
        for step in range(2):
            a, b, c = single.train_step(batch), sharded.train_step(batch), padded.train_step(batch)
            assert b["learner_padding_waste"] == 0.0 < c["learner_padding_waste"], step  # packed, not padded
            for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
                assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])
            assert abs(c["grad_norm"] - b["grad_norm"]) <= 1e-5, (step, c["grad_norm"], b["grad_norm"])
        got = sharded.export_weights().state_dict
        for want in (single.export_weights().state_dict, padded.export_weights().state_dict):
            assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-5
    finally:
        sharded.close()
