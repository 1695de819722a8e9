"""The FSDP2 learner (2 CPU processes, gloo) against the single-process torch learner.

Same batch, same seed, 3 steps: the losses and every parameter must agree to
1e-5 (fp32), with gradient clipping active so the global norm across shards is
exercised. Then a follower rank is killed: the next step must fail within the
rank timeout with the rank named, never hang.
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




@pytest.fixture(scope="module")
def session(tiny_session):
    return tiny_session


def _ctx(session) -> LearnerContext:
    return learner_context(session, micro_batch_size=5)


def test_options_and_memory_terms_say_full_shard():
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    terms = FsdpLearnerOptions(world_size=4).memory_terms(gpu_plan=True)
    assert terms.zero_stage == 3 and terms.param_bytes == 2 and terms.master_weights
    assert FsdpLearnerOptions(dtype="float32").memory_terms(gpu_plan=True).param_bytes == 4
    with pytest.raises(ValueError):
        FsdpLearnerOptions(world_size=0)


@pytest.fixture(scope="module")
def fsdp(session):
    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    learner = FsdpLearner(_ctx(session), FsdpLearnerOptions(world_size=2, rank_timeout_s=30))
    yield learner
    learner.close()


@pytest.mark.slow
def test_three_steps_equal_the_single_process_torch_learner(session, fsdp, tmp_path):
    from rlctl.kit import TorchLearner, TorchLearnerOptions

    batch = rollout_batch(session, advantages=[(-1.0) ** i * (1 + i % 3) for i in range(16)])[1]
    single = TorchLearner(_ctx(session), TorchLearnerOptions(share_prompt_prefill=False))
    torch.testing.assert_close(fsdp.logprobs(batch), single.logprobs(batch), rtol=0, atol=1e-5)
    for step in range(3):
        a, b = single.train_step(batch), fsdp.train_step(batch)
        assert a["grad_norm"] > 0.05, "clipping must be active for this test to mean anything"
        for key in ("loss", "grad_norm", "ratio_mean", "entropy"):
            assert abs(a[key] - b[key]) <= 1e-5, (step, key, a[key], b[key])
    assert fsdp.policy_version == single.policy_version == 3
    got, want = fsdp.export_weights(), single.export_weights()
    assert set(want.state_dict) <= set(got.state_dict)
    worst = max(float((got.state_dict[k] - v).abs().max()) for k, v in want.state_dict.items())
    assert worst <= 1e-5, worst
    fsdp.save_pretrained(str(tmp_path / "policy"))
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "policy" / "model.safetensors"))
    assert set(saved) and set(saved) <= set(want.state_dict)
    assert max(float((v - want.state_dict[k]).abs().max()) for k, v in saved.items()) <= 1e-5
    moved = max(float((v - p).abs().max()) for (k, v), p in
                zip(want.state_dict.items(), TorchLearner(_ctx(session)).export_weights().state_dict.values()))
    assert moved > 1e-4  # the parameters really changed


@pytest.mark.slow
def test_a_killed_rank_is_named_within_the_timeout(session, fsdp):
    batch = rollout_batch(session, num_prompts=2, group_size=2)[1]
    os.kill(fsdp.ranks.procs[0].pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(RoleError, match="learner rank 1"):
        fsdp.train_step(batch)
    assert time.monotonic() - started < 30 + 15
    with pytest.raises(RoleError, match="group is down"):
        fsdp.logprobs(batch)
