"""Options of the rlctl_torch_learner plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TorchLearnerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16"] = Field("float32", description="Parameter dtype (optimizer math in fp32 on CPU).")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    share_prompt_prefill: bool = Field(
        True, description="Run each distinct prompt of a micro-batch through the model once and reuse its KV "
        "cache for the G responses (same maths, fewer FLOPs).")
