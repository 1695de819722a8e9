"""The FSDP2 learner: one policy sharded over a group of processes that rlctl starts itself.

What this is: a LearnerBackend whose rank 0 is the training process (it drives
the loop, the registry and the rollout) and whose ranks 1..N-1 are spawned
processes that follow its commands (LocalRanks); under ``cluster.backend=ray``
all N ranks are Ray actors instead (rlctl.placement.ray_ranks) and the training
process only commands them. Every rank loads the same policy, applies
``torch.distributed.fsdp.fully_shard`` to each decoder layer and then to the
root, and builds AdamW over its shards, so parameters, gradients and optimizer
state are split N ways. The update maths is the torch learner's own
(``_Rank`` subclasses ``TorchLearner``): PPO epochs x mini-batches x
micro-batch accumulation, gradient clipping by the global norm across shards,
the NaN/Inf skip. Every rank runs the same rows (the shards are of the model,
not of the batch), so the result equals the single-process learner's.

Commands travel to the followers over a multiprocessing queue, so a follower
may wait idle for any time while rank 0 generates rollouts; only collectives
have a deadline (``rank_timeout_s``). A rank that dies or fails is reported by
number as a RoleError, and the learner refuses further work rather than hang.

Weights for publishing are gathered to rank 0 (full state dict, on the CPU).
Precision: ``bfloat16`` gathers parameters in bf16 for compute while the fp32
shards are the master weights and AdamW moments stay fp32.

Checkpoints are sharded (ShardedCheckpointLearner): every rank writes its own
pieces of the fp32 weights and AdamW state with torch.distributed.checkpoint
into the checkpoint's ``shards/`` (layout: rlctl.engine.shards), the rest
(LR schedule, param groups, the mini-batch generator, counters) travels in the
checkpoint's JSON like the torch learner's. Loading reads whatever pieces this
rank's shards overlap, so a checkpoint saved by N ranks resumes on M.

What this is not: data parallel (every rank sees the whole batch).
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
from rlctl.contracts.types import LearnerContext, LearnerState
from rlctl.placement.ranks import free_port, init_group, rank_device
from rlctl.engine import shards, state_codec
from rlctl.models.device import resolve_device
from rlctl.models.fingerprint import fingerprint
from rlctl_fsdp_learner.options import FsdpLearnerOptions
from rlctl_torch_learner.learner import TorchLearner
from rlctl_torch_learner.options import TorchLearnerOptions

_POLL_S = 2.0  # how often an idle follower checks that rank 0 is still alive


class _Rank(TorchLearner):
    """One rank's share: the torch learner's update over an FSDP2-sharded model."""

    shrink_on_oom = False  # every rank must run the same collectives: an OOM fails the step, naming the rank

    def __init__(self, ctx: LearnerContext, options: FsdpLearnerOptions, rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        # fp32 weights on every rank: they become the master shards; bf16 is FSDP's compute dtype
        super().__init__(ctx, TorchLearnerOptions(dtype="float32", share_prompt_prefill=False,
                                                 gradient_checkpointing=options.gradient_checkpointing))
        if rank != 0:
            self.reference = None  # reference log-probs are computed by rank 0 alone
        kw: dict[str, Any] = {"mesh": init_device_mesh(self.device.type, (world,))}
        if options.dtype == "bfloat16":
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if options.cpu_offload:  # pinning needs CUDA; without it FSDP2 fails at the first shard
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        for layer in _decoder_layers(self.model):
            fully_shard(layer, **kw)
        fully_shard(self.model, **kw)
        self._build_optimizer()  # over the sharded parameters that replaced the loaded ones

    def _clip_grad_norm(self) -> float:
        from torch.distributed.tensor import DTensor

        norm = torch.nn.utils.clip_grad_norm_(self._trained(), self.optim_cfg.grad_clip)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The unsharded weights, on the CPU, on rank 0 (other ranks get {}); a collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def save_full(self, directory: str) -> None:
        state = self.full_state()
        if dist.get_rank() == 0:
            # gathered copies no longer share storage: drop tied aliases by name, as save_pretrained would
            own = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
            self.model.save_pretrained(directory, state_dict={k: v for k, v in state.items() if k in own})

    # -- sharded checkpoints (a collective: every rank runs these) ---------------------------------

    def _shard_tensors(self) -> tuple[dict[str, Any], list[Any]]:
        """This rank's ``model.*`` / ``optim.*`` tensors (DTensors over the group) and the optimizer's param groups."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        model = get_model_state_dict(self.model)
        optim = get_optimizer_state_dict(self.model, self.optimizer)  # creates empty AdamW state if none yet
        seen: set[int] = set()
        out: dict[str, Any] = {}
        for name, tensor in model.items():  # tied aliases (lm_head sharing the embedding) once, as HF saves them
            ptr = _local(tensor).data_ptr()
            if ptr not in seen or _local(tensor).numel() == 0:
                seen.add(ptr)
                out[shards.MODEL + name] = tensor
        for name, st in optim["state"].items():
            for key, tensor in st.items():
                out[f"{shards.OPTIM}{name}.{key}"] = tensor
        return out, optim["param_groups"]

    def save_shards(self, directory: str) -> LearnerState:
        tensors, groups = self._shard_tensors()
        shards.dcp_save(tensors, directory)
        return sharded_state(self, directory, groups)

    def load_shards(self, state: LearnerState) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        tensors, _ = self._shard_tensors()
        check_same_model(tensors, state.shard_dir)
        shards.dcp_read(tensors, state.shard_dir)  # each rank reads the pieces its shards overlap
        model = {k[len(shards.MODEL):]: v for k, v in tensors.items() if k.startswith(shards.MODEL)}
        set_model_state_dict(self.model, model, options=_non_strict())
        per_param: dict[str, dict[str, Any]] = {}
        for key, tensor in tensors.items():
            if key.startswith(shards.OPTIM):
                name, field = key[len(shards.OPTIM):].rsplit(".", 1)
                per_param.setdefault(name, {})[field] = tensor
        set_optimizer_state_dict(self.model, self.optimizer,
                                 {"state": per_param, "param_groups": state.optimizer["param_groups"]})
        self._restore_progress(state)


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


def _non_strict() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(strict=False)  # tied aliases were saved once


def _decoder_layers(model: Any) -> list[Any]:
    """The repeated blocks FSDP shards one by one (Hugging Face decoders keep them at model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError(f"the FSDP2 learner cannot find the decoder layers of {type(model).__name__} "
                          "(expected model.model.layers)", "use train.learner: torch for this model")
    return list(layers)


def _local(t: Any) -> Any:
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
        return {k: [_local(t) for t in v] for k, v in self.rank0.resident_tensors().items()}

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

    ``make_rank`` (a picklable class or function taking ``(ctx, options,
    rank, world)``) builds each rank's learner; FsdpLearner's is the FSDP2
    rank, rlctl_deepspeed_learner's a DeepSpeed ZeRO rank. Where the ranks
    run is the context's ``rank_launcher``: none starts them here
    (LocalRanks); under ``cluster.backend=ray`` they are Ray actors
    (rlctl.placement.ray_ranks.RayRanks), and this process holds no shard.
    """

    make_rank: Any = _Rank
    label = "FSDP2"

    def __init__(self, ctx: LearnerContext, options: Any = None) -> None:
        self.options = options or FsdpLearnerOptions()
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


class FsdpLearner(ShardedCheckpoints, RankGroup):
    """The FSDP2 learner: a RankGroup of FSDP2 ranks, with sharded checkpoints (ShardedCheckpointLearner)."""
