"""Options of the built-in estimators (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class GSPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(3e-4, gt=0, description="Lower clip of the sequence ratio (GSPO's ratios sit near 1).")
    clip_high: float = Field(4e-4, gt=0, description="Upper clip of the sequence ratio.")


class DAPOOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    clip_low: float = Field(0.2, gt=0, description="Lower PPO clip.")
    clip_high: float = Field(0.28, gt=0, description="Upper PPO clip (clip-higher keeps rare tokens alive).")
    dynamic_sampling: bool = Field(True, description="Drop groups whose rewards are all equal and sample more "
                                   "prompts until the batch is full again.")
    max_sample_rounds: int = Field(4, ge=1, description="Most rollout rounds per step to refill the batch; the "
                                   "step trains on what it has after the last round (metric ds_short_groups).")
    overlong_buffer: int = Field(0, ge=0, description="Soft overlong punishment over the last N tokens before "
                                 "rollout.max_tokens (reward falls linearly to -overlong_penalty); 0 = off.")
    overlong_penalty: float = Field(1.0, ge=0, description="Penalty at rollout.max_tokens.")
