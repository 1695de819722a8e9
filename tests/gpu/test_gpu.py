"""GPU checks (marked ``gpu``; CI has no GPU and deselects them). Run them with ``tests/gpu/run.sh``.

- cuda placement: the learner's parameters and the local engine's weights
  live on the GPU, and the rollout/learner log-probs still reconcile (fp32 on
  GPU: <= 1e-3, since cuBLAS may reorder reductions);
- bf16 on GPU: bf16 parameters, fp32 master weights and AdamW moments, the
  reconciliation within the CPU bf16 tolerance (tests/unit/test_bf16.py);
- FSDP2 with NCCL on one GPU: train, sharded checkpoint through the commit
  protocol, reload bitwise, consolidated export;
- an FSDP2 rank as a Ray actor with its own GPU (cluster.backend=ray): cuda:0
  inside the actor, NCCL, the same losses and weights as the local learner;
- a colocated local engine: a fractional KV budget, weights offloaded after a
  call (allocated bytes drop) and identical greedy rollouts after the reload.

Tiny models built from a config with random weights: nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch

from rlctl.config.load import load_config
from tests.conftest import TINY_OVERRIDES
from tests.helpers import rollout_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU = ["train.device=cuda", "rollout.options.device=cuda"]


def _session(plugins, home, *extra):
    from tests.helpers import build_roles

    return build_roles(load_config(None, TINY_OVERRIDES + GPU + list(extra)), plugins, home / "cache")


def _mismatch(session, batch) -> float:
    mask = batch.action_mask > 0
    return float((session.learner.logprobs(batch) - batch.behavior_logprobs)[mask].abs().max())


def test_cuda_placement_and_fp32_reconciliation(plugins, _rlctl_home, tiny_policy_dir):
    session = _session(plugins, _rlctl_home)
    try:
        assert {p.device.type for p in session.learner.model.parameters()} == {"cuda"}
        held = session.rollout.resident_tensors()
        assert held and all(t.device.type == "cuda" for ts in held.values() for t in ts)
        _, batch = rollout_batch(session, advantages=[1.0, -1.0] * 8)
        assert _mismatch(session, batch) <= 1e-3
        stats = session.learner.train_step(batch)
        assert stats["grad_norm"] == stats["grad_norm"] and session.learner.policy_version == 1
    finally:
        session.rollout.close()


def test_bf16_on_gpu_keeps_fp32_optimizer_state(plugins, _rlctl_home, tiny_policy_dir):
    from tests.unit.test_bf16 import BF16_MAX

    session = _session(plugins, _rlctl_home, "train.learner_options.dtype=bfloat16")
    try:
        learner = session.learner
        assert {p.dtype for p in learner.model.parameters()} == {torch.bfloat16}
        _, batch = rollout_batch(session, advantages=[1.0, -1.0] * 8)
        assert _mismatch(session, batch) <= BF16_MAX
        learner.train_step(batch)
        trained = [p for g in learner.optimizer.param_groups for p in g["params"]]
        assert {p.dtype for p in trained} == {torch.float32} and {p.device.type for p in trained} == {"cuda"}
        moments = {t.dtype for s in learner.optimizer.state.values() for k, t in s.items() if k.startswith("exp_avg")}
        assert moments == {torch.float32}
    finally:
        session.rollout.close()


def test_fsdp2_with_nccl_on_one_gpu_trains_checkpoints_and_exports(plugins, _rlctl_home, tiny_policy_dir, tmp_path):
    import torch.distributed as dist

    from rlctl.contracts.types import LearnerContext
    from rlctl.engine.checkpoint import DiskCheckpointStore, export_hf, load_checkpoint
    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions
    from tests.unit.test_fsdp_checkpoint import _commit

    session = _session(plugins, _rlctl_home)
    cfg = session.config
    ctx = LearnerContext(model_dir=str(session.policy_dir), algo=cfg.algo, optim=cfg.train.optim, seed=0,
                         max_response_tokens=cfg.rollout.max_tokens, device="cuda")
    batch = rollout_batch(session, advantages=[1.0, -1.0] * 8)[1]
    store = DiskCheckpointStore(tmp_path / "ckpt", async_save=False)
    learner = FsdpLearner(ctx, FsdpLearnerOptions(world_size=1, dtype="bfloat16"))
    try:
        assert "nccl" in str(dist.get_backend())
        for _ in range(2):
            learner.train_step(batch)
        path = _commit(store, learner, 2, session)
        saved = learner.export_weights().state_dict
    finally:
        learner.close()
    again = FsdpLearner(ctx, FsdpLearnerOptions(world_size=1, dtype="bfloat16"))
    try:
        again.load_shards(load_checkpoint(path).learner)
        got = again.export_weights().state_dict
        assert all(torch.equal(got[k], v) for k, v in saved.items())
    finally:
        again.close()
        session.rollout.close()
    assert (export_hf(path, tmp_path / "hf") / "model.safetensors").is_file()


def test_fsdp2_rank_actor_on_ray_gets_its_own_gpu(plugins, _rlctl_home, tiny_policy_dir, ray_cluster):
    """cluster.backend=ray: a rank actor with cluster.learner_num_gpus=1 sees its GPU as cuda:0, joins an NCCL
    group, trains, and its exported weights (left in the object store) equal a local one-GPU FSDP2 learner's."""
    from dataclasses import replace
    from functools import partial

    from rlctl.config.models import ClusterConfig
    from rlctl.contracts.types import LearnerContext
    from rlctl.placement.ray_ranks import RayRanks
    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    session = _session(plugins, _rlctl_home)
    cfg = session.config
    ctx = LearnerContext(model_dir=str(session.policy_dir), algo=cfg.algo, optim=cfg.train.optim, seed=0,
                         max_response_tokens=cfg.rollout.max_tokens, device="cuda", deterministic=True)
    batch = rollout_batch(session, advantages=[1.0, -1.0] * 8)[1]
    cluster = ClusterConfig(backend="ray", learner_num_cpus=1, learner_num_gpus=1)
    remote = FsdpLearner(replace(ctx, rank_launcher=partial(RayRanks, cluster)), FsdpLearnerOptions(world_size=1))
    try:
        assert remote.device == torch.device("cuda", 0)
        a = [remote.train_step(batch)["loss"] for _ in range(2)]
        got = remote.export_weights().state_dict
        got = {k: got[k] for k in got}
    finally:
        remote.close()
    local = FsdpLearner(ctx, FsdpLearnerOptions(world_size=1))
    try:
        b = [local.train_step(batch)["loss"] for _ in range(2)]
        want = local.export_weights().state_dict
    finally:
        local.close()
        session.rollout.close()
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-4
    assert max(float((got[k] - v).abs().max()) for k, v in want.items()) <= 1e-4


def test_colocated_engine_budget_release_and_offload_on_cuda(plugins, _rlctl_home, tiny_policy_dir):
    """A fractional KV budget resolves against the GPU, offloaded weights leave it after a call (allocated bytes
    drop by their size), and greedy rollouts after the reload equal those of an engine that never offloads."""
    import dataclasses

    from rlctl.contracts.types import RolloutContext
    from rlctl_local_engine.engine import LocalEngine
    from rlctl_local_engine.options import LocalEngineOptions
    from tests.unit.test_colocate import _content, _requests

    session = _session(plugins, _rlctl_home)
    ctx = RolloutContext(model_dir=str(session.policy_dir), tokenizer_hash=session.tokenizer_hash, seed=0)
    try:
        plain = LocalEngine(ctx, LocalEngineOptions(device="cuda"))
        shared = LocalEngine(ctx, LocalEngineOptions(device="cuda", kv_cache_budget=0.3, release_memory=True,
                                                     offload_weights=True))
        _, total = torch.cuda.mem_get_info()
        assert shared.kv_budget_bytes == int(0.3 * total)
        requests = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, temperature=0.0))
                    for r in _requests(session, num_prompts=2)]
        weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in shared.model.parameters()}.values())
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        first = shared.generate(requests)
        torch.cuda.synchronize()
        assert {p.device.type for p in shared.model.parameters()} == {"cpu"}
        assert before - torch.cuda.memory_allocated() >= weights
        assert _content(first) == _content(plain.generate(requests))
        assert _content(shared.generate(requests)) == _content(first)  # reloaded, same policy, same tokens
        plain.close()
        shared.close()
    finally:
        session.rollout.close()
