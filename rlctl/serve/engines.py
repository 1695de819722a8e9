"""Engine servers that rlctl starts itself (vLLM, SGLang, ...): launch, wait for health, stop, never orphan.

What this is: ``EngineServers``, the processes of one rollout backend's
engine servers. Each server is ``argv`` with its port filled in, started
on 127.0.0.1:

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

What this is not: the API dialect of an engine (the backend's client), or a
restart policy (the backend decides when to call ``restart``).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.serve.client import CallError, call_json

_PR_SET_PDEATHSIG = 1
_LIVE: "set[EngineServers]" = set()
_LOCK = threading.Lock()


def _child_setup() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
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


class EngineServers:
    """``count`` engine server processes started from ``argv`` (``{port}`` is replaced by each server's port)."""

    def __init__(self, argv: Sequence[str], *, count: int, ports: tuple[int, int], log_dir: str | Path,
                 env: Mapping[str, str] | None = None, startup_timeout_s: float = 300.0,
                 name: str = "engine") -> None:
        self.argv, self.count, self.name = list(argv), count, name
        self.log_dir = Path(log_dir)
        self.env = {**os.environ, **(env or {})}
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

    def _spawn(self, i: int) -> None:
        argv = [a.replace("{port}", str(self.ports[i])) for a in self.argv]
        with open(self.log_path(i), "ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            self.procs[i] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env, preexec_fn=_child_setup, close_fds=True)
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
