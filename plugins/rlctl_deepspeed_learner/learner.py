"""The DeepSpeed learner: one policy under ZeRO-1/2/3 over a group of processes that rlctl starts itself.

What this is: a LearnerBackend driven like the FSDP2 learner (rank 0 is the
training process, ranks 1..N-1 are spawned followers running its commands, a
dead rank is a RoleError naming it; the group machinery is
rlctl.kit.RankGroup). Each rank loads the policy in fp32, builds the torch
learner's AdamW over it (a client optimizer: no fused-Adam JIT) and hands both
to ``deepspeed.initialize`` with ZeRO stage 1, 2 or 3. The update maths is the
torch learner's (``_Rank`` subclasses ``TorchLearner``): PPO epochs x
mini-batches x micro-batch accumulation, each micro-batch's backward through
the engine with the accumulation boundary on the last one, DeepSpeed's
gradient clipping by the global norm across shards, and DeepSpeed's skip of a
step whose gradient norm is not finite (counted like the torch learner's).
Every rank runs the same rows, so the result equals the single-process
learner's.

Weights for publishing and ``save_pretrained``: under ZeRO-3 the parameters
are gathered (``deepspeed.zero.GatheredParameters``) and rank 0 copies them to
the CPU. Precision: ``bfloat16`` enables DeepSpeed's bf16 mode (bf16
parameters for compute, fp32 master weights and fp32 AdamW moments in the
ZeRO optimizer).

On CPU DeepSpeed picks its CPU accelerator and gloo. Its first process-group
init JIT-compiles a small shared-memory op (about 40 s on 2 cores); the build
is cached in ``TORCH_EXTENSIONS_DIR`` (default here: ``$RLCTL_HOME/cache/torch_extensions``).

Checkpoints are sharded and use the FSDP2 learner's layout (rlctl.kit.shards),
not DeepSpeed's own files: for each parameter the ranks assemble the full fp32
master weight and AdamW moments from their ZeRO partitions (DeepSpeed's
``safe_get_full_*``, one parameter at a time) and keep only their row block
of it (a DTensor sharded on dim 0 over the group), which
torch.distributed.checkpoint writes as one safetensors file per rank. Loading
reads the row blocks this rank's mesh position covers, whatever world size
wrote them, gathers each parameter and hands it to DeepSpeed's
``safe_set_full_*``, which keeps this rank's ZeRO partition. So a checkpoint
resumes on any number of ranks and any ZeRO stage (and FSDP2 and DeepSpeed
checkpoints are interchangeable), and ``rlctl export --hf`` consolidates it
unchanged. The LR schedule, optimizer hyperparameters, mini-batch generator
and counters travel in the checkpoint's JSON like the FSDP2 learner's.

What this is not: DeepSpeed's ``engine.save_checkpoint`` format (pickled,
tied to the world size it was saved on) or data parallel.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Mapping

import torch

from rlctl import CheckpointError
from rlctl.contracts.types import LearnerContext
from rlctl.contracts.checkpoints import LearnerState
from rlctl.kit import (
    RankGroup, ShardedCheckpoints, TorchLearner, TorchLearnerOptions, check_same_model, sharded_state, shards,
)
from rlctl_deepspeed_learner.options import DeepSpeedLearnerOptions


def _quiet_environment() -> None:
    """Cache DeepSpeed's JIT ops inside rlctl's home, pick the CPU accelerator without CUDA, and keep logs short."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ:
        home = os.path.expanduser(os.environ.get("RLCTL_HOME") or "~/.rlctl")
        os.environ["TORCH_EXTENSIONS_DIR"] = os.path.join(home, "cache", "torch_extensions")
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _forget_previous_groups() -> None:
    """Drop DeepSpeed's module-level state (process groups, ZeRO-3 parameter ids) from an earlier learner here.

    DeepSpeed keeps the world / data-parallel groups it derived in globals; after
    that learner's group was destroyed they name a dead group, and a second
    learner in the same process (a restart, a test) would fail with "Group ...
    is not registered". Nothing else in the process uses them.
    """
    from deepspeed.utils import groups

    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP", "_MODEL_PARALLEL_GROUP",
                 "_TENSOR_MODEL_PARALLEL_GROUP", "mpu", "mesh_device"):
        if hasattr(groups, name):
            setattr(groups, name, None)
    for name in ("_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
                 "_EXPERT_DATA_PARALLEL_GROUP_RANKS", "_ALL_TO_ALL_GROUP"):
        if isinstance(getattr(groups, name, None), dict):
            getattr(groups, name).clear()
    # ZeRO-3 numbers parameters and modules with process-wide counters (the module one is a mutable default
    # argument) and the ranks compare those numbers (its prefetch trace): a second learner here would count on
    # from the first while freshly spawned followers start at 0
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partition_parameters import Init

    Init.param_id = Init.num_persisted_parameters = Init.num_persisted_elements = 0
    DeepSpeedZeRoOffload._register_deepspeed_module.__defaults__[0][0] = 0


class _Rank(TorchLearner):
    """One rank's share: the torch learner's update through a DeepSpeed ZeRO engine."""

    shrink_on_oom = False  # every rank must run the same collectives: an OOM fails the step, naming the rank

    def __init__(self, ctx: LearnerContext, options: DeepSpeedLearnerOptions, rank: int, world: int) -> None:
        _quiet_environment()
        import logging

        import deepspeed

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
        # DeepSpeed reads the launcher's variables (LOCAL_RANK picks its CUDA device: a Ray actor sees only its own
        # GPU, cuda:0); the group itself is already up (joined by LocalRanks or the Ray rank actor)
        local = torch.device(ctx.device).index if ctx.device.startswith("cuda") else rank
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(local or 0), WORLD_SIZE=str(world))
        _forget_previous_groups()
        super().__init__(ctx, TorchLearnerOptions(dtype="float32", share_prompt_prefill=False,
                                                  gradient_checkpointing=options.gradient_checkpointing))
        if rank != 0:
            self.reference = None  # reference log-probs are computed by rank 0 alone
        self.stage = options.zero_stage
        config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": options.zero_stage},
            "gradient_clipping": float(ctx.optim.grad_clip),
            "zero_allow_untested_optimizer": True,  # the torch AdamW, so no fused-op JIT on CPU
            "bf16": {"enabled": options.dtype == "bfloat16"},
            "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False,
        }
        # DeepSpeed prints its op builds to stdout; rlctl's stdout is the --json report, so send them to stderr
        with contextlib.redirect_stdout(sys.stderr):
            self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=self.optimizer, config=config,
                                                   dist_init_required=False)
        self.model = self.engine.module

    # the engine owns the forward (ZeRO-3 counts micro-steps there), gradient reduction, clipping and the step
    def _forward(self, model: Any, batch: Any, with_entropy: bool = False):
        return super()._forward(self.engine if model is self.model else model, batch, with_entropy)

    def _backward(self, loss: torch.Tensor, last: bool) -> None:
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss)

    def _mini_batch_step(self, mini: Any, kl_in_loss: bool, first: bool, stats: dict[str, list[float]]) -> bool:
        attempt: dict[str, list[float]] = {}
        self._accumulate(mini, kl_in_loss, first, attempt)
        for key, values in attempt.items():
            stats.setdefault(key, []).extend(values)
        self.engine.step()  # clips by the global norm across shards; skips (no change) when it is not finite
        norm = self.engine.get_global_grad_norm()
        grad_norm = float("nan") if norm is None else float(norm)
        stats.setdefault("grad_norm", []).append(grad_norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.nan_skips += 1
            return False
        self.scheduler.step()
        return True

    def _trained(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def _gathered(self):
        import deepspeed

        if self.stage != 3:
            return contextlib.nullcontext()
        return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The full fp32-or-bf16 weights on the CPU, gathered under ZeRO-3 (a collective); every rank returns them."""
        with self._gathered():
            return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save_full(self, directory: str) -> None:
        import torch.distributed as dist

        state = self.full_state()
        if dist.get_rank() == 0:
            own = {n for n, _ in self.model.named_parameters()} | {n for n, _ in self.model.named_buffers()}
            self.model.save_pretrained(directory, state_dict={k: v for k, v in state.items() if k in own})

    # -- sharded checkpoints (a collective: every rank runs these) ---------------------------------

    def _zero(self) -> Any:
        """DeepSpeed's ZeRO optimizer (wrapping the client AdamW)."""
        return self.engine.optimizer

    def _flat_masters(self) -> list[torch.Tensor]:
        """This rank's flat fp32 master partitions: the tensors the client AdamW steps (and keys its state by)."""
        zero = self._zero()
        flat = getattr(zero, "fp32_partitioned_groups_flat", None)  # ZeRO-3
        return list(flat if flat is not None else zero.single_partition_of_fp32_groups)  # ZeRO-1/2

    def _ensure_optimizer_state(self) -> None:
        """Create zero AdamW moments where none exist yet (AdamW makes them at its first step, DeepSpeed links its
        per-parameter views of them after that step); a no-op once the run has stepped."""
        inner = self._zero().optimizer
        for flat in self._flat_masters():
            if not inner.state.get(flat):
                inner.state[flat] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat),
                                     "exp_avg_sq": torch.zeros_like(flat)}
        link = getattr(self._zero(), "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2 only
        if link is not None:
            link()

    def _step_count(self) -> torch.Tensor:
        steps = {float(self._zero().optimizer.state[flat]["step"]) for flat in self._flat_masters()}
        if len(steps) != 1:
            raise CheckpointError(f"the AdamW step counts of this rank's ZeRO partitions differ ({sorted(steps)})",
                                  "this is a bug in the DeepSpeed learner; report it with the run's config")
        return torch.tensor(steps.pop())

    def _mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        if getattr(self, "_mesh_cache", None) is None:
            import torch.distributed as dist

            # the blocks live on the CPU whatever the device: gloo carries them (the group is "cpu:gloo,cuda:nccl")
            self._mesh_cache = init_device_mesh("cpu", (dist.get_world_size(),))
        return self._mesh_cache

    def _piece(self, full: torch.Tensor) -> Any:
        """This rank's row block of ``full`` as a DTensor sharded on dim 0 (FSDP2's layout: torch.chunk blocks)."""
        from torch.distributed.tensor import DTensor, Shard

        mesh = self._mesh()
        rank, blocks = mesh.get_local_rank(), torch.chunk(full, mesh.size(), dim=0)
        local = blocks[rank].clone() if rank < len(blocks) else full.new_empty((0, *full.shape[1:]))
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())

    def _named(self) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
        """Parameters (tied aliases once, as named_parameters gives them) and persistent buffers, by name."""
        params = list(self.model.named_parameters())
        keep = set(self.model.state_dict())
        return params, [(n, b) for n, b in self.model.named_buffers() if n in keep]

    def save_shards(self, directory: str) -> LearnerState:
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        self._ensure_optimizer_state()
        params, buffers = self._named()
        step = self._step_count()
        tensors: dict[str, Any] = {}
        for name, p in params:  # one parameter gathered at a time: memory stays at this rank's share
            tensors[shards.MODEL + name] = self._piece(safe_get_full_fp32_param(p).detach().cpu())
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{shards.OPTIM}{name}.{key}"] = self._piece(
                    safe_get_full_optimizer_state(p, key).detach().cpu())
            tensors[f"{shards.OPTIM}{name}.step"] = step.clone()
        for name, b in buffers:
            tensors[shards.MODEL + name] = b.detach().cpu().clone()
        shards.dcp_save(tensors, directory)
        groups = self._zero().optimizer.param_groups
        if len(groups) != 1:  # the torch learner's AdamW has one group; its names are needed by an FSDP2 resume
            raise CheckpointError(f"the DeepSpeed learner's optimizer has {len(groups)} parameter groups, "
                                  "its checkpoints know one", "this is a bug in the DeepSpeed learner; report it")
        groups = [{k: v for k, v in groups[0].items() if k != "params"} | {"params": [n for n, _ in params]}]
        return sharded_state(self, directory, groups)

    def load_shards(self, state: LearnerState) -> None:
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        params, buffers = self._named()
        tensors: dict[str, Any] = {}
        for name, p in params:
            empty = torch.zeros(tuple(getattr(p, "ds_shape", p.shape)), dtype=torch.float32)
            tensors[shards.MODEL + name] = self._piece(empty)
            for key in ("exp_avg", "exp_avg_sq"):
                tensors[f"{shards.OPTIM}{name}.{key}"] = self._piece(empty)
            tensors[f"{shards.OPTIM}{name}.step"] = torch.zeros(())
        for name, b in buffers:
            tensors[shards.MODEL + name] = torch.zeros_like(b, device="cpu")
        check_same_model(tensors, state.shard_dir)
        shards.dcp_read(tensors, state.shard_dir)  # each rank reads the row blocks its mesh position covers
        self._ensure_optimizer_state()
        inner = self._zero().optimizer
        saved_groups = state.optimizer["param_groups"]
        if len(saved_groups) != len(inner.param_groups):
            raise CheckpointError(f"the checkpoint has {len(saved_groups)} optimizer parameter group(s) but this "
                                  f"learner has {len(inner.param_groups)}",
                                  "resume with the optimizer settings the run was trained with")
        for group, saved in zip(inner.param_groups, saved_groups):
            group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved.items() if k != "params"})
        steps = {float(t) for k, t in tensors.items() if k.startswith(shards.OPTIM) and k.endswith(".step")}
        if len(steps) != 1:  # the client AdamW keeps one count per ZeRO partition: every parameter's must agree
            raise CheckpointError(f"the checkpoint's parameters have different AdamW step counts ({sorted(steps)})",
                                  "resume it with the learner that wrote it (train.learner)")
        step = steps.pop()
        for flat in self._flat_masters():
            inner.state[flat]["step"].fill_(step)
        with torch.no_grad():
            for name, p in params:
                full = tensors[shards.MODEL + name].full_tensor()  # a collective, one parameter at a time
                safe_set_full_fp32_param(p, full.to(self.device))  # this rank's master partition
                for key in ("exp_avg", "exp_avg_sq"):
                    moment = tensors[f"{shards.OPTIM}{name}.{key}"].full_tensor()
                    safe_set_full_optimizer_state(p, moment.to(self.device), key)
                gathered = (deepspeed.zero.GatheredParameters([p], modifier_rank=0) if self.stage == 3
                            else contextlib.nullcontext())
                with gathered:  # the compute copy (ZeRO-3: re-partitioned on exit)
                    p.data.copy_(full.view(p.shape).to(p.dtype))
            for name, b in buffers:
                b.copy_(tensors[shards.MODEL + name])
        self._restore_progress(state)

    def resident_tensors(self) -> Mapping[str, list[torch.Tensor]]:
        """This rank's partitions: parameters (ZeRO-3: its slice), and the ZeRO optimizer's fp32 state."""
        params = [getattr(p, "ds_tensor", p) for p in self.model.parameters()]
        inner = self.engine.optimizer
        inner = getattr(inner, "optimizer", inner)
        out = {"policy parameters": params,
               "policy optimizer states": [t for st in inner.state.values() for t in st.values()
                                           if isinstance(t, torch.Tensor) and t.dim() > 0]}
        if self.reference is not None:
            out["reference parameters"] = list(self.reference.parameters())
        return out

    def optimizer_state_dtypes(self) -> dict[str, set[torch.dtype]]:
        """Dtypes of the ZeRO optimizer's master partitions and AdamW moments (what bf16 mode must keep fp32)."""
        inner = getattr(self.engine.optimizer, "optimizer", self.engine.optimizer)
        masters = {p.dtype for g in inner.param_groups for p in g["params"]}
        moments = {t.dtype for st in inner.state.values() for k, t in st.items()
                   if isinstance(t, torch.Tensor) and k.startswith("exp_avg")}
        return {"master": masters, "moments": moments,
                "compute": {p.dtype for p in self.model.parameters()}}


class DeepSpeedLearner(ShardedCheckpoints, RankGroup):
    """LearnerBackend: rank 0 of a DeepSpeed ZeRO group; starts and commands ranks 1..N-1."""

    make_rank = _Rank
    label = "DeepSpeed"

    def __init__(self, ctx: LearnerContext, options: DeepSpeedLearnerOptions | None = None) -> None:
        _quiet_environment()  # before the followers are spawned: they inherit it
        super().__init__(ctx, options or DeepSpeedLearnerOptions())

    def optimizer_state_dtypes(self) -> dict[str, set[torch.dtype]]:
        return self.ranks.call0("optimizer_state_dtypes")
