"""The jail's cgroup choice (v2 delegated subtree, else v1, else refuse) and the seccomp program's shape.

This host has cgroup v1 controllers and a cgroup2 mount with none enabled, so the v2 path is exercised
against FAKE_CGROUPFS: a temporary directory laid out like a cgroup2 mount (interface files are plain
files there, and nothing enforces them). The real v1 path runs live in test_sandbox_payloads.py.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from rlctl_rewards import sandbox as sandbox_mod
from rlctl_rewards import seccomp as seccomp_mod
from rlctl_rewards.sandbox import Limits, Sandbox, SandboxUnavailable, _Cgroup, _v2_parent
from rlctl_rewards.seccomp import seccomp_program


def fake_cgroupfs(tmp_path: Path, subtree: str = "pids memory") -> Path:
    """FAKE_CGROUPFS: a cgroup2 root whose children get ``subtree``, with this process in ``/rlctl.service``."""
    root = tmp_path / "fake-cgroup2"
    own = root / "rlctl.service"
    own.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text(subtree + "\n")
    (own / "cgroup.controllers").write_text(subtree + "\n")
    (own / "cgroup.subtree_control").write_text("\n")
    (own / "cgroup.procs").write_text(f"{os.getpid()}\n")
    return root


def test_v2_parent_is_the_delegating_directory_nearest_our_own_cgroup(tmp_path: Path) -> None:
    root = fake_cgroupfs(tmp_path)
    assert _v2_parent(root, "/rlctl.service") == root  # our cgroup holds a process: runs go next to it
    (root / "rlctl.service" / "cgroup.subtree_control").write_text("memory pids\n")
    assert _v2_parent(root, "/rlctl.service") == root / "rlctl.service"
    assert _v2_parent(root, "/") == root


@pytest.mark.parametrize("subtree", ["", "memory", "pids cpu"])
def test_v2_without_both_controllers_delegated_is_not_used(tmp_path: Path, subtree: str) -> None:
    assert _v2_parent(fake_cgroupfs(tmp_path, subtree), "/rlctl.service") is None


def test_v2_run_cgroup_gets_pids_memory_and_no_swap_limits(tmp_path: Path) -> None:
    root = fake_cgroupfs(tmp_path)
    group = _Cgroup.create(Limits(pids=7, memory_mb=64), v2_parent=root)
    assert group.version == 2 and group.pids == group.memory and group.pids.parent == root
    assert group.pids.name.startswith(f"rlctl-sbx-{os.getpid()}-")
    assert (group.pids / "pids.max").read_text() == "7"
    assert (group.pids / "memory.max").read_text() == str(64 << 20)
    assert (group.pids / "memory.swap.max").read_text() == "0"
    assert group.procs_files() == [str(group.pids / "cgroup.procs")]  # the launcher joins one cgroup, not two
    assert not group.pids_limited() and not group.oom_killed()
    (group.pids / "pids.events").write_text("max 3\n")
    (group.pids / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 1\noom_kill 1\n")
    (group.pids / "cgroup.procs").write_text("")
    assert group.pids_limited() and group.oom_killed() and group.members() == []
    for name in ("pids.max", "memory.max", "memory.swap.max", "pids.events", "memory.events", "cgroup.procs"):
        (group.pids / name).unlink()  # cgroupfs removes its interface files itself; a plain directory does not
    group.remove()
    assert not group.pids.exists()


def test_a_usable_v2_subtree_is_preferred_over_v1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_cgroupfs(tmp_path)
    monkeypatch.setattr(sandbox_mod, "_v2_mount", lambda: root)
    group = _Cgroup.create(Limits(), v1_root=tmp_path / "no-v1")
    try:
        assert group.version == 2 and group.pids.parent.is_relative_to(root)
    finally:
        for path in group.pids.iterdir():
            path.unlink()
        group.remove()


def test_neither_v2_nor_v1_fails_closed_with_one_line_naming_both(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Like this host's hybrid mount, v2 enables no controllers; and there is no v1 hierarchy either."""
    monkeypatch.setattr(sandbox_mod, "_v2_mount", lambda: fake_cgroupfs(tmp_path, subtree=""))
    with pytest.raises(SandboxUnavailable) as err:
        _Cgroup.create(Limits(), v1_root=tmp_path / "no-v1")
    message = str(err.value)
    assert "cgroup v2" in message and "cgroup v1" in message and "\n" not in message
    assert "subtree_control" in err.value.hint and "/sys/fs/cgroup" in err.value.hint


def test_this_host_uses_v1_because_its_v2_mount_has_no_controllers(needs_sandbox) -> None:
    if _v2_parent() is not None:
        pytest.skip("this host delegates pids+memory in cgroup v2")
    group = _Cgroup.create(Limits())
    try:
        assert group.version == 1 and group.pids != group.memory
        assert (group.pids / "pids.max").read_text().strip() == "32"
    finally:
        group.remove()


def _instructions(program: bytes) -> list[tuple[int, int, int, int]]:
    assert len(program) % 8 == 0
    return [struct.unpack("=HBBI", program[i:i + 8]) for i in range(0, len(program), 8)]


@pytest.mark.parametrize(("machine", "audit_arch"), [("x86_64", 0xC000003E), ("aarch64", 0xC00000B7)])
def test_seccomp_program_checks_the_arch_first_and_jumps_land_inside(machine: str, audit_arch: int) -> None:
    ops = _instructions(seccomp_program(machine))
    assert ops[0] == (0x20, 0, 0, 4)  # load seccomp_data.arch
    assert ops[1][0] == 0x15 and ops[1][3] == audit_arch and ops[2] == (0x06, 0, 0, 0x80000000)  # else kill
    assert ops[-1] == (0x06, 0, 0, 0x7FFF0000)  # what no rule denies is allowed
    assert len(ops) < 4096  # BPF_MAXINSNS
    for i, (code, jt, jf, _) in enumerate(ops):
        if code & 0x07 == 0x05:  # BPF_JMP
            assert i + 1 + max(jt, jf) < len(ops)
        if code & 0x07 == 0x06:  # BPF_RET: kill, EPERM, ENOSYS or allow
            assert ops[i][3] in (0x80000000, 0x00050001, 0x00050026, 0x7FFF0000)


def test_seccomp_on_an_unknown_architecture_refuses(needs_sandbox, monkeypatch) -> None:
    with pytest.raises(ValueError, match="riscv64"):
        seccomp_program("riscv64")
    monkeypatch.setattr(seccomp_mod.platform, "machine", lambda: "riscv64")
    with pytest.raises(SandboxUnavailable, match="no seccomp filter for the riscv64 architecture"):
        Sandbox().check()
