"""Options of the rlctl_local_engine plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.types import RolloutMemory


class LocalEngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d+)$", description="Where the engine's weights, "
                        "KV cache and sampling run: auto (the first GPU when CUDA is usable, else CPU), cpu, cuda or "
                        "cuda:N. Asking for cuda where there is none is an error.")
    max_batch_sequences: int = Field(512, ge=1, description="Rows per forward; larger requests are chunked by prompt.")
    length_tail_alpha: float | None = Field(
        None, gt=0, description="Benchmarks: keep decoding every row to a length drawn from a Pareto(alpha) tail "
        "(at least length_tail_min, capped at max_tokens) after its response ends: long-tailed decode work with "
        "real tokens; what follows the response is discarded, so trajectories are unchanged. null = off."
    )
    length_tail_min: int = Field(4, ge=1, description="Scale (minimum) of the Pareto length tail.")

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """In-process weights (refolded per call), holding at most ``max_batch_sequences`` rows at once."""
        return RolloutMemory(in_process=True, max_rows=self.max_batch_sequences)
