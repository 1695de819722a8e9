"""The launch block the engine plugins share (rlctl.kit.EngineLaunch) and EngineServers' pinning: a launched
server runs on the CPUs asked for (read back from /proc/PID/status), with its CUDA_VISIBLE_DEVICES; the sglang
plugin builds its command from the same block. Live launches through the plugin: tests/integration/
test_serve_sglang.py (`rlctl serve rollout` as the launched command)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from rlctl.contracts.errors import RoleError
from rlctl.kit import EngineLaunch, EngineServers, parse_cpus
from rlctl_sglang.options import SGLangOptions
from rlctl_vllm.options import VLLMOptions
from tests.unit.test_vllm_plugin import SERVER


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_cpu_lists_parse_like_taskset_and_bad_ones_name_the_fix():
    assert parse_cpus("0") == {0} and parse_cpus("0-2,5") == {0, 1, 2, 5} and parse_cpus(3) == {3}
    for bad in ("x", "3-1", "1-", ""):
        with pytest.raises(ValueError):
            parse_cpus(bad)
    launch = EngineLaunch(num_servers=2, cpus=["0", "1"], gpus=["0,1"])
    assert launch.cpu_sets() == [{0}, {1}] and launch.gpu_lists() == ["0,1", "0,1"]
    with pytest.raises(ValidationError, match="3 entries for num_servers=2"):
        EngineLaunch(num_servers=2, cpus=["0", "1", "0"])
    with pytest.raises(ValidationError, match="not like '0', '0-3'"):
        EngineLaunch(cpus=["zero"])


def test_both_engine_plugins_take_the_same_launch_block():
    block = {"num_servers": 2, "cpus": ["0", "1"], "gpus": ["0", "1"], "engine_args": ["--x", "1"]}
    v, s = VLLMOptions(launch=block).launch, SGLangOptions(launch=block).launch
    assert isinstance(v, EngineLaunch) and isinstance(s, EngineLaunch)
    assert v.cpu_sets() == s.cpu_sets() == [{0}, {1}]
    with pytest.raises(ValidationError, match="exactly one of rollout.options.servers"):
        SGLangOptions()
    with pytest.raises(ValidationError, match="exactly one of rollout.options.servers"):
        SGLangOptions(servers=["http://127.0.0.1:30000"], launch={})


def test_sglang_launch_command_is_sglangs_server_or_the_configured_command(tmp_path):
    from rlctl_sglang.backend import launch_argv
    from rlctl_sglang.options import SGLangLaunch

    with pytest.raises(RoleError, match="does not exist"):
        launch_argv(SGLangLaunch(python=str(tmp_path / "nope" / "python")), "/m")
    python = tmp_path / "python"
    python.write_text("")
    argv = launch_argv(SGLangLaunch(python=str(python), engine_args=["--mem-fraction-static", "0.5"]), "/m")
    assert argv == [str(python), "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1",
                    "--port", "{port}", "--mem-fraction-static", "0.5"]
    own = SGLangLaunch(python="/no/such/python", command=["rlctl", "serve", "rollout", "--model", "{model}",
                                                          "--port", "{port}"])
    assert launch_argv(own, "/m") == ["rlctl", "serve", "rollout", "--model", "/m", "--port", "{port}"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_each_launched_server_runs_on_its_own_cpus_and_gpus(tmp_path):
    first, second = sorted(os.sched_getaffinity(0))[:2]
    script = tmp_path / "srv.py"
    script.write_text(SERVER)
    servers = EngineServers([sys.executable, str(script), "{port}"], count=2, ports=(18600, 18699),
                            log_dir=tmp_path / "logs", startup_timeout_s=30, cpus=[{first}, {second}],
                            gpus=["0", "1,2"], env={"BIND": "cpus={cpus} index={index}"}).start()
    try:
        pids = servers.pids()
        assert [_status(pid, "Cpus_allowed_list") for pid in pids] == [str(first), str(second)]
        envs = [_environ(pid) for pid in pids]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1,2"]
        assert [e["BIND"] for e in envs] == [f"cpus={first} index=0", f"cpus={second} index=1"]
        servers.restart(1)  # a restarted server keeps its pinning
        assert _status(servers.pids()[1], "Cpus_allowed_list") == str(second)
    finally:
        servers.stop()


def test_pinning_to_a_cpu_this_process_may_not_use_is_refused_before_launch(tmp_path):
    absent = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(RoleError, match=f"pinned to CPUs \\[{absent}\\]"):
        EngineServers(["true"], count=1, ports=(18600, 18699), log_dir=tmp_path, cpus=[{absent}])


def test_vllm_servers_bind_their_openmp_threads_to_their_pinned_cpus():
    from rlctl_vllm.backend import launch_env
    from rlctl_vllm.options import LaunchOptions

    assert "VLLM_CPU_OMP_THREADS_BIND" not in launch_env(LaunchOptions())
    env = launch_env(LaunchOptions(num_servers=2, cpus=["0", "1"]))
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "{cpus}" and env["VLLM_SERVER_DEV_MODE"] == "1"
