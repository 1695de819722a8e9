"""Options of the rlctl_sglang plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlctl.contracts.types import RolloutMemory
from rlctl.kit import EngineLaunch, server_urls


SGLANG_INSTALL = "python3 -m venv .venv-sglang && .venv-sglang/bin/pip install 'sglang[all]'"


class SGLangLaunch(EngineLaunch):
    """``rollout.options.launch``: rlctl starts the SGLang servers itself (the shared fields: ``rlctl.kit.EngineLaunch``)."""

    python: str = Field(".venv-sglang/bin/python", description="Interpreter of the venv SGLang is installed in "
                        f"(relative paths from the working directory). Install: `{SGLANG_INSTALL}` (needs a GPU).")
    engine_args: list[str] = Field(default_factory=list, description="Extra arguments of "
                                   "`python -m sglang.launch_server`, e.g. [--mem-fraction-static, '0.5'].")
    port_range: tuple[int, int] = Field((30000, 30099), description="Ports tried on 127.0.0.1, lowest first.")


class SGLangOptions(BaseModel):
    """``rollout.options`` for ``rollout.backend: sglang``."""

    model_config = ConfigDict(extra="forbid")

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """The servers hold the weights and KV cache in their own processes; a launch block on a GPU plan takes
        --mem-fraction-static of each GPU (SGLang's default 0.88 when the engine args do not set it)."""
        if self.launch is None:
            return RolloutMemory(in_process=False, out_of_process=True)
        terms = {"in_process": False, "out_of_process": True, "servers": self.launch.num_servers}
        if not gpu_plan:
            return RolloutMemory(**terms, server_budget_source="the workload (SGLang sizes its KV pool on GPUs)")
        args, fraction = self.launch.engine_args, None
        for i, a in enumerate(args):
            if a == "--mem-fraction-static" and i + 1 < len(args):
                fraction = args[i + 1]
            elif a.startswith("--mem-fraction-static="):
                fraction = a.split("=", 1)[1]
        return RolloutMemory(**terms, server_memory_fraction=float(fraction or 0.88),
                             server_budget_source=f"--mem-fraction-static {fraction or '0.88 (default)'}")

    servers: list[str] | None = Field(None, description="Base URLs of running servers: `python -m "
                                      "sglang.launch_server` or `rlctl serve rollout`, e.g. http://127.0.0.1:30000. "
                                      "All G samples of a prompt go to one of them (chosen by a hash of the prompt "
                                      "id).")
    launch: SGLangLaunch | None = Field(None, description="Start the servers (mutually exclusive with servers).")
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
    def _urls(cls, urls: list[str] | None) -> list[str] | None:
        if urls is None:
            return None
        if not urls:
            raise ValueError("servers must list at least one URL (or use a launch block instead)")
        return server_urls(urls, key="rollout.options.servers", example="http://127.0.0.1:30000")

    @model_validator(mode="after")
    def _one_source(self) -> "SGLangOptions":
        if (self.servers is None) == (self.launch is None):
            raise ValueError("set exactly one of rollout.options.servers (attach to running servers) and "
                             "rollout.options.launch (rlctl starts them, e.g. launch: {num_servers: 1})")
        return self

    @model_validator(mode="after")
    def _delta_encoding(self) -> "SGLangOptions":
        if self.delta and self.encoding == "fp8":
            raise ValueError("delta publish needs encoding raw or bf16 (fp8 scales change every step)")
        return self
