"""Options of the rlctl_fsdp_learner plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.types import LearnerMemory


class FsdpLearnerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    world_size: int = Field(2, ge=1, description="Learner processes rlctl starts (rank 0 is the training "
                            "process itself); the policy's parameters, gradients and AdamW state are sharded "
                            "across them, one decoder layer per FSDP unit.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype. bfloat16 gathers parameters in bf16 for forward and backward while "
        "the sharded parameters (the master weights), AdamW moments and the gradient reduction stay fp32.")
    cpu_offload: bool = Field(False, description="Keep the sharded parameters, gradients and optimizer state in "
                              "host memory (FSDP2 CPUOffloadPolicy; pinned memory only when CUDA is present).")
    gradient_checkpointing: bool = Field(False, description="Recompute each decoder layer's activations in backward "
                                         "(Hugging Face gradient checkpointing, enabled before sharding).")
    rank_timeout_s: float = Field(120.0, gt=0, description="Longest a collective may wait for another rank; a rank "
                                  "that died or hung is reported by number after at most this long.")

    def memory_terms(self, *, gpu_plan: bool) -> LearnerMemory:
        """fp32 sharded parameters (bf16: gathered in bf16, the fp32 shard is the master), fp32 AdamW, full shard."""
        dtype = self.dtype if (not gpu_plan or "dtype" in self.model_fields_set) else "bfloat16"
        low = dtype == "bfloat16"
        return LearnerMemory(param_bytes=2 if low else 4, master_weights=low, optim_state_bytes=8, zero_stage=3,
                             checkpointing=self.gradient_checkpointing)
