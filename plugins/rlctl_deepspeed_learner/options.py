"""Options of the rlctl_deepspeed_learner plugin (imported at startup, so it must stay light: no torch, no deepspeed)."""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.types import LearnerMemory

INSTALL_HINT = "pip install 'rlctl[deepspeed]' (set DS_BUILD_OPS=0: no fused ops are compiled at install)"


def deepspeed_missing() -> str | None:
    """Why the DeepSpeed learner cannot run in this environment, or None when it can."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return None


class DeepSpeedLearnerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    zero_stage: Literal[1, 2, 3] = Field(3, description="ZeRO stage: 1 shards the optimizer state (and fp32 master), "
                                         "2 also the gradients, 3 also the parameters.")
    world_size: int = Field(2, ge=1, description="Learner processes rlctl starts (rank 0 is the training process "
                            "itself); every rank runs the whole batch, ZeRO shards the state across them.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype. bfloat16 runs forward and backward in bf16 while DeepSpeed keeps "
        "fp32 master weights and the AdamW moments in fp32.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    rank_timeout_s: float = Field(120.0, gt=0, description="Longest a collective may wait for another rank; a rank "
                                  "that died or hung is reported by number after at most this long.")

    def memory_terms(self, *, gpu_plan: bool) -> LearnerMemory:
        dtype = self.dtype if (not gpu_plan or "dtype" in self.model_fields_set) else "bfloat16"
        low = dtype == "bfloat16"
        return LearnerMemory(param_bytes=2 if low else 4, master_weights=low, optim_state_bytes=8,
                             zero_stage=self.zero_stage, checkpointing=self.gradient_checkpointing)

    def zero_stages(self) -> tuple[int, ...]:
        """The stages this learner can be configured for (the dry run lists it for each)."""
        return (1, 2, 3)

    def unavailable(self) -> str | None:
        """Why this learner cannot run here (None: it can); the dry run says so plainly."""
        missing = deepspeed_missing()
        return f"{missing}; {INSTALL_HINT}" if missing else None
