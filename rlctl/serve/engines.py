"""Engine servers that rlctl starts itself (vLLM, SGLang, ...): launch, wait for health, stop, never orphan.

What this is: ``EngineServers``, the processes of one rollout backend's
engine servers. Each server is ``argv`` with its port filled in, started
on 127.0.0.1:

- pinned, when asked, to its own CPUs (``sched_setaffinity`` on the child,
  inherited by the engine's workers) and GPUs (``CUDA_VISIBLE_DEVICES``);
- in its own process group (``setsid``) with a parent-death signal
  (``prctl(PR_SET_PDEATHSIG, SIGTERM)`` through ctypes), so the kernel stops
  it when rlctl dies, even by SIGKILL, and ``stop`` can signal the whole
  group (the engine's own worker processes included);
- its stdout and stderr go to ``<log_dir>/server-<i>.log``;
- ``start`` waits until every server answers ``GET /health`` (or one exits,
  or ``startup_timeout_s`` passes: an error quoting the end of its log);
- ``stop`` (also run at interpreter exit and on SIGTERM / SIGINT) sends
  SIGTERM to each group, then SIGKILL after a grace period.

The parent-death signal fires when the thread that started the child ends,
so start servers from a thread that lives as long as the run (the main one).

``EngineLaunch`` is the ``launch`` block the engine plugins share (vllm,
sglang): interpreter, number of servers, engine args, ports, pinning, logs;
each plugin adds its own fields and builds the command line.

What this is not: the API dialect of an engine (the backend's client), or a
restart policy (the backend decides when to call ``restart``).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlctl.contracts.errors import RoleError
from rlctl.serve.client import CallError, call_json

_PR_SET_PDEATHSIG = 1
_LIVE: "set[EngineServers]" = set()
_LOCK = threading.Lock()


def _child_setup(cpus: frozenset[int] | None = None) -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the atexit / signal handlers remain


def free_ports(count: int, low: int, high: int) -> list[int]:
    """``count`` ports in [low, high] that nothing listens on at 127.0.0.1 now."""
    out: list[int] = []
    for port in range(low, high + 1):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        out.append(port)
        if len(out) == count:
            return out
    raise RoleError(f"only {len(out)} of {count} free ports in {low}..{high} on 127.0.0.1",
                    "widen the launch block's port range or stop what listens there")


def parse_cpus(spec: str | int) -> frozenset[int]:
    """A CPU list in taskset / cpuset syntax (``"0"``, ``"0-3"``, ``"0,2-3"``) as a set of CPU ids."""
    out: set[int] = set()
    for part in str(spec).replace(" ", "").split(","):
        low, sep, high = part.partition("-")
        if not low.isdigit() or (sep and not high.isdigit()):
            raise ValueError(f"CPU list {str(spec)!r} is not like '0', '0-3' or '0,2-3'")
        first, last = int(low), int(high) if sep else int(low)
        if last < first:
            raise ValueError(f"CPU range {part!r} runs backwards")
        out.update(range(first, last + 1))
    return frozenset(out)


def _per_server(values: Sequence[str] | None, count: int, key: str) -> list[str] | None:
    """One entry for every server, or one for all of them."""
    if not values:
        return None
    if len(values) not in (1, count):
        raise ValueError(f"{key} has {len(values)} entries for num_servers={count}: give one for all servers or "
                         "one per server")
    return [str(v) for v in values] * (count if len(values) == 1 else 1)


class EngineLaunch(BaseModel):
    """``rollout.options.launch``, the part every engine plugin shares: rlctl starts the servers on 127.0.0.1."""

    model_config = ConfigDict(extra="forbid")

    python: str = Field("python", description="Interpreter of the venv the engine is installed in (relative "
                        "paths from the working directory).")
    num_servers: int = Field(1, ge=1, description="How many servers to start (each loads the whole model).")
    engine_args: list[str] = Field(default_factory=list, description="Extra arguments of the engine's server "
                                   "command, appended to the ones rlctl sets.")
    command: list[str] | None = Field(None, description="Replace the engine's server command entirely (e.g. a "
                                      "wrapper script); {python}, {model}, {port}, {index}, {cpus}, {gpus} are "
                                      "filled in per server; engine_args are still appended.")
    port_range: tuple[int, int] = Field((18200, 18299), description="Ports tried on 127.0.0.1, lowest first.")
    cpus: list[str] | None = Field(None, description="CPU pinning: one CPU list per server in taskset syntax "
                                   "(['0', '1'], ['0-3', '4-7']) or one for all; the server and its workers run "
                                   "only there (sched_setaffinity).")
    gpus: list[str] | None = Field(None, description="GPU pinning: one CUDA_VISIBLE_DEVICES value per server "
                                   "(['0', '1'], ['0,1', '2,3']) or one for all.")
    startup_timeout_s: float = Field(300.0, gt=0, description="How long to wait for a server's /health.")
    log_dir: str | None = Field(None, description="Where server-<i>.log go. Default: "
                                "$RLCTL_HOME/engines/<engine>-<pid>-<time>, moved to <run_dir>/engines once the "
                                "training run's directory exists.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment of the servers; "
                                "{port}, {index}, {cpus}, {gpus} are filled in per server.")

    @field_validator("cpus")
    @classmethod
    def _cpu_lists(cls, cpus: list[str] | None) -> list[str] | None:
        for spec in cpus or []:
            parse_cpus(spec)
        return cpus

    @model_validator(mode="after")
    def _ports_and_pinning(self) -> "EngineLaunch":
        low, high = self.port_range
        if not 1024 <= low <= high <= 65535 or high - low + 1 < self.num_servers:
            raise ValueError(f"port_range {list(self.port_range)} must hold num_servers={self.num_servers} ports "
                             "within 1024..65535")
        _per_server(self.cpus, self.num_servers, "rollout.options.launch.cpus")
        _per_server(self.gpus, self.num_servers, "rollout.options.launch.gpus")
        return self

    def cpu_sets(self) -> list[frozenset[int]] | None:
        """Each server's CPUs (None: not pinned)."""
        specs = _per_server(self.cpus, self.num_servers, "rollout.options.launch.cpus")
        return [parse_cpus(s) for s in specs] if specs else None

    def gpu_lists(self) -> list[str] | None:
        """Each server's CUDA_VISIBLE_DEVICES (None: not pinned)."""
        return _per_server(self.gpus, self.num_servers, "rollout.options.launch.gpus")

    def argv(self, default: Sequence[str], model_dir: str) -> list[str]:
        """The server command: ``command`` (or the engine's ``default``) with {python} and {model} filled in,
        then engine_args; {port} and the other per-server fields are filled in by EngineServers."""
        head = self.command or list(default)
        return [a.replace("{python}", self.python).replace("{model}", model_dir) for a in head] + self.engine_args

    def log_dir_for(self, engine: str) -> Path:
        if self.log_dir:
            return Path(self.log_dir)
        home = Path(os.environ.get("RLCTL_HOME", Path.home() / ".rlctl"))
        return home / "engines" / f"{engine}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}"

    def servers(self, argv: Sequence[str], *, name: str, env: Mapping[str, str] | None = None) -> "EngineServers":
        """The EngineServers this block describes (not started)."""
        return EngineServers(argv, count=self.num_servers, ports=self.port_range,
                             log_dir=self.log_dir_for(name.lower()), env={**(env or {}), **self.env},
                             startup_timeout_s=self.startup_timeout_s, name=name, cpus=self.cpu_sets(),
                             gpus=self.gpu_lists())


def _check_cpus(cpus: Sequence[frozenset[int]]) -> None:
    allowed = os.sched_getaffinity(0)
    for i, wanted in enumerate(cpus):
        missing = sorted(wanted - allowed)
        if missing:
            raise RoleError(f"engine server {i} is pinned to CPUs {missing}, which this process may not use "
                            f"(allowed: {_fmt_cpus(allowed)})", "pin the servers to CPUs in that list "
                            "(rollout.options.launch.cpus)")


def _fmt_cpus(cpus: Sequence[int] | frozenset[int] | set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"`` (the syntax /proc/PID/status's Cpus_allowed_list and taskset use)."""
    ids, out = sorted(cpus), []
    for cpu in ids:
        if out and out[-1][1] == cpu - 1:
            out[-1][1] = cpu
        else:
            out.append([cpu, cpu])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in out)


class EngineServers:
    """``count`` engine server processes started from ``argv`` (``{port}`` is replaced by each server's port,
    ``{index}`` by its index, ``{cpus}`` / ``{gpus}`` by its pinning)."""

    def __init__(self, argv: Sequence[str], *, count: int, ports: tuple[int, int], log_dir: str | Path,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 300.0,
                 name: str = "engine", cpus: Sequence[frozenset[int]] | None = None,
                 gpus: Sequence[str] | None = None) -> None:
        self.argv, self.count, self.name = list(argv), count, name
        self.log_dir = Path(log_dir)
        self.env = {**os.environ, **(env or {})}
        self._filled_env = list(env or {})  # the keys whose values may hold {port}, {cpus}, ...
        for what, given in (("cpus", cpus), ("gpus", gpus)):
            if given is not None and len(given) != count:
                raise RoleError(f"{len(given)} {what} entries for {count} {name} servers",
                                f"give one {what} entry per server")
        self.cpus = [frozenset(c) for c in cpus] if cpus else None
        self.gpus = list(gpus) if gpus else None
        if self.cpus:
            _check_cpus(self.cpus)
        self.startup_timeout_s = startup_timeout_s
        self.ports = free_ports(count, *ports)
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.startup_s: list[float] = [0.0] * count

    def start(self) -> "EngineServers":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with _LOCK:
            _LIVE.add(self)
        _install_handlers()
        try:
            for i in range(self.count):
                self._spawn(i)
            for i in range(self.count):
                self._await_health(i)
        except BaseException:
            self.stop()
            raise
        return self

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"server-{i}.log"

    def fields(self, i: int) -> dict[str, str]:
        """What ``{port}``, ``{index}``, ``{cpus}``, ``{gpus}`` become for server ``i``."""
        return {"port": str(self.ports[i]), "index": str(i), "cpus": _fmt_cpus(self.cpus[i]) if self.cpus else "",
                "gpus": self.gpus[i] if self.gpus else ""}

    def _fill(self, text: str, i: int) -> str:
        for key, value in self.fields(i).items():
            text = text.replace("{" + key + "}", value)
        return text

    def _spawn(self, i: int) -> None:
        argv = [self._fill(a, i) for a in self.argv]
        env = {**self.env, **{k: self._fill(self.env[k], i) for k in self._filled_env}}
        if self.gpus:
            env["CUDA_VISIBLE_DEVICES"] = self.gpus[i]
        pinned = self.cpus[i] if self.cpus else None
        with open(self.log_path(i), "ab") as log:
            where = f" (cpus {_fmt_cpus(pinned)})" if pinned else ""
            log.write(f"$ {' '.join(argv)}{where}\n".encode())
            log.flush()
            self.procs[i] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=env, preexec_fn=functools.partial(_child_setup, pinned),
                                             close_fds=True)
        self.startup_s[i] = time.monotonic()

    def _await_health(self, i: int) -> None:
        started, proc, url = self.startup_s[i], self.procs[i], self.urls[i]
        while True:
            code = proc.poll()
            if code is not None:
                raise RoleError(f"{self.name} server {i} ({url}) exited with code {code} while starting:\n"
                                f"{self.log_tail(i)}", f"read {self.log_path(i)}; check the launch block's "
                                "python, model and engine args")
            try:
                call_json(url, "GET", "/health", timeout_s=2.0)
                self.startup_s[i] = time.monotonic() - started
                return
            except CallError:
                pass
            if time.monotonic() - started > self.startup_timeout_s:
                raise RoleError(f"{self.name} server {i} ({url}) not healthy after {self.startup_timeout_s:g}s:\n"
                                f"{self.log_tail(i)}", f"read {self.log_path(i)}; raise the launch block's "
                                "startup_timeout_s if the machine is slow")
            time.sleep(0.5)

    def move_logs(self, target: str | Path) -> None:
        """Move the log directory to ``target`` (open logs keep writing there); across file systems a link at
        ``target`` points at it instead."""
        target = Path(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.rename(self.log_dir, target)
        except OSError:
            if not target.exists():
                target.symlink_to(self.log_dir.resolve(), target_is_directory=True)
            return
        self.log_dir = target

    def log_tail(self, i: int, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path(i).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def alive(self, i: int) -> bool:
        proc = self.procs[i]
        return proc is not None and proc.poll() is None

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    def restart(self, i: int) -> None:
        """Stop server ``i`` (if it still runs) and start it again on the same port; waits for its health."""
        self._stop_one(i)
        self._spawn(i)
        self._await_health(i)

    def _stop_one(self, i: int, grace_s: float = 10.0) -> None:
        proc = self.procs[i]
        if proc is None:
            return
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine's own workers left in the group
        except (ProcessLookupError, PermissionError):
            pass
        self.procs[i] = None

    def stop(self) -> None:
        for i in range(self.count):
            self._stop_one(i)
        with _LOCK:
            _LIVE.discard(self)


def _stop_all() -> None:
    for servers in list(_LIVE):
        servers.stop()


_INSTALLED = False


def _install_handlers() -> None:
    """Stop every launched server at exit and on SIGTERM / SIGINT (then the previous handler runs)."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    atexit.register(_stop_all)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous = signal.getsignal(sig)

        def handler(signum, frame, previous=previous):
            _stop_all()
            if callable(previous):
                previous(signum, frame)
            elif previous == signal.SIG_DFL:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)

        signal.signal(sig, handler)
