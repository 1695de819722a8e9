"""The ``python`` tool: run the policy's code in the bubblewrap sandbox and answer with what it printed.

What this is: a Tool (rlctl.contracts.roles) that runs its arguments as a
Python program (``python3 -I -S``, code on stdin) in ``rlctl_rewards.sandbox``
with its limits and seccomp filter, and returns stdout. It lives here, beside
the sandbox, and is registered by this plugin.

Who is to blame: code that raises, runs past ``wall_s``, prints past the output
cap or hits the memory cap is the policy's mistake (``BadToolCall``: the
environment shows ``error: ...`` to the policy). A jail that cannot start is
an infrastructure failure (``ToolError``: the episode is flagged). The
sandbox is checked when the tool is built: no jail here, one clear error.

What this is not: the "code" reward (rlctl_rewards.code), which judges code against tests.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.errors import BadToolCall, ToolError
from rlctl_rewards.sandbox import Limits, Sandbox, SandboxUnavailable

VERSION = "1"


class PythonToolOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(3.0, gt=0, le=600, description="Wall-clock limit of one program (keep it under the "
                          "environment's step_timeout_s: past that the call is an infrastructure timeout).")
    cpu_s: int = Field(3, ge=1, le=600, description="CPU-time limit (RLIMIT_CPU).")
    memory_mb: int = Field(256, ge=64, le=65536, description="Memory cap (cgroup and RLIMIT_AS).")
    pids: int = Field(16, ge=4, le=4096, description="Process cap (cgroup pids.max), bwrap's own included.")
    output_kib: int = Field(64, ge=1, le=65536, description="stdout/stderr cap per stream.")
    python: str = Field("/usr/bin/python3", description="Interpreter inside the jail (world-executable, under /usr).")
    mode: Literal["program", "expression"] = Field(
        "program", description="program: run the arguments as a program, answer with its stdout; expression: "
        "answer with the value of the arguments as one Python expression (a calculator that runs in the jail).")


class PythonTool:
    """Runs code in the sandbox; the answer is its stdout."""

    name = "python"
    version = VERSION

    def __init__(self, options: PythonToolOptions | None = None) -> None:
        self.options = o = options or PythonToolOptions()
        self.sandbox = Sandbox(Limits(wall_s=o.wall_s, cpu_s=o.cpu_s, memory_mb=o.memory_mb, pids=o.pids,
                                      output_bytes=o.output_kib << 10), python=o.python)
        self.sandbox.check()  # at build time: no jail, one clear error (e.g. apt-get install -y bubblewrap)

    def call(self, arguments: str, timeout_s: float) -> str:
        if self.options.mode == "expression":  # the text stays a string literal; only the jail evaluates it
            arguments = f"print(eval(compile({arguments!r}, '<tool>', 'eval')))"
        try:
            run = self.sandbox.run([self.sandbox.python, "-I", "-S", "-"], arguments.encode())
        except SandboxUnavailable as err:
            raise ToolError(str(err)) from None
        if run.status == "timeout":
            raise BadToolCall(f"time limit {self.options.wall_s}s exceeded")
        if run.status == "output_limit":
            raise BadToolCall(f"output past {self.options.output_kib} KiB")
        if run.oom_killed:
            raise BadToolCall(f"memory limit {self.options.memory_mb} MiB exceeded")
        if run.returncode != 0:
            lines = run.stderr.decode(errors="replace").strip().splitlines()
            raise BadToolCall(lines[-1] if lines else f"exit status {run.returncode}")
        return run.stdout.decode(errors="replace").rstrip("\n")
