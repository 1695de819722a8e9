"""A launched vLLM-CPU server pinned with ``launch.cpus``: every process of its group (API server, EngineCore)
runs on the CPU asked for, and vLLM binds its OpenMP threads there too (live, .venv-vllm; skips like
test_vllm.py when the engine venv is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.integration.test_vllm import ENGINE_ARGS, VLLM_PYTHON, vllm_model_dir  # noqa: F401  (a fixture)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _group(pgid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    out.append(int(entry.name))
            except ProcessLookupError:
                pass
    return out


def _status(pid: int, field: str) -> str:
    return next(line.split(":", 1)[1].strip() for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(field + ":"))


def test_a_pinned_vllm_server_runs_only_on_its_cpu(vllm_model_dir, tmp_path):  # noqa: F811
    from rlctl.contracts.types import RolloutContext
    from rlctl_vllm.backend import VLLMRollout
    from rlctl_vllm.options import VLLMOptions

    cpu = max(os.sched_getaffinity(0))
    options = VLLMOptions(launch={"python": str(VLLM_PYTHON), "engine_args": ENGINE_ARGS, "cpus": [str(cpu)],
                                  "log_dir": str(tmp_path / "logs")})
    backend = VLLMRollout(RolloutContext(model_dir=str(vllm_model_dir), tokenizer_hash="x", seed=0), options)
    try:
        (pid,) = backend.engines.pids()
        members = _group(pid)
        assert len(members) >= 2  # the API server and its EngineCore at least
        assert {_status(p, "Cpus_allowed_list") for p in members} == {str(cpu)}
        assert f"core ids=[{cpu}]" in (tmp_path / "logs" / "server-0.log").read_text()  # vLLM's OpenMP binding
    finally:
        backend.close()
