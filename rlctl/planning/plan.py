"""Capacity planner for a 7B policy on 8 GPUs: colocated vs 4+4 split. ESTIMATES, not results.

What this is: ``plan()``, behind ``rlctl dryrun --plan``. For each placement
(8 colocated; 4 rollout + 4 learner, synchronous and one-step-off) and for 32
and 128 prompts per step it gives the memory ledger verdict per device kind
(rlctl.planning.memory) and an estimated step time split into T_r, T_v, T_l, T_s
from a roofline model with stated assumptions (``Hardware``):

- rollout: prefill is compute-bound (2 P tokens FLOPs at ``prefill_mfu``);
  each decode step reads the weights once plus the live KV cache (half-length
  on average) at ``decode_bw_eff`` of HBM bandwidth, or is compute-bound,
  whichever is slower; every response is assumed to run to max length;
- learner: (6 + 2 with checkpointing) P FLOPs per token, + 2 P for the KL
  reference forward, at ``train_mfu``;
- sync: colocated = reshard weights over NVLink + sleep/wake the rollout
  engine's weights over PCIe; split = one broadcast of bf16 weights over NVLink;
- reward: rule rewards on CPU, not modelled (reported as 0).

Nothing here is measured: every figure is labelled as an estimate, and an
estimate is never written as a result.

What this is not: a simulator of queueing, stragglers or partial rollout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rlctl.planning.memory import GiB, Placement, Strategy, Workload, ledger
from rlctl.planning.shapes import PRESETS, ModelShape


@dataclass(frozen=True, slots=True)
class Hardware:
    name: str = "H100-SXM-class GPU (assumed)"
    bf16_flops: float = 989e12  # dense bf16 peak per GPU
    hbm_bytes_per_s: float = 3.35e12
    train_mfu: float = 0.40
    prefill_mfu: float = 0.50
    decode_mfu: float = 0.50
    decode_bw_eff: float = 0.60
    nvlink_bytes_per_s: float = 150e9  # effective, weight broadcast / reshard
    pcie_bytes_per_s: float = 25e9  # effective, sleep / wake offload


@dataclass(frozen=True, slots=True)
class Recipe:
    shape: ModelShape = PRESETS["7b"]
    devices: int = 8
    group_size: int = 8
    prompt_tokens: int = 512
    response_tokens: int = 1024
    micro_batch_size: int = 1
    kl_reference: bool = True


@dataclass(frozen=True, slots=True)
class PlanRow:
    placement: str
    mode: str
    prompts_per_step: int
    fits: bool
    memory: str  # per device kind: "rollout 31.0/80 GiB" ...
    largest: str
    t_r: float
    t_v: float
    t_l: float
    t_s: float
    step_s: float
    u_pipe: float
    generated_tokens_per_s: float

    @property
    def shares(self) -> dict[str, float]:
        total = self.t_r + self.t_v + self.t_l + self.t_s
        return {k: v / total for k, v in (("T_r", self.t_r), ("T_v", self.t_v), ("T_l", self.t_l),
                                          ("T_s", self.t_s))}


def strategy() -> Strategy:
    return Strategy(param_bytes=2, master_weights=True, optim_state_bytes=8, zero_stage=3, checkpointing=True,
                    rollout_bytes=2, engine="serving", gpu=True)


def plan(device_memory_bytes: int = 80 * GiB, recipe: Recipe = Recipe(), hw: Hardware = Hardware(),
         prompts: tuple[int, ...] = (32, 128), headroom: float = 0.15) -> list[PlanRow]:
    rows = []
    half = recipe.devices // 2
    for b in prompts:
        work = Workload(prompts_per_step=b, group_size=recipe.group_size, prompt_tokens=recipe.prompt_tokens,
                        response_tokens=recipe.response_tokens, micro_batch_size=recipe.micro_batch_size,
                        rollout_rows=b * recipe.group_size, kl_reference=recipe.kl_reference)
        for label, mode in (("colocate", "sync"), (f"split:{half}+{recipe.devices - half}", "sync"),
                            (f"split:{half}+{recipe.devices - half}", "one-step-off")):
            rows.append(_row(recipe, work, Placement.parse(label, recipe.devices), mode, hw, device_memory_bytes,
                             headroom))
    return rows


def _row(recipe: Recipe, work: Workload, place: Placement, mode: str, hw: Hardware, capacity: int,
         headroom: float) -> PlanRow:
    devs = ledger(recipe.shape, work, strategy(), place, capacity, headroom, advise=False)
    memory = ", ".join(f"{d.device} {d.required_bytes / GiB:.1f}/{capacity / GiB:.0f} GiB" for d in devs)
    worst = max(devs, key=lambda d: d.required_bytes)
    t_r = rollout_s(recipe, work, place.rollout_devices, hw)
    t_l = learner_s(recipe, work, place.learner_devices, hw)
    t_s = sync_s(recipe.shape, place, hw)
    if mode == "one-step-off":
        step = max(t_r, t_l) + t_s
    else:
        step = t_r + t_l + t_s
    busy = t_r * place.rollout_devices + t_l * place.learner_devices
    if place.kind == "colocate":
        busy = (t_r + t_l) * place.devices
    generated = work.sequences * recipe.response_tokens
    return PlanRow(placement=place.label, mode=mode, prompts_per_step=work.prompts_per_step,
                   fits=all(d.fits for d in devs), memory=memory,
                   largest=f"{worst.largest.role} {worst.largest.name}", t_r=t_r, t_v=0.0, t_l=t_l, t_s=t_s,
                   step_s=step, u_pipe=busy / (place.devices * step), generated_tokens_per_s=generated / step)


def rollout_s(recipe: Recipe, work: Workload, devices: int, hw: Hardware) -> float:
    """One engine per device (TP 1): its share of the sequences, prefill then decode to max length."""
    shape, p = recipe.shape, recipe.shape.num_params
    seqs = math.ceil(work.sequences / devices)
    prefill = shape.flops_per_token * seqs * recipe.prompt_tokens / (hw.bf16_flops * hw.prefill_mfu)
    kv_token = 2 * shape.num_layers * shape.kv_dim * 2
    kv_live = seqs * kv_token * (recipe.prompt_tokens + recipe.response_tokens / 2)
    memory_s = (p * 2 + kv_live) / (hw.hbm_bytes_per_s * hw.decode_bw_eff)
    compute_s = shape.flops_per_token * seqs / (hw.bf16_flops * hw.decode_mfu)
    return prefill + recipe.response_tokens * max(memory_s, compute_s)


def learner_s(recipe: Recipe, work: Workload, devices: int, hw: Hardware) -> float:
    tokens = work.sequences * work.seq_tokens
    per_token = recipe.shape.flops_per_token * (4 if work.kl_reference else 3)  # fwd + 2x bwd (+ ref fwd)
    per_token += recipe.shape.flops_per_token  # activation checkpointing recomputes the forward
    return per_token * tokens / (devices * hw.bf16_flops * hw.train_mfu)


def sync_s(shape: ModelShape, place: Placement, hw: Hardware) -> float:
    weights = shape.num_params * 2
    if place.kind == "colocate":
        return weights / hw.nvlink_bytes_per_s + 2 * weights / place.devices / hw.pcie_bytes_per_s
    return weights / hw.nvlink_bytes_per_s
