"""Device placement: ``train.device`` and ``rollout.options.device`` (auto | cpu | cuda | cuda:N).

On a machine without CUDA (CI) ``auto`` must pick the CPU and an explicit
``cuda`` must be one clear ConfigError naming the setting, raised when the role
is built, before any model is loaded. The GPU-marked test checks that the torch
learner on CUDA computes the CPU learner's log-probs.
"""

from __future__ import annotations

import copy

import pydantic
import pytest
import torch

from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError
from rlctl.contracts.types import LearnerContext, RolloutContext
from rlctl.models.device import resolve_device
from tests.helpers import rollout_batch

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


def test_auto_is_cpu_without_cuda_and_cpu_is_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@no_cuda
@pytest.mark.parametrize("spec", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_one_config_error_naming_the_setting(spec):
    with pytest.raises(ConfigError) as err:
        resolve_device(spec, "train.device")
    assert "train.device" in str(err.value) and "no usable CUDA device" in str(err.value)
    assert "cpu" in err.value.hint


@pytest.mark.parametrize("spec", ["gpu", "cuda:", "cuda:x", "CPU", "mps"])
def test_misspelled_devices_are_rejected_by_the_config(spec):
    with pytest.raises(pydantic.ValidationError):
        RunConfig.model_validate({"train": {"device": spec}})
    with pytest.raises(ConfigError):
        resolve_device(spec)


def _ctx(session, device):
    cfg = session.config
    return LearnerContext(model_dir=str(session.policy_dir), algo=cfg.algo, optim=cfg.train.optim, seed=0,
                          max_response_tokens=cfg.rollout.max_tokens, device=device)


@pytest.fixture(scope="module")
def session(tiny_config, plugins, _rlctl_home):
    from tests.helpers import build_roles

    s = build_roles(tiny_config.model_copy(update={"train": tiny_config.train.model_copy(update={"device": "cpu"})}),
                      plugins, cache_root=_rlctl_home / "cache")
    yield s
    s.rollout.close()


def test_session_passes_train_device_to_the_learner_and_roles_sit_on_it(session):
    assert session.learner.device == torch.device("cpu")
    assert all(p.device.type == "cpu" for p in session.learner.model.parameters())
    assert session.rollout.device.type == ("cuda" if torch.cuda.is_available() else "cpu")  # rollout: auto


@no_cuda
def test_roles_asked_for_cuda_fail_before_loading_with_the_setting_named(session):
    from rlctl.kit import TorchLearner
    from rlctl_local_engine.engine import LocalEngine
    from rlctl_local_engine.options import LocalEngineOptions

    with pytest.raises(ConfigError, match="train.device"):
        TorchLearner(_ctx(session, "cuda"))
    with pytest.raises(ConfigError, match="rollout.options.device"):
        LocalEngine(RolloutContext(model_dir=str(session.policy_dir), tokenizer_hash="x", seed=0),
                    LocalEngineOptions(device="cuda:1"))


@pytest.mark.gpu
def test_cuda_learner_and_engine_match_the_cpu_ones(session):
    from rlctl.kit import TorchLearner
    from rlctl_local_engine.engine import LocalEngine
    from rlctl_local_engine.options import LocalEngineOptions

    batch = rollout_batch(session)[1]
    cpu, gpu = TorchLearner(_ctx(session, "cpu")), TorchLearner(_ctx(session, "cuda"))
    assert next(gpu.model.parameters()).is_cuda
    torch.testing.assert_close(gpu.logprobs(batch), cpu.logprobs(batch), rtol=1e-4, atol=1e-4)
    cpu.train_step(batch)
    gpu.train_step(batch)
    update = gpu.export_weights()
    assert all(t.device.type == "cpu" for t in update.state_dict.values())
    engine = LocalEngine(RolloutContext(model_dir=str(session.policy_dir), tokenizer_hash=session.tokenizer_hash,
                                        seed=0), LocalEngineOptions(device="cuda"))
    engine.update_weights(update)
    assert engine.policy_version == update.version
    on_gpu = copy.copy(session)
    on_gpu.rollout = engine
    trajectories, _ = rollout_batch(on_gpu, num_prompts=2, group_size=2)
    assert len(trajectories) == 4 and all(t.response_tokens for t in trajectories)
