"""Rollout workers as child processes of the local placement: overlap that a shared GIL cannot give.

What this is: ``ProcessWorker``, a RolloutWorker (rlctl.engine.producers)
whose backend lives in a spawned child process, and ``use_processes``, the
rule that picks processes over threads (``cluster.rollout_workers``). A
Python-bound engine (the built-in local engine on a small model) holds the
GIL for most of a decode step, so producer threads and the learner take
turns instead of overlapping; a child process has its own interpreter.

The child builds its backend from the run's rollout config section and the
worker's RolloutContext (as a Ray rollout actor does: a role is built where it
lives) and serves calls one at a time over a pipe: ``generate``, ``stream``
(continuous rollout: groups sent back as they end, prompts asked for without
waiting while it decodes, weights received mid-call), ``update_weights``
(the state dict is pickled through the pipe: a copy, but no shared-memory
segment, which a container's 64 MB /dev/shm would cap),
``use_run_dir``. The driver side waits
for an answer while watching the child: a child that exits (SIGKILL, OOM
killer, a crash in native code) is ``WorkerLost`` and ``restart`` spawns a
new one, as for a thread worker whose engine died. Errors the backend raises
come back as themselves (one that cannot be pickled: a RuntimeError naming it
and the child's last frames).

What this is not: a fault arbiter. Injected faults live in the driver's
process; a run that injects faults (``faults.inject``) gets thread workers
under ``rollout_workers: auto``, and ``processes`` with faults is refused when
the placement is built (rlctl.placement.local). A fault injected into the
running run (``rlctl inject --run``) that arms a site inside the rollout
backend is refused by ``refuse_worker_sites`` (the run records
``fault_refused`` and goes on); learner and grader faults arm in the driver as
usual. Ray actors (rlctl.placement.ray_*) are the placement for faults across
processes.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any, Sequence

from rlctl.contracts.errors import RoleError, RolloutUnavailable, WorkerLost
from rlctl.contracts.types import RolloutContext, RolloutRequest, Trajectory, WeightUpdate

# Backends whose generate is Python-bound on CPU (worth a process); HTTP engines wait on sockets (threads do).
CPU_BOUND_BACKENDS = frozenset({"local"})
START_TIMEOUT_S = 300.0  # importing torch and building a model in a fresh interpreter on a busy core


# Fault sites inside a rollout backend (the engine, its environment's tools, a server's weight load): in a child.
WORKER_SITES = ("rollout.", "tool.", "weights.published")


def refuse_worker_sites(fault: Any, ctx: Any) -> None:
    """on_publish listener of a placement with worker processes: a fault armed at a backend site cannot fire."""
    inside = [site for site in fault.sites if site.startswith(WORKER_SITES)]
    if inside:
        raise RoleError(f"fault {fault.kind} arms {', '.join(inside)}, which runs in this run's rollout worker "
                        "processes (cluster.rollout_workers), out of the injector's reach",
                        "start the run with cluster.rollout_workers=threads (or faults.inject set) to inject "
                        "rollout faults into it, or use cluster.backend=ray")


def use_processes(config: Any) -> bool:
    """Whether an overlapped local run's rollout workers are processes (``cluster.rollout_workers``)."""
    choice = config.cluster.rollout_workers
    if choice != "auto":
        return choice == "processes"
    return config.rollout.backend in CPU_BOUND_BACKENDS and not config.faults.inject


class ProcessWorker:
    """A rollout backend in a child process, called by one producer thread at a time (see the module docstring)."""

    def __init__(self, name: str, rollout: Any, ctx: RolloutContext, retries: int, threads: int = 1,
                 wait: bool = True) -> None:
        """Start the child; with ``wait`` (default) return once its backend is built (``ready`` otherwise)."""
        self.name = name
        self._args = (rollout, ctx, retries, threads)
        self._run_dir: str | None = None
        self._process: Any = None
        self._conn: Any = None
        self._spawn(wait)

    def _spawn(self, wait: bool = True) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # fork would copy the driver's threads and locks mid-use
        parent, child = context.Pipe()
        process = context.Process(target=_serve, args=(child, *self._args), name=f"rlctl-rollout-{self.name}",
                                  daemon=True)
        process.start()
        child.close()
        self._process, self._conn, self._ready = process, parent, False
        if wait:
            self.ready()

    def ready(self) -> None:
        """Wait until the child has built its backend; raise what stopped it (a bad model dir, a missing plugin)."""
        if self._ready:
            return
        self._call("ready", timeout=START_TIMEOUT_S)
        self._ready = True
        if self._run_dir is not None:
            self._call("use_run_dir", self._run_dir)

    def _call(self, method: str, *args: Any, timeout: float | None = None,
              on_message: Any = None) -> Any:
        """Send one call and wait for its answer, watching the child; a dead child is WorkerLost. Messages the
        child sends before its answer (a stream's groups and questions) go to ``on_message(status, value)``."""
        if self._process is None:
            raise WorkerLost(f"rollout worker {self.name} is closed")
        if method != "ready" and not self._ready:
            self.ready()
        try:
            if method != "ready":
                _send(self._conn, (method, args))
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                while not self._conn.poll(0.2):
                    if not self._process.is_alive():
                        raise self._lost()
                    if deadline is not None and time.monotonic() > deadline:
                        raise WorkerLost(f"rollout worker process {self.name} did not answer {method} within "
                                         f"{timeout:.0f}s")
                status, value = _recv(self._conn)
                if status in ("ok", "error"):
                    break
                on_message(status, value)
        except (EOFError, OSError) as err:  # the pipe broke: the child is gone (or going)
            raise self._lost(err) from None
        if status == "ok":
            return value
        raise value

    def _lost(self, err: BaseException | None = None) -> WorkerLost:
        self._process.join(timeout=5)  # a pipe breaks a moment before the exit code is there
        code = self._process.exitcode
        how = f"exited with code {code}" if code is not None else f"broke its pipe ({type(err).__name__})"
        return WorkerLost(f"rollout worker process {self.name} (pid {self._process.pid}) {how}")

    def generate(self, requests: Sequence[RolloutRequest]) -> list[Trajectory]:
        try:
            return self._call("generate", list(requests))
        except (RuntimeError, OSError, RolloutUnavailable) as err:  # as LocalWorker: rebuild, regenerate
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def stream(self, requests: Sequence[RolloutRequest], on_group: Any, more: Any = None) -> None:
        """Continuous generation in the child (rlctl.engine.producers.stream_backend): its groups come back as
        they end and its requests for more prompts are answered here, on the calling thread."""
        def on_message(status: str, value: Any) -> None:
            if status == "group":
                on_group(*value)
            elif status == "more":
                _send(self._conn, ("more", None if more is None else more(*value)))

        try:
            self._call("stream", list(requests), more is not None, on_message=on_message)
        except (RuntimeError, OSError, RolloutUnavailable) as err:
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def load_weights(self, update: WeightUpdate) -> None:
        try:
            self._call("update_weights", update)
        except RolloutUnavailable as err:
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def restart(self) -> None:
        """A new child with a new backend (the run's initial model; the producer loads current weights next)."""
        self._stop_child()
        try:
            self._spawn()
        except RolloutUnavailable as err:
            raise WorkerLost(f"{type(err).__name__}: {err}") from err

    def use_run_dir(self, run_dir: str) -> None:
        self._run_dir = run_dir
        if self._ready:  # else ready() hands it over
            self._call("use_run_dir", run_dir)

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        self._stop_child()
        self._process = None

    def _stop_child(self) -> None:
        process, conn = self._process, self._conn
        if process is None:
            return
        try:
            if process.is_alive():
                _send(conn, ("close", ()))
                process.join(timeout=10)
        except (OSError, EOFError, BrokenPipeError):
            pass
        if process.is_alive():
            process.kill()
            process.join(timeout=10)
        conn.close()


def _serve(conn: Any, rollout: Any, ctx: RolloutContext, retries: int, threads: int) -> None:
    """The child: build the backend, answer ("ok", value) or ("error", exception) per call until "close"."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)
    from rlctl.contracts.roles import RunDirAware
    from rlctl.engine.episodes import build_rollout
    from rlctl.hooks.manager import load_plugins

    try:
        backend = build_rollout(load_plugins(), rollout, ctx, retries=retries)
    except BaseException as err:  # noqa: BLE001 - sent to the driver, which raises it there
        _send(conn, ("error", _portable(err)))
        return
    _send(conn, ("ok", None))
    try:
        while True:
            try:
                method, args = _recv(conn)
            except EOFError:  # the driver is gone
                return
            if method == "close":
                return
            try:
                if method == "generate":
                    value: Any = backend.generate(*args)
                elif method == "stream":
                    value = _stream(conn, backend, *args)
                elif method == "update_weights":
                    value = backend.update_weights(*args)
                elif method == "use_run_dir":
                    value = backend.use_run_dir(*args) if isinstance(backend, RunDirAware) else None
                else:
                    raise RoleError(f"rollout worker process got an unknown call {method!r}",
                                    "this is a bug in rlctl: report it")
            except Exception as err:  # noqa: BLE001 - the driver raises it where the call was made
                _send(conn, ("error", _portable(err)))
                continue
            _send(conn, ("ok", value))
    finally:
        backend.close()


def _stream(conn: Any, backend: Any, requests: list[RolloutRequest], asks: bool) -> None:
    """The child's side of ``stream``: groups sent as they end; ``more`` asked of the driver over the pipe without
    waiting for the answer while rows decode (the driver's thread may wait its turn for the GIL: the decode would
    stall on every question); the answer is taken at a later question, or waited for when nothing is left to do."""
    from rlctl.engine.producers import stream_backend

    asked = False

    def more(free: int, idle: bool) -> Any:
        nonlocal asked
        if not asked:
            _send(conn, ("more", (free, idle)))
            asked = True
        if not idle and not conn.poll(0):
            return []  # not here yet: the engine asks again once more slots are free
        status, value = _recv(conn)
        asked = False
        if status == "close":  # the driver is closing this worker mid-stream
            raise SystemExit(0)
        if status != "more":
            raise RoleError(f"rollout worker process got {status!r} while waiting for prompts",
                            "this is a bug in rlctl: report it")
        return value

    stream_backend(backend, requests, lambda k, group: _send(conn, ("group", (k, group))), more if asks else None)


def _send(conn: Any, obj: Any) -> None:
    """Plain pickle (tensors as bytes), not multiprocessing's, which would move tensors through /dev/shm."""
    import pickle

    conn.send_bytes(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: Any) -> Any:
    import pickle

    return pickle.loads(conn.recv_bytes())


def _portable(err: BaseException) -> BaseException:
    """``err`` if it pickles (with the child's traceback appended to its message), else a RuntimeError saying it."""
    import pickle

    where = "".join(traceback.format_exception(type(err), err, err.__traceback__)[-3:]).strip()
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any unpicklable error becomes a plain one
        return RuntimeError(f"{type(err).__name__}: {err} (in the rollout worker process: {where})")
    err.__traceback__ = None
    return err
