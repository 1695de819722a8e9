"""Fault kinds: each arms a handler at the real place where that failure happens.

What this is: one small class per kind. ``arm(ctx)`` registers a handler at a
fault site (rlctl.kit.arm) and returns its disarm function. Each
handler produces the real failure, never a log line that pretends one:

- ``nan``: multiplies the learner's loss by NaN at ``learner.loss``, so the
  backward pass produces NaN gradients and the learner's own check skips the
  step.
- ``oom``: raises ``torch.OutOfMemoryError`` at ``learner.alloc``, the point
  where the learner is about to allocate a micro-batch's activations (once per
  faulted step, or whenever a micro-batch has more than ``max_rows`` rows).
- ``verifier-timeout`` / ``verifier-error``: for a ``rate`` fraction of
  (sample, attempt) pairs the call of one reward component (``target``, by
  default the first: the verifier) at ``verifier.score`` raises
  ``TimeoutError`` (after ``delay_s``) or ``RuntimeError``; the reward mix
  records them as ``timeout:`` / ``grader_error:`` error codes. Attempts are
  counted per sample; a sample that comes in already failed (a re-score in
  another process than its first call) counts as at least its second attempt.
- ``tool-timeout`` / ``tool-error``: for a ``rate`` fraction of (episode,
  attempt) pairs a tool call of an environment (``target``: the tool's name
  as the policy writes it, e.g. ``calc``; default every tool) at ``tool.call`` raises
  ``TimeoutError`` (after ``delay_s``) or ``ToolError``; the environment
  records it on the env turn (``tool_status`` "timeout" / "error") and flags
  the episode (never a zero reward). Attempts are counted per episode, so a
  retried call (and the episode's next call) draws a fresh coin.
- ``bad-checkpoint``: right after a checkpoint is committed
  (``checkpoint.committed``), truncates or bit-flips one of its files.
- ``learner-crash``: SIGKILLs the process at ``learner.train_step`` (mid-step).
- ``slow-rollout``: sleeps ``delay_s`` inside the rollout call (a straggler).
- ``slow-learner``: sleeps ``delay_s`` inside the learner's train step (in the
  learner actor or a rank actor under Ray).
- ``worker-crash``: SIGKILLs a rollout server process (an ``rlctl serve
  rollout`` behind the ``sglang`` backend, found by the pid it reports, or a
  vLLM server the ``vllm`` backend launched, by the pid the backend passes;
  on this host only) at ``rollout.dispatch``, after the health check and before
  that server gets its share of the step's prompt groups (``once``: at the
  first dispatch at or after ``at_step``, for the overlapped modes); with
  ``cluster.backend: ray`` it SIGKILLs a rollout actor's process (``target``:
  a worker name such as ``ray-1``) at ``rollout.worker``, just before that
  worker's generate call.
- ``network-partition``: for ``duration_s`` seconds from the faulted step,
  every HTTP call the ``sglang`` or ``vllm`` backend makes to a rollout server (or only to
  ``target``, a server URL) goes to a local port that refuses connections
  (``mode: refused``) or accepts them and never answers (``mode: blackhole``,
  detected by the client's timeout) at ``rollout.connect``.
- ``weight-sync-failure``: at the weight publish of the faulted step either a
  shard write fails with ENOSPC (``stage: publish``, at ``weights.write``,
  leaving an uncommitted version directory) or a byte of the committed
  version's first shard is flipped before the servers load it (``stage:
  apply``, at ``weights.published``), so the server's own checksum (sglang)
  or the vllm backend's check of the published bytes refuses it.

What this is not: recovery (the roles and rlctl.incidents.recovery do that).
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from rlctl.contracts.errors import ToolError
from rlctl.kit import FaultContext, arm


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class NanOptions(_Options):
    value: Literal["nan", "inf"] = Field("nan", description="Poison with NaN or +Inf.")


class NanFault:
    """Poison the learner's loss for ``count`` steps in a row from ``at_step``."""

    def __init__(self, options: NanOptions | None = None) -> None:
        self.options = options or NanOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        poison = float(self.options.value)

        def handler(loss: Any, **_: Any) -> Any:
            if not ctx.take():
                return loss
            ctx.fire(f"loss poisoned with {self.options.value} at the learner")
            return loss * poison

        return arm("learner.loss", handler)


class OomOptions(_Options):
    max_rows: int | None = Field(None, ge=0, description="Raise whenever a micro-batch has more rows than this "
                                 "during the fault's steps; null = raise once per faulted step.")


class OomFault:
    """torch.OutOfMemoryError at the learner's micro-batch allocation."""

    def __init__(self, options: OomOptions | None = None) -> None:
        self.options = options or OomOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        import torch

        cap = self.options.max_rows

        def handler(value: Any, rows: int = 0, **_: Any) -> Any:
            if not ctx.in_window():
                return value
            if cap is not None and rows > cap or cap is None and ctx.take():
                ctx.fire(f"learner allocation for a micro-batch of {rows} rows failed (out of memory)",
                         {"rows": rows})
                raise torch.OutOfMemoryError(f"out of memory: tried to allocate activations for a micro-batch "
                                             f"of {rows} sequences (injected fault)")
            return value

        return arm("learner.alloc", handler)


class VerifierOptions(_Options):
    delay_s: float = Field(0.0, ge=0, description="Seconds the grader spends before failing.")


class _VerifierFault:
    error: type[Exception] = RuntimeError
    what = "grader crashed"

    def __init__(self, options: VerifierOptions | None = None) -> None:
        self.options = options or VerifierOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        attempts: dict[str, int] = {}
        hit: list[str] = [ctx.target] if ctx.target else []

        def handler(value: Any, trajectory: Any = None, grader: str = "", **_: Any) -> Any:
            if not hit:
                hit.append(grader)  # default target: the first reward component (the verifier)
            if trajectory is None or grader != hit[0] or not ctx.in_window():
                return value
            # a sample that arrives already failed is a retry even when its first call ran in another process
            # (a reward actor, then the driver's fresh grader): it must not draw its first attempt's coin again
            seen = attempts.get(trajectory.id, 1 if trajectory.reward_error is not None else 0)
            n = attempts[trajectory.id] = seen + 1
            if ctx.chance(f"{trajectory.id}/{n}"):
                ctx.num_fired += 1
                if self.options.delay_s:
                    time.sleep(self.options.delay_s)
                raise self.error(f"{self.what} on sample {trajectory.id} (attempt {n}, injected fault)")
            return value

        return arm("verifier.score", handler)


class VerifierTimeout(_VerifierFault):
    """The grader times out on a ``rate`` fraction of (sample, attempt) pairs."""

    error = TimeoutError
    what = "grader deadline exceeded"


class VerifierError(_VerifierFault):
    """The grader crashes on a ``rate`` fraction of (sample, attempt) pairs."""


class ToolOptions(_Options):
    delay_s: float = Field(0.0, ge=0, description="Seconds the tool spends before failing.")


class _ToolFault:
    error: type[Exception] = ToolError
    what = "tool crashed"

    def __init__(self, options: ToolOptions | None = None) -> None:
        self.options = options or ToolOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        attempts: dict[str, int] = {}
        lock = threading.Lock()  # environments call tools from a thread pool

        def handler(value: Any, tool: str = "", episode: str = "", **_: Any) -> Any:
            if ctx.target and tool != ctx.target or not ctx.in_window():
                return value
            with lock:
                n = attempts[episode] = attempts.get(episode, 0) + 1
                if not ctx.chance(f"{episode}/{n}"):
                    return value
                ctx.num_fired += 1
            if self.options.delay_s:
                time.sleep(self.options.delay_s)
            raise self.error(f"{self.what}: {tool} in episode {episode} (call {n}, injected fault)")

        return arm("tool.call", handler)


class ToolTimeout(_ToolFault):
    """A tool call times out on a ``rate`` fraction of (episode, attempt) pairs."""

    error = TimeoutError
    what = "tool deadline exceeded"


class ToolErrorFault(_ToolFault):
    """A tool call crashes (``ToolError``) on a ``rate`` fraction of (episode, attempt) pairs."""


class BadCheckpointOptions(_Options):
    file: str = Field("model/model.safetensors", description="File of the checkpoint to damage.")
    mode: Literal["truncate", "flip"] = Field("truncate", description="Cut the file in half, or flip one byte.")


class BadCheckpoint:
    """Damage the first checkpoint committed at or after ``at_step`` completed steps."""

    def __init__(self, options: BadCheckpointOptions | None = None) -> None:
        self.options = options or BadCheckpointOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        done = bool(ctx.fired_steps)

        def handler(value: Any, path: str = "", step: int = 0, **_: Any) -> Any:
            nonlocal done
            if done or step < ctx.at_step:
                return value
            done = True
            target = Path(path) / self.options.file
            data = target.read_bytes()
            ctx.fire(f"{self.options.mode} {self.options.file} of committed checkpoint {Path(path).name}",
                     {"checkpoint": path, "file": self.options.file, "checkpoint_step": step})
            if self.options.mode == "truncate":
                target.write_bytes(data[: len(data) // 2])
            else:
                middle = len(data) // 2
                target.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
            return value

        return arm("checkpoint.committed", handler)


class LearnerCrash:
    """SIGKILL the learner process in the middle of step ``at_step``."""

    def __init__(self, options: Any = None) -> None:
        pass

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        def handler(value: Any, **_: Any) -> Any:
            if ctx.take():
                ctx.fire("learner process SIGKILLed mid-step")
                os.kill(os.getpid(), signal.SIGKILL)
            return value

        return arm("learner.train_step", handler)


class SlowRolloutOptions(_Options):
    delay_s: float = Field(2.0, ge=0, description="Extra seconds the rollout call takes.")


class SlowRollout:
    """The rollout call of each faulted step takes ``delay_s`` longer (a straggler)."""

    site, role = "rollout.generate", "rollout"

    def __init__(self, options: SlowRolloutOptions | None = None) -> None:
        self.options = options or SlowRolloutOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        def handler(value: Any, **_: Any) -> Any:
            if ctx.take():
                ctx.fire(f"{self.role} straggles for {self.options.delay_s:g}s")
                time.sleep(self.options.delay_s)
            return value

        return arm(self.site, handler)


class SlowLearner(SlowRollout):
    """The learner's train step of each faulted step takes ``delay_s`` longer (a throttled or hung learner: what
    the watchdog must name as the learner, also when rollout threads or actors keep working meanwhile)."""

    site, role = "learner.train_step", "learner"


class WorkerCrashOptions(_Options):
    server: int = Field(0, ge=0, description="Index (in rollout.options.servers, or of the launched servers) of "
                        "the server to kill.")
    once: bool = Field(False, description="Kill a server once, at the first dispatch at or after at_step (count "
                       "is ignored). In the overlapped modes a rollout call starts while the learner's step "
                       "number may still be the previous one or already the next: a one-step window can miss.")


class WorkerCrash:
    """SIGKILL a rollout server (``sglang`` or ``vllm`` backend) or a Ray rollout actor's process at ``at_step``."""

    def __init__(self, options: WorkerCrashOptions | None = None) -> None:
        self.options = options or WorkerCrashOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        done, lock = [bool(ctx.fired_steps)], threading.Lock()

        def claim() -> bool:
            if not self.options.once:
                return ctx.take()
            with lock:  # several rollout workers may reach the site at once
                if done[0] or ctx.step() < ctx.at_step:
                    return False
                done[0] = True
                return True

        def handler(value: Any, clients: Any = (), pids: Any = (), **_: Any) -> Any:
            if self.options.server >= len(clients) or not (ctx.step() >= ctx.at_step if self.options.once
                                                           else ctx.due()):
                return value
            client = clients[self.options.server]
            if (ctx.target and client.url != ctx.target.rstrip("/")) or not claim():
                return value
            host = client.url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0]
            if host not in ("127.0.0.1", "localhost", "[::1]"):
                raise RuntimeError(f"worker-crash can only kill a rollout server on this host, not {client.url}")
            if pids:  # servers the backend launched itself know their pids (vllm)
                pid = pids[self.options.server]
            else:
                pid = (client.server_info().get("rlctl") or {}).get("pid")
            if not isinstance(pid, int):
                raise RuntimeError(f"{client.url} does not report its pid (worker-crash needs `rlctl serve "
                                   "rollout`, or servers the vllm backend launched)")
            ctx.fire(f"rollout server {client.url} (pid {pid}) SIGKILLed", {"server": client.url, "pid": pid})
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while client.healthy(timeout_s=1.0) and time.monotonic() < deadline:
                time.sleep(0.05)  # the kernel closes its socket when the process is gone
            return value

        def on_worker(value: Any, worker: Any = None, **_: Any) -> Any:
            pid_of = getattr(worker, "pid", None)  # Ray workers; in-process thread workers have no process
            if pid_of is None or (ctx.target and worker.name != ctx.target) or not ctx.take():
                return value
            pid = pid_of()
            ctx.fire(f"rollout worker {worker.name} (pid {pid}) SIGKILLed", {"worker": worker.name, "pid": pid})
            os.kill(pid, signal.SIGKILL)
            return value

        disarms = [arm("rollout.dispatch", handler), arm("rollout.worker", on_worker)]

        def disarm_all() -> None:
            for disarm in disarms:
                disarm()

        return disarm_all


class PartitionOptions(_Options):
    duration_s: float = Field(3.0, gt=0, description="Seconds the learner cannot reach the server(s).")
    mode: Literal["refused", "blackhole"] = Field("refused", description="Connections are refused, or accepted and "
                                                  "never answered (the client's timeout detects it).")


class NetworkPartition:
    """The learner cannot reach the rollout server(s) for ``duration_s`` from step ``at_step`` on."""

    def __init__(self, options: PartitionOptions | None = None) -> None:
        self.options = options or PartitionOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        state: dict[str, Any] = {"until": None, "sock": None, "url": None}
        lock = threading.Lock()

        def dead_end() -> str:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            if self.options.mode == "blackhole":
                sock.listen(64)  # the kernel completes the handshake; nobody ever reads or answers
                state["sock"] = sock
            else:
                sock.close()  # nothing listens on this port: connect() gets ECONNREFUSED
            return f"http://127.0.0.1:{port}"

        def heal() -> None:
            if state["sock"] is not None:
                state["sock"].close()
            state.update(sock=None, url=None)

        def handler(url: Any, server: str = "", **_: Any) -> Any:
            if ctx.target and server != ctx.target.rstrip("/"):
                return url
            with lock:
                now = time.monotonic()
                if state["until"] is None and ctx.due():
                    state["until"] = now + self.options.duration_s
                    state["url"] = dead_end()
                    ctx.fire(f"network partition: the learner cannot reach {ctx.target or 'any rollout server'} "
                             f"for {self.options.duration_s:g}s ({self.options.mode})",
                             {"duration_s": self.options.duration_s, "mode": self.options.mode})
                if state["until"] is not None and now < state["until"]:
                    return state["url"]
                if state["url"] is not None:
                    heal()
            return url

        disarm = arm("rollout.connect", handler)

        def disarm_all() -> None:
            disarm()
            with lock:
                heal()

        return disarm_all


class WeightSyncOptions(_Options):
    stage: Literal["apply", "publish"] = Field("apply", description="apply: flip a byte of the committed version "
                                               "(the server's checksum refuses it); publish: a shard write fails "
                                               "with ENOSPC.")


class WeightSyncFailure:
    """The weight publish of step ``at_step`` fails (once), at the write or at the servers' load."""

    def __init__(self, options: WeightSyncOptions | None = None) -> None:
        self.options = options or WeightSyncOptions()

    def arm(self, ctx: FaultContext) -> Callable[[], None]:
        def on_write(value: Any, path: str = "", **_: Any) -> Any:
            if ctx.due():
                ctx.fire(f"weight publish failed writing {Path(path).name} (no space left on device)",
                         {"stage": "publish", "file": path})
                raise OSError(errno.ENOSPC, "No space left on device (injected fault)", path)
            return value

        def on_published(value: Any, location: str = "", version: int = 0, **_: Any) -> Any:
            if not ctx.due():
                return value
            shard = sorted(p for p in Path(location).iterdir() if p.suffix in (".safetensors", ".rlst"))[0]
            data = shard.read_bytes()
            middle = len(data) // 2
            ctx.fire(f"flipped a byte of {shard.name} in published weight version {version} before the servers "
                     f"load it", {"stage": "apply", "file": str(shard), "version": version})
            shard.write_bytes(data[:middle] + bytes([data[middle] ^ 0xFF]) + data[middle + 1:])
            return value

        if self.options.stage == "publish":
            return arm("weights.write", on_write)
        return arm("weights.published", on_published)
