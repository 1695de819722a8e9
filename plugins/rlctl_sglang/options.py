"""Options of the rlctl_sglang plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlctl.contracts.types import RolloutMemory
from rlctl.kit import server_urls


class SGLangOptions(BaseModel):
    """``rollout.options`` for ``rollout.backend: sglang``."""

    model_config = ConfigDict(extra="forbid")

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """The servers hold the weights and KV cache in their own processes."""
        return RolloutMemory(in_process=False, max_rows=None)

    servers: list[str] = Field(min_length=1, description="Base URLs of the servers: `python -m sglang.launch_server` "
                               "or `rlctl serve rollout`, e.g. http://127.0.0.1:30000. All G samples of a prompt "
                               "go to one of them (chosen by a hash of the prompt id).")
    api_key_env: str = Field("RLCTL_SERVE_API_KEY", description="Environment variable holding the servers' API "
                             "key (their --api-key), sent as `Authorization: Bearer KEY`; unset or empty: no key. "
                             "The key itself never goes into the config, so it never reaches run records.")
    timeout_s: float = Field(300.0, gt=0, description="Timeout of one HTTP request (a whole /generate batch included).")
    retries: int = Field(3, ge=0, description="Bounded retries for weight-sync confirmation, resync and generate; "
                         "past them the step fails with an error naming the server.")
    retry_backoff_s: float = Field(0.5, ge=0, description="Delay before the first retry; doubles each retry.")
    reconnect_timeout_s: float = Field(120.0, gt=0, description="When no server is reachable (a partition, a "
                                       "crashed server), the step waits this long for one to come back (probing with "
                                       "backoff, resyncing it before it serves), then fails naming the servers.")
    publish_dir: str | None = Field(None, description="Directory for published weight versions; every server must "
                                    "read it at the same path (shared disk). Default: a fresh temp dir on this host.")
    weight_sync: str = Field("disk", description="The weight transport (a name registered through "
                             "register_weight_transports) that publishes each version where the servers can read it "
                             "by path; then /update_weights_from_disk is POSTed to each server. Built in: disk.")
    weight_sync_options: dict[str, Any] = Field(default_factory=dict, description="Options of the weight "
                                                "transport, validated by its plugin (disk: keep_versions, default 2).")
    encoding: Literal["raw", "bf16", "fp8"] = Field("raw", description="Wire encoding of published weights; bf16 "
                                                    "and fp8 are dequantised by the receiver (fp8: rlctl servers only).")
    delta: bool = Field(False, description="Publish only what changed since the last version (rlctl servers only).")
    bucket_bytes: int = Field(256 << 20, ge=1024, description="Shard size of a published version.")
    sync_on_start: bool = Field(True, description="Load the run's starting model on every server at startup, so a "
                                "server left at other weights never serves this run.")

    @field_validator("servers")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        return server_urls(urls, key="rollout.options.servers", example="http://127.0.0.1:30000")

    @model_validator(mode="after")
    def _delta_encoding(self) -> "SGLangOptions":
        if self.delta and self.encoding == "fp8":
            raise ValueError("delta publish needs encoding raw or bf16 (fp8 scales change every step)")
        return self
