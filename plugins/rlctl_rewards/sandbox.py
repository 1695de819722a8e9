"""Run untrusted Python in a bubblewrap jail with enforced limits, or refuse to run it.

What this is: ``Sandbox.run`` starts ``python3 -I -S`` inside bwrap with every
namespace unshared (a network namespace with no route out, a PID namespace,
IPC/UTS), a read-only root holding only ``/usr``, private size-capped tmpfs
work dirs, an empty environment, no capabilities, a new session, user
namespaces disabled inside, and ``--die-with-parent``. Around bwrap:

* it runs as an unprivileged uid (``nobody``) outside too, so a jail break
  lands in an account that owns nothing;
* hard rlimits: CPU seconds, address space, file size, open files, no core;
* a seccomp filter (``bwrap --seccomp``, built by ``rlctl_rewards.seccomp``) makes
  the kernel surface a jail has no use for fail with EPERM: ptrace and
  process_vm_*, mount and the new mount API, unshare/setns and clone with
  namespace flags, keyctl, bpf, perf_event_open, userfaultfd, io_uring,
  module and kexec loading, open_by_handle_at, and raw, packet and netlink
  sockets; clone3 gets ENOSYS (its flags are in memory, out of the filter's
  reach), so libc falls back to clone; a syscall of another ABI (i386, x32)
  kills the process;
* a cgroup per run caps processes (``pids.max``; RLIMIT_NPROC does not bind
  root and would be shared by concurrent runs) and memory, and is how
  leftovers are found and killed after the run: a cgroup v2 subtree with the
  pids and memory controllers delegated if there is one, else cgroup v1;
* a wall-clock deadline enforced here, outside: the whole tree is SIGKILLed
  (bwrap's PID namespace dies with its init, then the cgroup is swept);
* stdout and stderr are capped; a run past either cap is killed.

Fail closed: ``Sandbox.check`` (called before the first run) raises
``SandboxUnavailable`` naming what is missing (bwrap, root, a
writable pids+memory cgroup (v2 or v1), a supported architecture for the
seccomp filter, a jail that actually starts). Nothing here ever
runs code without the jail.

What this is not: the test harness (``rlctl_rewards.code`` builds the job and
judges the records) or a kernel boundary: the filter denies a list, so every
syscall not on it still reaches the host kernel (use gVisor if that matters
to you).
"""

from __future__ import annotations

import json
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Sequence

from rlctl.contracts.errors import RlctlError
from rlctl_rewards.seccomp import seccomp_program

NOBODY = 65534
LAUNCHER_PYTHON = "/usr/bin/python3"
_V1_ROOT = Path("/sys/fs/cgroup")
_NO_CGROUP_FIX = ("delegate the pids and memory controllers to a writable cgroup v2 subtree (its "
                  "cgroup.subtree_control lists 'pids memory'), or mount the cgroup v1 pids and memory "
                  "controllers writable under /sys/fs/cgroup, and run as root")
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}  # all the launcher (and so bwrap) ever sees

Status = Literal["exited", "timeout", "output_limit"]


class SandboxUnavailable(RlctlError):
    """The jail cannot be built here; untrusted code is refused, never run bare."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"sandbox unavailable: {problem}", fix)


@dataclass(frozen=True)
class Limits:
    """Resource limits of one sandboxed run."""

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    pids: int = 32
    output_bytes: int = 1 << 20  # per stream
    tmpfs_mb: int = 64
    nofile: int = 256


@dataclass(frozen=True)
class RunResult:
    """What happened to one run: how it ended, its (capped) output and what the limits saw."""

    status: Status
    returncode: int | None
    stdout: bytes
    stderr: bytes
    wall_s: float
    oom_killed: bool = False
    pids_limited: bool = False
    leftovers_killed: int = 0


@dataclass
class _Cgroup:
    """One run's cgroups: a v1 pair (pids + memory) or one v2 directory (then ``pids == memory``).

    Created empty, removed after the run.
    """

    pids: Path
    memory: Path
    version: int = 1
    created: list[Path] = field(default_factory=list)

    @classmethod
    def create(cls, limits: Limits, v2_parent: Path | None = None, v1_root: Path = _V1_ROOT) -> "_Cgroup":
        """The run's cgroup under ``v2_parent`` (default: a delegated v2 subtree found here), else v1."""
        name = f"rlctl-sbx-{os.getpid()}-{secrets.token_hex(4)}"
        parent = v2_parent if v2_parent is not None else _v2_parent()
        if parent is not None:
            group = cls(pids=parent / name, memory=parent / name, version=2)
        else:
            pids, memory = _own_v1(v1_root, "pids"), _own_v1(v1_root, "memory")
            if pids is None or memory is None:
                raise SandboxUnavailable(
                    f"no cgroup with the pids and memory controllers: no cgroup v2 subtree delegates them and "
                    f"no cgroup v1 pids+memory hierarchies are mounted under {v1_root}", _NO_CGROUP_FIX)
            group = cls(pids=pids / name, memory=memory / name)
        mem = str(limits.memory_mb << 20)
        try:
            for path in dict.fromkeys((group.pids, group.memory)):
                path.mkdir()
                group.created.append(path)
            (group.pids / "pids.max").write_text(str(limits.pids))
            if group.version == 2:
                (group.memory / "memory.max").write_text(mem)
                (group.memory / "memory.swap.max").write_text("0")
            else:
                (group.memory / "memory.limit_in_bytes").write_text(mem)
                memsw = group.memory / "memory.memsw.limit_in_bytes"
                if memsw.exists():  # no swap either: memory+swap gets the same cap
                    memsw.write_text(mem)
        except OSError as err:
            group.remove()
            raise SandboxUnavailable(
                f"cannot create a pids+memory cgroup v{group.version} ({err})",
                _NO_CGROUP_FIX + " (a process limit cannot be enforced otherwise)") from None
        return group

    def procs_files(self) -> list[str]:
        return [str(path / "cgroup.procs") for path in dict.fromkeys((self.pids, self.memory))]

    def members(self) -> list[int]:
        pids: set[int] = set()
        for path in self.created:
            try:
                pids.update(int(p) for p in (path / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(pids)

    def wait_empty(self, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while self.members() and time.monotonic() < end:
            time.sleep(0.005)

    def kill_all(self, deadline_s: float = 5.0) -> int:
        """SIGKILL every member until none is left; the number killed. Raises if some survive."""
        killed: set[int] = set()
        end = time.monotonic() + deadline_s
        while True:
            members = self.members()
            if not members:
                return len(killed)
            if time.monotonic() > end:
                raise SandboxUnavailable(f"processes {members[:5]} survived SIGKILL in {self.pids}",
                                         "inspect them; the host may be overloaded")
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)

    def oom_killed(self) -> bool:
        try:
            if self.version == 2:
                events = _keyed((self.memory / "memory.events").read_text())
                return events.get("oom_kill", 0) > 0 or events.get("max", 0) > 0
            control = (self.memory / "memory.oom_control").read_text()
            failcnt = int((self.memory / "memory.failcnt").read_text())
        except (OSError, ValueError):
            return False
        kills = [int(line.split()[1]) for line in control.splitlines() if line.startswith("oom_kill ")]
        return bool(kills and kills[0] > 0) or failcnt > 0

    def pids_limited(self) -> bool:
        try:
            return _keyed((self.pids / "pids.events").read_text()).get("max", 0) > 0
        except (OSError, ValueError):
            return False

    def remove(self) -> None:
        for path in reversed(self.created):
            for _ in range(100):  # rmdir fails while the kernel is still reaping the last task
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)
        self.created.clear()


def _keyed(text: str) -> dict[str, int]:
    """A flat-keyed cgroup file (``pids.events``, ``memory.events``) as a dict."""
    return {key: int(value) for key, value in (line.split() for line in text.splitlines() if line.strip())}


def _own_v1(root: Path, controller: str) -> Path | None:
    """This process's cgroup directory in a v1 hierarchy (runs nest under it, so outer limits hold), or None."""
    base = root / controller
    if not (base / "cgroup.procs").exists():
        return None
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        if controller in names.split(","):
            own = base / path.lstrip("/")
            return own if own.is_dir() else base
    return base


def _v2_mount() -> Path | None:
    """Where cgroup2 is mounted (``/sys/fs/cgroup``, or ``.../unified`` on a hybrid host), if anywhere."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - cgroup2 " in line and len(fields) > 4:
            return Path(fields[4])
    return None


def _v2_parent(root: Path | None = None, own: str | None = None) -> Path | None:
    """A writable v2 directory whose children get the pids and memory controllers, or None.

    Looks at this process's own cgroup (``own``, as in ``/proc/self/cgroup``'s ``0::`` line) and then
    its parent, never above ``root``: a delegated subtree enables ``pids memory`` in its
    ``cgroup.subtree_control`` and lets us write there.
    """
    root = root if root is not None else _v2_mount()
    if root is None:
        return None
    if own is None:
        lines = [line for line in Path("/proc/self/cgroup").read_text().splitlines() if line.startswith("0::")]
        own = lines[0][3:] if lines else "/"
    here = root / own.strip().lstrip("/")
    for candidate in (here, here.parent):
        if not candidate.is_relative_to(root):
            break
        try:
            enabled = (candidate / "cgroup.subtree_control").read_text().split()
        except OSError:
            continue
        if {"pids", "memory"} <= set(enabled) and os.access(candidate, os.W_OK):
            return candidate
    return None


class Sandbox:
    """A bwrap jail with resource limits; see the module docstring for what it enforces.

    ``drop_flags`` removes bwrap flags from the command (``--seccomp`` drops the
    filter). It exists only so a test can prove the payload suite notices a
    missing isolation flag.
    """

    def __init__(self, limits: Limits | None = None, python: str = "/usr/bin/python3", *,
                 drop_flags: Sequence[str] = ()) -> None:
        self.limits = limits or Limits()
        self.python = python
        self.drop_flags = tuple(drop_flags)
        self._checked = False

    def bwrap_args(self) -> list[str]:
        """The bwrap command up to (not including) the program to run."""
        tmp = str(self.limits.tmpfs_mb << 20)
        args = [
            "bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
            "--unshare-cgroup", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL", "--disable-userns", "--clearenv",
            "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8",
            "--ro-bind", "/usr", "/usr", "--symlink", "usr/lib", "/lib", "--symlink", "usr/lib64", "/lib64",
            "--symlink", "usr/bin", "/bin", "--proc", "/proc", "--dev", "/dev",
            "--size", tmp, "--tmpfs", "/tmp", "--size", tmp, "--tmpfs", "/work", "--chdir", "/work",
            "--remount-ro", "/",
        ]
        for flag in self.drop_flags:
            if flag != "--seccomp":  # the launcher adds that one (it owns the fd)
                args.remove(flag)
        return args

    def seccomp(self) -> bytes | None:
        """The seccomp program the jail runs under (None only when a test dropped ``--seccomp``)."""
        if "--seccomp" in self.drop_flags:
            return None
        try:
            return seccomp_program()
        except ValueError as err:
            raise SandboxUnavailable(str(err), "grade code on an x86_64 or aarch64 host") from None

    def launcher_args(self, cgroup: _Cgroup, argv: Sequence[str]) -> list[str]:
        """The trusted root launcher (see ``LAUNCHER``) with this run's cgroups, rlimits and command."""
        lim = self.limits
        spec = {
            "cgroups": list(cgroup.procs_files()), "uid": NOBODY,
            "rlimits": {"RLIMIT_CPU": lim.cpu_s, "RLIMIT_AS": lim.memory_mb << 20,
                        "RLIMIT_FSIZE": lim.tmpfs_mb << 20, "RLIMIT_NOFILE": lim.nofile, "RLIMIT_CORE": 0},
            "argv": [*self.bwrap_args(), *argv],
            "seccomp": (self.seccomp() or b"").hex(),
        }
        return [LAUNCHER_PYTHON, "-I", "-S", "-c", LAUNCHER, json.dumps(spec)]

    def check(self) -> None:
        """Raise SandboxUnavailable unless a jailed ``print('ok')`` runs here (once per Sandbox)."""
        if self._checked:
            return
        if shutil.which("bwrap", path=_ENV["PATH"]) is None:
            raise SandboxUnavailable("bubblewrap ('bwrap') is not installed", "apt-get install -y bubblewrap")
        if not os.access(LAUNCHER_PYTHON, os.X_OK):
            raise SandboxUnavailable(f"{LAUNCHER_PYTHON} (runs the jail's launcher) is missing",
                                     "apt-get install -y python3")
        if os.geteuid() != 0:
            raise SandboxUnavailable(
                "not running as root, so no per-run cgroup can cap processes and memory",
                "run rlctl as root (for example in its container), or grade code elsewhere",
            )
        self.seccomp()  # raises on an architecture the filter does not know
        if not os.access(self.python, os.X_OK) or not os.stat(self.python).st_mode & 0o001:
            raise SandboxUnavailable(f"interpreter {self.python} is not executable by everyone",
                                     "point the code reward's python option at a system python3")
        probe = self._run_checked([self.python, "-I", "-S", "-c", "print('ok')"], b"")
        if probe.status != "exited" or probe.returncode != 0 or probe.stdout.strip() != b"ok":
            raise SandboxUnavailable(
                f"a jailed test program did not run (status {probe.status}, exit {probe.returncode}): "
                f"{probe.stderr.decode(errors='replace')[-400:].strip()}",
                "check that unprivileged user namespaces are enabled (sysctl user.max_user_namespaces > 0)",
            )
        self._checked = True

    def run(self, argv: Sequence[str], stdin: bytes = b"") -> RunResult:
        """Run ``argv`` (inside the jail) with ``stdin``; never raises for what the program does."""
        self.check()
        return self._run_checked(argv, stdin)

    def _run_checked(self, argv: Sequence[str], stdin: bytes) -> RunResult:
        lim = self.limits
        cgroup = _Cgroup.create(lim)
        started = time.monotonic()
        try:
            proc = subprocess.Popen(
                self.launcher_args(cgroup, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, env=dict(_ENV), cwd="/", start_new_session=True, close_fds=True,
            )
        except OSError as err:
            cgroup.remove()
            raise SandboxUnavailable(f"cannot start the jail ({err})", "check the bwrap installation") from None
        status: Status = "exited"
        out = err = b""
        swept = 0
        try:
            status, out, err = _communicate(proc, stdin, started + lim.wall_s, lim.output_bytes)
            if status != "exited":  # kill the whole jail; the launcher (outside the cgroup) then reaps and exits
                swept = cgroup.kill_all()
            try:
                returncode = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                status = "timeout"
        finally:
            if proc.poll() is None:
                cgroup.kill_all()
                _killpg(proc.pid)
                returncode = proc.wait()
            try:
                cgroup.wait_empty(0.2)
                leftovers = swept + cgroup.kill_all()
                oom, limited = cgroup.oom_killed(), cgroup.pids_limited()
            finally:
                cgroup.remove()
        return RunResult(status=status, returncode=None if status == "timeout" else returncode,
                         stdout=out, stderr=err, wall_s=time.monotonic() - started,
                         oom_killed=oom, pids_limited=limited, leftovers_killed=leftovers)


def _killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _communicate(proc: subprocess.Popen[bytes], stdin: bytes, deadline: float,
                 cap: int) -> tuple[Status, bytes, bytes]:
    """Feed stdin, collect stdout/stderr up to ``cap`` bytes each, until EOF or the deadline."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream.fileno(), selectors.EVENT_READ)
    pending, stdin_fd = memoryview(stdin), proc.stdin.fileno()
    if pending:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    status: Status = "exited"
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                status = "timeout"
                break
            for key, _ in sel.select(remaining):
                fd = key.fd
                if fd == stdin_fd:
                    try:
                        pending = pending[os.write(fd, pending[:65536]):]
                    except (BrokenPipeError, OSError):
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                chunk = os.read(fd, 65536)
                if not chunk:
                    sel.unregister(fd)
                    continue
                buf = bufs[fd]
                overflow = len(buf) + len(chunk) > cap
                buf += chunk[: max(0, cap - len(buf))]
                if overflow:
                    status = "output_limit"
                    raise StopIteration
    except StopIteration:
        pass
    finally:
        sel.close()
        if not proc.stdin.closed:
            try:
                proc.stdin.close()
            except OSError:
                pass
    return status, bytes(bufs[proc.stdout.fileno()]), bytes(bufs[proc.stderr.fileno()])


# The launcher: trusted code run as root outside the jail, one per run. It dies with the grader
# (PDEATHSIG), is a child subreaper (so bwrap's orphaned pid-1 is reaped here, not left a zombie
# under a container init that never reaps), forks the jail's first process, and exits with its
# status once every descendant is reaped. The child joins the run's cgroups while still root,
# lowers hard rlimits, drops to the unprivileged uid for good, re-arms PDEATHSIG (a uid change
# clears it), puts the seccomp program in a pipe for ``bwrap --seccomp FD`` and execs bwrap.
LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys
spec = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(1, signal.SIGKILL, 0, 0, 0)
libc.prctl(36, 1, 0, 0, 0)
if os.getppid() == 1:
    os._exit(125)
parent = os.getpid()
pid = os.fork()
if pid == 0:
    try:
        for path in spec["cgroups"]:
            with open(path, "w") as fh:
                fh.write(str(os.getpid()))
        for name, value in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        uid = spec["uid"]
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:
            os._exit(125)
        argv = spec["argv"]
        if spec["seccomp"]:
            program = bytes.fromhex(spec["seccomp"])
            read, write = os.pipe()
            if os.write(write, program) != len(program):
                os._exit(125)
            os.close(write)
            os.set_inheritable(read, True)
            argv = [argv[0], "--seccomp", str(read), *argv[1:]]
        os.execvp(argv[0], argv)
    except BaseException as err:
        os.write(2, ("rlctl sandbox launcher: " + repr(err) + "\n").encode())
    os._exit(125)
null = os.open("/dev/null", os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
code = 125
while True:
    try:
        done, status = os.waitpid(-1, 0)
    except ChildProcessError:
        break
    if done == pid:
        code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""
