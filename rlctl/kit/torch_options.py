"""Options of the one-process torch learner (imported at startup, so it must stay light: no torch).

What this is: ``TorchLearnerOptions``, the ``train.learner_options`` of learner
backend ``torch``, and what a sharded learner builds for each rank's
TorchLearner (fp32 weights, prefill sharing off).

What this is not: the learner (rlctl.kit.torch_learner) or a sharded
learner's options (those come with its plugin).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.types import LearnerMemory


class TorchLearnerOptions(BaseModel):
    """``train.learner_options`` of the torch learner: compute dtype, activation recomputation, prefill sharing.

    Example: ``TorchLearnerOptions(dtype="bfloat16", gradient_checkpointing=True)``.
    """

    model_config = ConfigDict(extra="forbid")

    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype of the policy. bfloat16 keeps an fp32 master copy of every parameter "
        "and fp32 AdamW moments: the optimizer math runs in fp32, the forward and backward in bf16.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward.")
    share_prompt_prefill: bool = Field(
        True, description="Run each distinct prompt of a micro-batch through the model once and reuse its KV "
        "cache for the G responses (same maths, fewer FLOPs).")

    def memory_terms(self, *, gpu_plan: bool) -> LearnerMemory:
        """Parameters in ``dtype`` (bf16: plus an fp32 master copy), fp32 AdamW moments, no sharding.

        Planning a GPU run with ``dtype`` left at its default assumes bf16, as a
        GPU run would be configured.
        """
        dtype = self.dtype if (not gpu_plan or "dtype" in self.model_fields_set) else "bfloat16"
        low = dtype == "bfloat16"
        return LearnerMemory(param_bytes=2 if low else 4, master_weights=low, optim_state_bytes=8, zero_stage=0,
                             checkpointing=self.gradient_checkpointing, shared_prefill=self.share_prompt_prefill)
