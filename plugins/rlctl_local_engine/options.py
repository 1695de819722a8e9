"""Options of the rlctl_local_engine plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.types import RolloutMemory


class LocalEngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_sequences: int = Field(512, ge=1, description="Rows per forward; larger requests are chunked by prompt.")

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """In-process weights (refolded per call), holding at most ``max_batch_sequences`` rows at once."""
        return RolloutMemory(in_process=True, max_rows=self.max_batch_sequences)
