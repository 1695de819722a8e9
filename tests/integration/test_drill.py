"""``rlctl drill`` through the CLI: a fast subset of the drills, each a real child ``rlctl train`` with a fault.

The whole drill (ten drills) stays a command; CI runs the three that need one child run each and no rollout
server (NaN rollback, verifier timeouts, tool timeouts), and checks the table, the exit code and that every
result is stored in the registry as a ``drill`` event on its run (about 60 s on 2 cores, so it is not marked
slow).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.integration.test_cli import _assert_one_line_error, rlctl

FAST_DRILLS = ("nan", "verifier-timeout", "tool-failures")


def test_fast_drills_pass_and_are_stored_in_the_registry(tmp_path: Path):
    from rlctl.registry.store import Registry

    args = ["drill", "--json", *[a for name in FAST_DRILLS for a in ("--only", name)]]
    out = json.loads(rlctl(*args, home=tmp_path, check=True, timeout=600).stdout)
    assert out["passed"] is True
    results = {r["drill"]: r for r in out["drills"]}
    assert set(results) == set(FAST_DRILLS)
    for name, result in results.items():
        assert result["passed"] and result["metric_continuity"], result
        assert result["trajectories_duplicated"] == 0, result
    assert results["nan"]["steps_lost"] >= 1  # rolled back to a checkpoint before the NaN steps
    assert results["verifier-timeout"]["time_to_recover_s"] == 0.0  # re-scored in the same step
    assert results["tool-failures"]["trajectories_lost"] > 0  # dropped whole groups, counted, never scored 0
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        for name, result in results.items():
            drills = [e for e in reg.events(result["run_id"]) if e.kind == "drill"]
            assert [e.data["drill"] for e in drills] == [name]
            assert drills[0].data["passed"] is True


def test_unknown_drill_is_one_line_naming_the_drills(tmp_path: Path):
    result = rlctl("drill", "--only", "nosuch", home=tmp_path)
    _assert_one_line_error(result, "nosuch")
    assert "verifier-timeout" in result.stderr  # the hint lists the drills


def test_vllm_drill_without_the_engine_venv_is_one_line_naming_the_install(tmp_path: Path):
    import os
    import subprocess
    import sys

    env = dict(os.environ, RLCTL_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    env.pop("RLCTL_DEBUG", None)
    result = subprocess.run([sys.executable, "-m", "rlctl.cli.app", "drill", "--only", "worker-crash-vllm"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)  # no .venv-vllm here
    _assert_one_line_error(result, "needs the vLLM engine venv")
    assert "docs/vllm.md" in result.stderr
