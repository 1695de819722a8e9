"""``rlctl train --supervise``: restart a crashed training process from its newest committed checkpoint.

What this is: ``supervise``, which runs ``rlctl train`` as a child process
and, when the child dies from a signal (SIGKILL, a segfault, the OOM killer),
runs ``rlctl resume RUN`` for it, up to ``max_restarts`` times, without a
human. Each restart is a ``supervisor_restart`` registry event (restart
number, exit status, signal); giving up is a ``supervisor_gave_up`` event and
a non-zero exit. A child that exits with an error it reported itself (bad
config, a failed canary, a hang) is not restarted: repeating it would not help.

What this is not: a cluster scheduler (Ray restarts actors in the ray mode),
or the resume logic (rlctl.lifecycle.resume.resume, which the child runs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


@dataclass
class SuperviseResult:
    run_id: str | None
    exit_code: int
    restarts: int
    wall_s: float
    crashes: list[dict] = field(default_factory=list)


def _cmd(*argv: str) -> list[str]:
    return [sys.executable, "-m", "rlctl.cli.app", *argv]


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def supervise(train_argv: Sequence[str], run_dir: Path, *, max_restarts: int, open_registry: Callable[[], object],
              env: dict[str, str] | None = None, say: Callable[[str], None] = lambda m: None) -> SuperviseResult:
    """Run ``rlctl train *train_argv --run-dir run_dir``; restart crashes with ``rlctl resume`` (module docstring)."""
    started = time.perf_counter()
    full_env = {**os.environ, **(env or {})}
    code = subprocess.call(_cmd("train", *train_argv, "--run-dir", str(run_dir)), env=full_env)
    restarts, crashes = 0, []
    run_id = _run_id(run_dir)
    while code < 0 and run_id is not None:
        crashes.append({"exit_code": code, "cause": _describe(code)})
        with open_registry() as registry:  # type: ignore[attr-defined]
            if restarts >= max_restarts:
                registry.add_event(run_id, "supervisor_gave_up", f"training {_describe(code)} again after "
                                   f"{restarts} restart(s) (faults.max_restarts={max_restarts})",
                                   {"restarts": restarts, "exit_code": code})
                break
            restarts += 1
            registry.add_event(run_id, "supervisor_restart", f"training process {_describe(code)}; restart "
                               f"{restarts}/{max_restarts} from the newest committed checkpoint",
                               {"restart": restarts, "exit_code": code, "cause": _describe(code)})
        say(f"supervisor: training {_describe(code)}; restarting run {run_id} ({restarts}/{max_restarts})")
        code = subprocess.call(_cmd("resume", run_id), env=full_env)
    if code < 0 and run_id is None:
        crashes.append({"exit_code": code, "cause": _describe(code)})
    return SuperviseResult(run_id=run_id, exit_code=code if code >= 0 else 128 - code, restarts=restarts,
                           wall_s=time.perf_counter() - started, crashes=crashes)


def _run_id(run_dir: Path) -> str | None:
    info = run_dir / "run.json"
    if not info.is_file():
        return None
    return json.loads(info.read_text(encoding="utf-8")).get("run_id")
