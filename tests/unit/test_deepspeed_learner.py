"""The DeepSpeed ZeRO learner (2 CPU processes, gloo, client torch AdamW) against the single-process torch learner.

Same batch, same seed, 3 steps under ZeRO-3: the losses and every parameter
must agree to 1e-5 (fp32), with gradient clipping active. Then a follower
rank is killed: the next step must fail within the rank timeout with the rank
named. Skipped when deepspeed is not installed (``pip install 'rlctl[deepspeed]'``
with DS_BUILD_OPS=0); CI installs it. The first DeepSpeed process-group init
JIT-compiles a small op (~40 s on 2 cores), cached in TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from rlctl import RoleError
from rlctl.contracts.types import LearnerContext
from tests.helpers import learner_context, rollout_batch

pytest.importorskip("deepspeed", reason="needs deepspeed: DS_BUILD_OPS=0 pip install -e '.[deepspeed]'")
pytestmark = pytest.mark.slow




@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session


def _ctx(session) -> LearnerContext:
    return learner_context(session, micro_batch_size=5)


@pytest.fixture(scope="module")
def zero3(session):
    from rlctl_deepspeed_learner.learner import DeepSpeedLearner
    from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions

    learner = DeepSpeedLearner(_ctx(session), DeepSpeedLearnerOptions(zero_stage=3, world_size=2, rank_timeout_s=30))
    yield learner
    learner.close()


def test_zero3_three_steps_equal_the_single_process_torch_learner(session, zero3, tmp_path):
    from rlctl.kit import TorchLearner, TorchLearnerOptions

    batch = rollout_batch(session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    single = TorchLearner(_ctx(session), TorchLearnerOptions(share_prompt_prefill=False))
    torch.testing.assert_close(zero3.logprobs(batch), single.logprobs(batch), rtol=0, atol=1e-5)
    for step in range(3):
        a, b = single.train_step(batch), zero3.train_step(batch)
        assert a["grad_norm"] > 0.05, "clipping must be active for this test to mean anything"
        for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])
    assert zero3.policy_version == single.policy_version == 3
    got, want = zero3.export_weights().state_dict, single.export_weights().state_dict
    assert set(want) <= set(got)
    worst = max(float((got[k] - v).abs().max()) for k, v in want.items())
    assert worst <= 1e-5, worst
    moved = max(float((v - p).abs().max()) for (k, v), p in
                zip(want.items(), TorchLearner(_ctx(session)).export_weights().state_dict.values()))
    assert moved > 1e-4  # the parameters really changed
    zero3.save_pretrained(str(tmp_path / "policy"))  # ZeRO-3 gathers the partitions for the export
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "policy" / "model.safetensors"))
    assert set(saved) and max(float((v - want[k]).abs().max()) for k, v in saved.items()) <= 1e-5
    # the rank holds a partition, not the model: ZeRO-3 parameters are slices
    held = sum(t.numel() for t in zero3.resident_tensors()["policy parameters"])
    assert held < sum(v.numel() for k, v in want.items() if k != "lm_head.weight")


def test_a_killed_rank_is_named_within_the_timeout(session, zero3):
    batch = rollout_batch(session, num_prompts=2, group_size=2)[1]
    os.kill(zero3.ranks.procs[0].pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RoleError, match="learner rank 1"):
        zero3.train_step(batch)
    assert time.monotonic() - started < 30 + 15
    with pytest.raises(RoleError, match="group is down"):
        zero3.logprobs(batch)


@pytest.mark.parametrize("stage", [2])
def test_bf16_keeps_fp32_master_weights_and_adam_moments(session, zero3, stage):
    """DeepSpeed's bf16 mode: bf16 parameters for compute, the ZeRO optimizer's partitions and moments fp32.
    (Runs after the killed-rank test, whose group is down: a single-rank group starts in this process.)"""
    from rlctl_deepspeed_learner.learner import DeepSpeedLearner
    from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions

    zero3.close()
    learner = DeepSpeedLearner(_ctx(session), DeepSpeedLearnerOptions(zero_stage=stage, world_size=1,
                                                                      dtype="bfloat16"))
    try:
        stats = learner.train_step(rollout_batch(session, advantages=[1.0, -1.0] * 8)[1])
        assert learner.policy_version == 1 and stats["grad_norm"] > 0
        dtypes = learner.optimizer_state_dtypes()
        assert dtypes["compute"] == {torch.bfloat16}
        assert dtypes["master"] == {torch.float32} and dtypes["moments"] == {torch.float32}
    finally:
        learner.close()
