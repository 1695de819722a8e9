"""The FSDP2 learner: one policy sharded over a group of processes that rlctl starts itself.

What this is: a LearnerBackend over a group of ranks (rlctl.kit.RankGroup:
rank 0 is the training process, ranks 1..N-1 are spawned processes that follow
its commands; under ``cluster.backend=ray`` all N ranks are Ray actors and the
training process only commands them). This plugin holds the FSDP2 rank
itself. Every rank loads the same policy, applies
``torch.distributed.fsdp.fully_shard`` to each decoder layer and then to the
root, and builds AdamW over its shards, so parameters, gradients and optimizer
state are split N ways. The update maths is the torch learner's own
(``_Rank`` subclasses ``TorchLearner``): PPO epochs x mini-batches x
micro-batch accumulation, gradient clipping by the global norm across shards,
the NaN/Inf skip. Every rank runs the same rows (the shards are of the model,
not of the batch), so the result equals the single-process learner's.

Only collectives have a deadline (``rank_timeout_s``); a rank that dies or
fails is reported by number as a RoleError (the kit's rank plumbing).

Weights for publishing are gathered to rank 0 (full state dict, on the CPU).
Precision: ``bfloat16`` gathers parameters in bf16 for compute while the fp32
shards are the master weights and AdamW moments stay fp32.

Checkpoints are sharded (ShardedCheckpointLearner): every rank writes its own
pieces of the fp32 weights and AdamW state with torch.distributed.checkpoint
into the checkpoint's ``shards/`` (layout: rlctl.kit.shards), the rest
(LR schedule, param groups, the mini-batch generator, counters) travels in the
checkpoint's JSON like the torch learner's. Loading reads whatever pieces this
rank's shards overlap, so a checkpoint saved by N ranks resumes on M.

What this is not: data parallel (every rank sees the whole batch).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlctl import ConfigError
from rlctl.contracts.types import LearnerContext
from rlctl.contracts.checkpoints import LearnerState
from rlctl.kit import (
    RankGroup, ShardedCheckpoints, TorchLearner, TorchLearnerOptions, check_same_model, local_shard, sharded_state,
    shards,
)
from rlctl_fsdp_learner.options import FsdpLearnerOptions


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
            ptr = local_shard(tensor).data_ptr()
            if ptr not in seen or local_shard(tensor).numel() == 0:
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


class FsdpLearner(ShardedCheckpoints, RankGroup):
    """The FSDP2 learner: a RankGroup of FSDP2 ranks, with sharded checkpoints (ShardedCheckpointLearner)."""

    make_rank = _Rank
    label = "FSDP2"

    def __init__(self, ctx: LearnerContext, options: FsdpLearnerOptions | None = None) -> None:
        super().__init__(ctx, options or FsdpLearnerOptions())
