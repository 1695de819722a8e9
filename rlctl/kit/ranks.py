"""Rank plumbing of a sharded learner: N processes, each holding a shard, driven as one LearnerBackend.

What this is: ``RankGroup``, the LearnerBackend over a sharded learner's
ranks (every rank holds a shard and runs every update; rank 0's answer comes
back), and ``LocalRanks``, its ranks on this node torchrun-style: rank 0 is
the training process (it drives the loop, the registry and the rollout),
ranks 1..N-1 are spawned processes that follow its commands. Under
``cluster.backend=ray`` the context's ``rank_launcher`` puts all N ranks in Ray
actors instead (rlctl.placement.ray_ranks.RayRanks) and the training process only
commands them. A plugin supplies ``make_rank`` (each rank's learner, usually
a TorchLearner subclass over a sharded model) and a ``label``; the FSDP2 and
DeepSpeed learners are two such plugins.

Commands travel to the followers over a multiprocessing queue, so a follower
may wait idle for any time while rank 0 generates rollouts; only collectives
have a deadline (``rank_timeout_s`` of the options). A rank that dies or fails
is reported by number as a RoleError, and the group refuses further work
rather than hang.

Sharded checkpoints (``ShardedCheckpoints``: the ShardedCheckpointLearner
methods of a RankGroup whose ranks have ``save_shards`` / ``load_shards``):
every rank writes its pieces of the weights and optimizer state into the
checkpoint's ``shards/`` (layout: rlctl.kit.shards) and returns
``sharded_state`` (everything else, as plain data); ``check_same_model``
refuses shards of another model before anything is read.

What this is not: the sharding itself (FSDP2, ZeRO: the plugins) or data
parallel (every rank sees the whole batch).
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import traceback
from dataclasses import replace
from typing import Any, Mapping

import torch
import torch.distributed as dist

from rlctl import CheckpointError, ConfigError, RoleError, WeightUpdate
from rlctl.contracts.batch import TrainBatch
from rlctl.contracts.types import LearnerContext
from rlctl.contracts.checkpoints import LearnerState
from rlctl.placement.ranks import free_port, init_group, rank_device
from rlctl.engine import shards, state_codec
from rlctl.kit.torch_learner import TorchLearner
from rlctl.models.device import resolve_device
from rlctl.models.fingerprint import fingerprint

_POLL_S = 2.0  # how often an idle follower checks that rank 0 is still alive


def sharded_state(rank: TorchLearner, directory: str, param_groups: list[Any]) -> LearnerState:
    """Everything of a rank's learner state but its tensors (those are in ``directory``'s shards).

    ``param_groups`` are the optimizer's hyperparameters per group (lr, betas,
    ...) as plain data; the rest is the torch learner's progress
    (``_restore_progress`` reads it back) and the world size it was saved on.
    """
    return LearnerState(
        policy_version=rank.policy_version, weights={}, model_files=rank._model_files(),
        optimizer={"param_groups": state_codec.clone(param_groups)},
        scheduler=state_codec.clone(rank.scheduler.state_dict()), grad_scaler=None,
        rng={"minibatch_order": rank.generator.get_state()},
        counters={**rank._counters(), "world_size": dist.get_world_size()},
        shard_dir=directory)


def check_same_model(tensors: Mapping[str, Any], shard_dir: str) -> None:
    """CheckpointError unless the shards in ``shard_dir`` hold every key of ``tensors`` with the same full shape."""
    saved = shards.shapes(shard_dir)
    problems = [f"{k} is missing" for k in sorted(set(tensors) - set(saved))]
    problems += [f"{k} is unexpected" for k in sorted(set(saved) - set(tensors)) if k.startswith(shards.MODEL)]
    problems += [f"{k} is {list(saved[k][0])} in the checkpoint but {list(v.shape)} now"
                 for k, v in tensors.items() if k in saved and tuple(saved[k][0]) != tuple(v.shape)]
    if problems:
        raise CheckpointError(f"the model shape changed since the checkpoint: {'; '.join(problems[:3])}"
                              + (f" and {len(problems) - 3} more" if len(problems) > 3 else ""),
                              "resume with the model the run was trained with")


def local_shard(t: Any) -> Any:
    """The part of ``t`` this rank holds: a DTensor's local shard, any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _follow(make_rank: Any, rank: int, world: int, port: int, ctx: LearnerContext, options: Any,
            device: torch.device, commands: Any, errors: Any) -> None:
    """A follower rank: join the group, build its shard, then run rank 0's commands until told to stop."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    parent = os.getppid()
    try:
        init_group(device, "127.0.0.1", port, rank, world, options.rank_timeout_s)
        me = make_rank(replace(ctx, device=rank_device(device, rank)), options, rank, world)
        while True:
            try:
                name, args = pickle.loads(commands.get(timeout=_POLL_S))
            except queue.Empty:
                if os.getppid() != parent:  # rank 0 is gone: nobody will ever send another command
                    return
                continue
            if name == "close":
                break
            getattr(me, name)(*args)
        dist.destroy_process_group()
    except BaseException as err:  # report, then exit non-zero: rank 0 names this rank
        errors.put((rank, f"{type(err).__name__}: {err}", traceback.format_exc(limit=8)))
        raise SystemExit(1) from None


class LocalRanks:
    """A sharded learner's ranks on this node, torchrun-style: rank 0 in this process, ranks 1..N-1 spawned
    processes that run rank 0's commands (sent over queues, so a follower may idle for any time)."""

    remote = False

    def __init__(self, make_rank: Any, label: str, ctx: LearnerContext, options: Any) -> None:
        self.label, self.options, self.world = label, options, options.world_size
        device = resolve_device(ctx.device, "train.device")
        if device.type == "cuda" and torch.cuda.device_count() < self.world:
            raise ConfigError(f"train.learner_options.world_size is {self.world} but only "
                              f"{torch.cuda.device_count()} CUDA device(s) are visible",
                              "lower world_size to the number of GPUs on this node, or run the ranks as Ray actors "
                              "across nodes (cluster.backend=ray)")
        if dist.is_initialized():
            raise RoleError("this process already belongs to a torch.distributed group",
                            f"run one {label} learner per process (close the previous one first)")
        mp = torch.multiprocessing.get_context("spawn")
        port = free_port()
        self._errors = mp.Queue()
        self._commands = [mp.Queue() for _ in range(1, self.world)]
        self.procs = [mp.Process(target=_follow, name=f"rlctl-{label.lower()}-rank{r}", daemon=True,
                                 args=(make_rank, r, self.world, port, ctx, options, device, self._commands[r - 1],
                                       self._errors))
                      for r in range(1, self.world)]
        self._broken: str | None = None
        for p in self.procs:
            p.start()
        try:
            init_group(device, "127.0.0.1", port, 0, self.world, options.rank_timeout_s)
            self.rank0 = make_rank(replace(ctx, device=rank_device(device, 0)), options, 0, self.world)
        except Exception as err:
            self._fail("start-up", err)
        self.device = self.rank0.device

    def run(self, name: str, *args: Any) -> Any:
        """Run ``name`` on every rank (the followers get it first); rank 0's result."""
        if self._broken:
            raise RoleError(f"the {self.label} learner group is down ({self._broken})", "restart or resume the run")
        message = pickle.dumps((name, args))  # a copy, taken now: rank 0 goes on using the same tensors
        for q in self._commands:
            q.put(message)
        try:
            return getattr(self.rank0, name)(*args)
        except Exception as err:
            self._fail(name, err)

    def call0(self, name: str, *args: Any) -> Any:
        """Run ``name`` on rank 0 alone (no collective: e.g. the unsharded reference's log-probs)."""
        return getattr(self.rank0, name)(*args)

    def get0(self, name: str) -> Any:
        return getattr(self.rank0, name)

    def export(self) -> WeightUpdate:
        state = self.run("full_state")
        return WeightUpdate(version=self.rank0.policy_version, state_dict=state, fingerprint=fingerprint(state))

    def resident_tensors(self) -> Mapping[str, list[torch.Tensor]]:
        """Rank 0's own shards (what this process holds), by ledger term."""
        return {k: [local_shard(t) for t in v] for k, v in self.rank0.resident_tensors().items()}

    def _fail(self, what: str, err: BaseException) -> None:
        """Name the rank that failed, stop the group and raise; never leave anyone waiting."""
        for p in self.procs:
            p.join(timeout=5.0 if p.is_alive() else 0)
        reports = []
        while True:
            try:
                reports.append(self._errors.get(timeout=0.5))
            except queue.Empty:
                break
        dead = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if isinstance(err, CheckpointError):  # rank 0's verdict on the checkpoint's files (every rank reads the same)
            reason = None
        elif reports:
            rank, message, _ = min(reports)
            reason = f"learner rank {rank} failed during {what}: {message}"
        elif dead:
            rank, code = dead[0]
            reason = f"learner rank {rank} died during {what} (exit code {code})"
        elif isinstance(err, RoleError | ConfigError):
            reason = None
        else:
            reason = (f"learner rank 0 failed during {what} or another rank did not answer within "
                      f"{self.options.rank_timeout_s:g}s: {type(err).__name__}: {err}")
        self._broken = reason or str(err)
        self._stop(terminate=True)
        if reason is None:
            raise err
        raise RoleError(reason, "see that rank's error above; a killed rank (out of memory?) fails the run, which "
                        "`rlctl resume` continues from its last checkpoint") from err

    def _stop(self, terminate: bool) -> None:
        for q, p in zip(self._commands, self.procs):
            if p.is_alive() and not terminate:
                q.put(pickle.dumps(("close", ())))
        for p in self.procs:
            p.join(timeout=0 if terminate else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()

    def close(self) -> None:
        """Stop the followers and leave the process group (idempotent)."""
        if not self._broken:
            self._broken = "closed"
            self._stop(terminate=False)

    def __del__(self) -> None:  # the run ended without close(): do not leave ranks behind
        try:
            if getattr(self, "_broken", "x") is None:
                self.close()
        except Exception:
            pass


class RankGroup:
    """LearnerBackend over a sharded learner's ranks; every rank holds a shard and runs every update.

    A subclass sets ``make_rank`` (a picklable class or function taking
    ``(ctx, options, rank, world)``: the fsdp2 plugin's FSDP2 rank, the
    deepspeed plugin's ZeRO rank) and ``label`` (named in errors), and passes
    its options (``world_size``, ``rank_timeout_s``). A rank is a TorchLearner
    (or offers the same verbs) plus ``full_state()`` (the unsharded weights on
    rank 0, a collective) and ``save_full(directory)``. Where the ranks run is
    the context's ``rank_launcher``: none starts them here (LocalRanks); under
    ``cluster.backend=ray`` they are Ray actors (rlctl.placement.ray_ranks.RayRanks),
    and this process holds no shard.
    """

    make_rank: Any  # set by the subclass
    label: str  # set by the subclass

    def __init__(self, ctx: LearnerContext, options: Any) -> None:
        self.options = options
        self.world = self.options.world_size
        launch = ctx.rank_launcher or LocalRanks
        self.ranks = launch(type(self).make_rank, self.label, replace(ctx, rank_launcher=None), self.options)
        self.device = self.ranks.device
        self._reference = bool(self.ranks.get0("has_reference"))  # rank 0 holds the unsharded reference model
        atexit.register(self.close)  # the learner contract has no close: leave the group when the run's process exits

    def _run(self, name: str, *args: Any) -> Any:
        return self.ranks.run(name, *args)

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        self.ranks.close()

    def accept_initial_state(self) -> None:
        """Let restarted ranks serve from their initial state (recovery found no checkpoint yet)."""
        accept = getattr(self.ranks, "accept_initial_state", None)
        if accept is not None:
            accept()

    # -- LearnerBackend -------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        return self.ranks.get0("policy_version")

    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return self._run("logprobs", batch)

    def ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        return self.ranks.call0("ref_logprobs", batch)  # the unsharded reference lives on rank 0 only

    def _with_reference(self, batch: TrainBatch) -> TrainBatch:
        if self._reference and batch.ref_logprobs is None:
            batch = replace(batch, ref_logprobs=self.ref_logprobs(batch))
        return batch

    def train_step(self, batch: TrainBatch) -> Mapping[str, float]:
        return self._run("train_step", self._with_reference(batch))

    def train_step_with_logprobs(self, batch: TrainBatch) -> tuple[Mapping[str, float], torch.Tensor]:
        """The update and log pi before it from one pass over the batch (see the torch learner's)."""
        return self._run("train_step_with_logprobs", self._with_reference(batch))

    def export_weights(self) -> WeightUpdate:
        return self.ranks.export()

    def save_pretrained(self, directory: str) -> None:
        self._run("save_full", directory)

    def resident_tensors(self) -> Mapping[str, list[torch.Tensor]]:
        """This process's own shards by ledger term (none when the ranks are Ray actors)."""
        return self.ranks.resident_tensors()


class ShardedCheckpoints:
    """ShardedCheckpointLearner for a RankGroup whose ranks have ``save_shards`` / ``load_shards``."""

    _run: Any

    def save_shards(self, directory: str) -> LearnerState:
        """Every rank writes its shard of weights and AdamW state into ``directory``; the rest of the state."""
        return self._run("save_shards", directory)

    def load_shards(self, state: LearnerState) -> None:
        """Every rank reads its (possibly resharded) pieces from ``state.shard_dir``; the rest from ``state``."""
        self._run("load_shards", state)


