"""Options of the rlctl_local_engine plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations


from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl.contracts.types import RolloutMemory


class LocalEngineOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    device: str = Field("auto", pattern=r"^(auto|cpu|cuda|cuda:\d+)$", description="Where the engine's weights, "
                        "KV cache and sampling run: auto (the first GPU when CUDA is usable, else CPU), cpu, cuda or "
                        "cuda:N. Asking for cuda where there is none is an error.")
    max_batch_sequences: int = Field(512, ge=1, description="Rows per forward; larger requests are chunked by prompt.")
    scheduler: Literal["batch", "slots"] = Field(
        "batch", description="batch: each forward's rows start together and the forward lasts as long as its "
        "longest row. slots: continuous batching on max_batch_sequences decode slots (fewer when kv_cache_budget "
        "caps them); a row that ends frees its slot for the next queued one, each row draws from its own random "
        "stream (seed, call, request, sample index), so samples do not depend on the slot count. slots needs an "
        "fp32 Llama/Qwen2-shaped model (the static-cache fast path).")
    kv_cache_budget: int | float | None = Field(
        None, description="Device memory the KV cache of one forward may use: bytes (an int, or a size such as "
        "'2GiB' or '512MiB') or a fraction in (0, 1) of the device's total memory (CUDA only). Rows per forward "
        "are capped at min(max_batch_sequences, budget / KV bytes per row), a row being the call's longest "
        "prompt + max_tokens. null = no cap beyond max_batch_sequences.")
    release_memory: bool = Field(False, description="After each generate call on CUDA, return the allocator's "
                                 "cached blocks to the device (torch.cuda.empty_cache) so a colocated learner in "
                                 "another process can use them. On CPU: accepted, does nothing.")
    offload_weights: bool = Field(False, description="Between generate calls keep the engine's weights in host "
                                  "memory (moved back to the device at the start of the next call; weight updates "
                                  "land in host memory meanwhile), freeing their device memory for a colocated "
                                  "learner. On CPU: accepted, does nothing.")
    length_tail_alpha: float | None = Field(
        None, gt=0, description="Benchmarks: keep decoding every row to a length drawn from a Pareto(alpha) tail "
        "(at least length_tail_min, capped at max_tokens) after its response ends: long-tailed decode work with "
        "real tokens; what follows the response is discarded, so trajectories are unchanged. null = off."
    )
    length_tail_min: int = Field(4, ge=1, description="Scale (minimum) of the Pareto length tail.")

    def length_tail(self) -> tuple[float, int] | None:
        """LengthTailOptions: (alpha, minimum) of the imposed Pareto length tail, None when off."""
        return (self.length_tail_alpha, self.length_tail_min) if self.length_tail_alpha else None

    @field_validator("kv_cache_budget", mode="before")
    @classmethod
    def _budget(cls, value: object) -> object:
        """Sizes as text ('2GiB') become bytes; a fraction must lie in (0, 1); bytes must be positive."""
        if isinstance(value, bool):
            raise ValueError("kv_cache_budget is a size or a fraction, not a boolean; write e.g. 2GiB or 0.3")
        if isinstance(value, str):
            from rlctl.kit import parse_bytes

            text = value.strip()
            try:
                number = float(text)
            except ValueError:
                return parse_bytes(text)  # raises naming the spelling to use
            value = int(number) if number >= 1 and number.is_integer() else number
        if isinstance(value, float):
            if value.is_integer() and value >= 1:
                return int(value)
            if not 0 < value < 1:
                raise ValueError(f"kv_cache_budget {value} is neither a fraction in (0, 1) of the device's memory "
                                 "nor a byte count; write e.g. 0.3 or 2GiB")
        if isinstance(value, int) and value < 1:
            raise ValueError(f"kv_cache_budget must be a positive size, got {value}; write e.g. 2GiB or 0.3")
        return value

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """In-process weights (refolded per call), holding at most ``max_batch_sequences`` rows at once (fewer
        when a KV budget caps them; the ledger turns the budget into rows from the model's shape)."""
        budget = self.kv_cache_budget
        return RolloutMemory(in_process=True, max_rows=self.max_batch_sequences,
                             kv_budget_bytes=budget if isinstance(budget, int) else None,
                             kv_budget_fraction=budget if isinstance(budget, float) else None,
                             offload_weights=self.offload_weights)
