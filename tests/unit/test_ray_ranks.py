"""RayRanks refuses a placement that cannot give each rank its own GPU, before it starts Ray or any actor."""

from __future__ import annotations

import pytest

from rlctl import ConfigError
from rlctl.contracts.types import LearnerContext

pytest.importorskip("ray", reason="needs ray: pip install -e '.[ray]'")


@pytest.mark.parametrize("gpus", [0.0, 0.5])
def test_cuda_ranks_without_a_whole_gpu_each_are_refused_naming_the_fix(gpus):
    from rlctl.config.models import ClusterConfig
    from rlctl.placement.ray_ranks import RayRanks
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    ctx = LearnerContext(model_dir="/nowhere", algo=None, optim=None, seed=0, max_response_tokens=4, device="cuda")
    with pytest.raises(ConfigError, match="learner_num_gpus") as err:
        RayRanks(ClusterConfig(backend="ray", learner_num_gpus=gpus), object, "FSDP2", ctx, FsdpLearnerOptions())
    assert "cluster.learner_num_gpus=1" in err.value.hint
