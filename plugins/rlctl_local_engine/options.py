"""Options of the rlctl_local_engine plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict, Field


class LocalEngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch_sequences: int = Field(512, ge=1, description="Rows per forward; larger requests are chunked by prompt.")
