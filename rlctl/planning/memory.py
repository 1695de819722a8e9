"""The memory ledger: bytes per role and per device, from shapes and settings alone.

What this is: pure arithmetic. ``ledger()`` turns a model shape, a workload
(batch, lengths), a training strategy (precision, ZeRO/FSDP stage, activation
checkpointing, offload) and a placement (colocated or split pools) into one
``DeviceLedger`` per kind of device: every term with its role, phase and
formula, the peak over phases, fragmentation headroom, fits / does not fit,
the largest term, and what to change (found by re-running the ledger with
each candidate change, so advice is checked arithmetic, not a rule of thumb).

Phases: ``persistent`` terms live all the time; ``rollout`` (KV cache and
engine workspace), ``train`` (activations, logits, collective buffers) and
``sync`` (weight-publish buffers) terms live only in their phase. A device's
peak is persistent + its largest phase.

Activation bytes per token per layer (no checkpointing): b(6h + 4i) + 2(4 + b)h,
where b is the compute dtype's size, h the width and i the MLP width. These
are the tensors Hugging Face's Llama/Qwen2 decoder layer saves for backward:
the q/k/v input, the attention inputs and output, the o_proj input, the MLP's
gate, up, activation and product (4i), and each RMSNorm's fp32 input and
normalised output. K and V count at full width h, not H_kv x d: with a padding
mask HF repeats them to every query head before SDPA. RoPE saves only cos/sin.
Per token outside the layers: (4 + 2b)h (final norm, embeddings). The
coefficients were counted on the tiny model with a live-tensor meter
(tests/unit/test_dryrun.py keeps them honest). With checkpointing each layer
keeps only its input (b h) and one layer is recomputed at a time.

What this is not: measurement (rlctl.planning.dryrun) or rendering (rlctl.cli.dryrun).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from rlctl.planning.shapes import ModelShape

GiB = 1 << 30
MiB = 1 << 20
# "critic" is the value model's update, which runs before (never during) the policy's "train".
Phase = Literal["persistent", "rollout", "train", "critic", "sync"]
PHASES: tuple[Phase, ...] = ("rollout", "train", "critic", "sync")


@dataclass(frozen=True, slots=True)
class Workload:
    """What one step processes: B prompts x G samples, prompt and response lengths (tokens)."""

    prompts_per_step: int
    group_size: int
    prompt_tokens: int
    response_tokens: int
    micro_batch_size: int
    rollout_rows: int  # sequences one rollout engine holds at once (all of them, or the engine's chunk)
    kl_reference: bool = False
    shared_prefill: bool = False  # the learner runs each prompt once per group and reuses its KV cache
    critic: bool = False  # a value model (policy-sized backbone + scalar head) trains next to the policy

    @property
    def trained_tokens(self) -> int:
        """Tokens one micro-batch pushes through the layers with grad."""
        if not self.shared_prefill:
            return self.micro_batch_size * self.seq_tokens
        groups = -(-self.micro_batch_size // self.group_size)
        return self.micro_batch_size * self.response_tokens + groups * self.prompt_tokens

    @property
    def logit_tokens(self) -> int:
        """Positions whose logits one micro-batch materialises (the shared prefill keeps only the last)."""
        if not self.shared_prefill:
            return self.micro_batch_size * self.seq_tokens
        return self.micro_batch_size * (self.response_tokens + 1)

    @property
    def sequences(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def seq_tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens


@dataclass(frozen=True, slots=True)
class Strategy:
    """How the learner and rollout store things. Defaults = the plain torch learner on CPU (fp32)."""

    param_bytes: int = 4
    master_weights: bool = False  # fp32 master copy next to low-precision params (mixed precision)
    optim_state_bytes: int = 8  # AdamW: two moments, fp32 (8) or in the param dtype (2 x param_bytes)
    zero_stage: int = 0  # 0 none, 1 optimizer (+master), 2 + gradients, 3 + parameters (= FSDP full shard)
    checkpointing: bool = False
    offload_optimizer: bool = False  # optimizer states (+ master) in host memory
    rollout_bytes: int = 4  # rollout engine weights and KV cache element size
    rollout_tp: int = 1  # tensor-parallel degree of one rollout engine
    engine: Literal["in-process", "serving", "out-of-process"] = "in-process"  # rollout weights in the driver,
    # a serving engine in rlctl's process (GPU plans), or engine servers in their own processes (vLLM, SGLang)
    rollout_offload: bool = False  # the rollout engine's weights leave the device between its calls
    servers: int = 0  # out-of-process engine servers rlctl launches (0: attached ones, whose memory is elsewhere)
    server_kv_bytes: int | None = None  # one server's KV budget from its engine args (None: from the workload)
    server_memory_fraction: float | None = None  # one server's share of a GPU (GPU plans)
    gpu: bool = False

    def describe(self) -> str:
        prec = {4: "fp32", 2: "bf16"}.get(self.param_bytes, f"{self.param_bytes}B")
        parts = [f"{prec} params" + (" + fp32 master" if self.master_weights else ""),
                 f"ZeRO-{self.zero_stage}" if self.zero_stage else "no sharding",
                 "activation checkpointing" if self.checkpointing else "no checkpointing"]
        if self.offload_optimizer:
            parts.append("optimizer offloaded to CPU")
        if self.rollout_tp > 1:
            parts.append(f"rollout TP={self.rollout_tp}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Placement:
    """``colocate`` (every device runs both) or ``split`` (rollout_devices + learner_devices)."""

    kind: Literal["colocate", "split"]
    devices: int
    rollout_devices: int = 0
    learner_devices: int = 0

    @classmethod
    def parse(cls, text: str, devices: int) -> "Placement":
        if text == "colocate":
            return cls("colocate", devices, devices, devices)
        if text.startswith("split"):
            _, _, spec = text.partition(":")
            if not spec:
                half = max(1, devices // 2)
                return cls("split", devices, half, max(1, devices - half))
            a, _, b = spec.partition("+")
            if not (a.isdigit() and b.isdigit()) or int(a) < 1 or int(b) < 1:
                raise ValueError(f"placement {text!r}: write split:R+L, e.g. split:4+4")
            return cls("split", int(a) + int(b), int(a), int(b))
        raise ValueError(f"placement {text!r} is not colocate or split:R+L")

    @property
    def label(self) -> str:
        return "colocate" if self.kind == "colocate" else f"split:{self.rollout_devices}+{self.learner_devices}"


@dataclass(frozen=True, slots=True)
class Term:
    role: str  # policy | reference | rollout | critic | reward | runtime
    name: str
    bytes: int
    phase: Phase
    formula: str


@dataclass(frozen=True, slots=True)
class DeviceLedger:
    """One kind of device in a placement (``count`` identical devices)."""

    device: str
    count: int
    capacity_bytes: int
    headroom: float
    terms: tuple[Term, ...]
    advice: tuple[str, ...] = field(default=())

    def phase_bytes(self, phase: Phase) -> int:
        return sum(t.bytes for t in self.terms if t.phase in ("persistent", phase))

    @property
    def peak_phase(self) -> Phase:
        return max(PHASES, key=self.phase_bytes)

    @property
    def peak_bytes(self) -> int:
        """Allocated bytes at the peak (what torch.cuda.max_memory_allocated would report)."""
        return self.phase_bytes(self.peak_phase)

    @property
    def headroom_bytes(self) -> int:
        return int(self.peak_bytes * self.headroom)

    @property
    def required_bytes(self) -> int:
        return self.peak_bytes + self.headroom_bytes

    @property
    def fits(self) -> bool:
        return self.required_bytes <= self.capacity_bytes

    @property
    def largest(self) -> Term:
        live = [t for t in self.terms if t.phase in ("persistent", self.peak_phase)]
        return max(live, key=lambda t: t.bytes)


def ledger(shape: ModelShape, work: Workload, strat: Strategy, place: Placement, capacity_bytes: int,
           headroom: float = 0.15, advise: bool = True) -> list[DeviceLedger]:
    """One DeviceLedger per device kind of ``place`` (advice only where something does not fit)."""
    if place.kind == "colocate":
        kinds = [("rollout+learner", place.devices, True, True)]
    else:
        kinds = [("rollout", place.rollout_devices, True, False), ("learner", place.learner_devices, False, True)]
    out = []
    for name, count, has_rollout, has_learner in kinds:
        terms: list[Term] = []
        if has_learner:
            terms += learner_terms(shape, work, strat, place.learner_devices)
        if has_rollout:
            terms += rollout_terms(shape, work, strat, place.rollout_devices, capacity_bytes)
        terms += runtime_terms(shape, strat, has_rollout, has_learner, place)
        dev = DeviceLedger(device=name, count=count, capacity_bytes=capacity_bytes, headroom=headroom,
                           terms=tuple(t for t in terms if t.bytes > 0 or t.role in ("critic", "reward")))
        if advise and not dev.fits:
            dev = replace(dev, advice=tuple(advice(shape, work, strat, place, capacity_bytes, headroom, name)))
        out.append(dev)
    return out


def learner_terms(shape: ModelShape, work: Workload, strat: Strategy, world: int) -> list[Term]:
    p, b = shape.num_params, strat.param_bytes
    shard = lambda stage: world if strat.zero_stage >= stage else 1  # noqa: E731
    opt_dev = 0 if strat.offload_optimizer else 1
    master = 4 if strat.master_weights else 0
    terms = [
        Term("policy", "parameters", _div(p * b, shard(3)), "persistent", f"P x {b}B / {shard(3)}"),
        Term("policy", "gradients", _div(p * b, shard(2)), "persistent", f"P x {b}B / {shard(2)}"),
        Term("policy", "optimizer states", opt_dev * _div(p * strat.optim_state_bytes, shard(1)), "persistent",
             f"P x {strat.optim_state_bytes}B (AdamW m, v) / {shard(1)}" + (" [offloaded]" if not opt_dev else "")),
        Term("policy", "master weights", opt_dev * _div(p * master, shard(1)), "persistent",
             f"P x {master}B fp32 / {shard(1)}"),
        Term("policy", "activations", activation_bytes(shape, work, strat), "train", _act_formula(strat)),
        Term("policy", "logits", logits_bytes(shape, work, strat), "train",
             f"mb x T x V x ({b}+4+4)B (logits, fp32 log-softmax, entropy)"),
    ]
    if work.kl_reference:
        terms.append(Term("reference", "parameters", _div(p * b, shard(3)), "persistent", f"P x {b}B / {shard(3)}"))
    if work.critic:
        terms += critic_terms(shape, work, strat, world)
    else:
        terms.append(Term("critic", "none (GRPO)", 0, "persistent", "no value model"))
    terms.append(Term("reward", "none on device (rule rewards)", 0, "persistent", "graded on CPU"))
    return terms


def critic_terms(shape: ModelShape, work: Workload, strat: Strategy, world: int) -> list[Term]:
    """The value model: the policy's backbone without the LM head, plus a scalar head; its own AdamW.

    It trains on the same micro-batches without the prompt-prefill sharing (one
    forward per row) and materialises no vocabulary logits.
    """
    lm_head = 0 if shape.tie_embeddings else shape.vocab_size * shape.hidden_size
    p = shape.num_params - lm_head + shape.hidden_size + 1  # scalar head: weight row + bias
    b = strat.param_bytes
    shard = lambda stage: world if strat.zero_stage >= stage else 1  # noqa: E731
    opt_dev = 0 if strat.offload_optimizer else 1
    master = 4 if strat.master_weights else 0
    unshared = replace(work, shared_prefill=False)
    return [
        Term("critic", "parameters", _div(p * b, shard(3)), "persistent", f"P_backbone x {b}B / {shard(3)}"),
        Term("critic", "gradients", _div(p * b, shard(2)), "persistent", f"P_backbone x {b}B / {shard(2)}"),
        Term("critic", "optimizer states", opt_dev * _div(p * strat.optim_state_bytes, shard(1)), "persistent",
             f"P_backbone x {strat.optim_state_bytes}B (AdamW m, v) / {shard(1)}"),
        Term("critic", "master weights", opt_dev * _div(p * master, shard(1)), "persistent",
             f"P_backbone x {master}B fp32 / {shard(1)}"),
        Term("critic", "activations", activation_bytes(shape, unshared, strat), "critic", _act_formula(strat)),
    ]


def rollout_terms(shape: ModelShape, work: Workload, strat: Strategy, devices: int,
                  capacity_bytes: int | None = None) -> list[Term]:
    b, tp = strat.rollout_bytes, strat.rollout_tp
    replicas = max(1, devices // tp)
    rows = min(work.rollout_rows, math.ceil(work.sequences / replicas))
    kv = kv_cache_bytes(shape, rows, work.seq_tokens, b) // tp
    if strat.engine == "out-of-process":
        return server_terms(shape, strat, devices, kv, capacity_bytes)
    terms = [
        Term("rollout", "weights", _div(shape.num_params * b, tp), "rollout" if strat.rollout_offload else "persistent",
             f"P x {b}B / TP {tp}" + (", offloaded to host between calls" if strat.rollout_offload else "")),
        Term("rollout", "KV cache", kv, "rollout",
             f"2 x {rows} seqs x L x H_kv x d x {work.seq_tokens} tok x {b}B / TP {tp}"),
    ]
    if strat.engine == "in-process":  # an in-process engine (rlctl's local one) refolds q/k/v and gate/up (+ LM head) per call
        q = shape.num_heads * shape.head_dim
        per_layer = shape.hidden_size * (q + 2 * shape.kv_dim + 2 * shape.intermediate_size)
        fused = (shape.num_layers * per_layer + shape.vocab_size * shape.hidden_size) * b
        terms.append(Term("rollout", "engine workspace", fused, "rollout",
                          "folded weight copies: L x h(q+2kv+2i) + V h"))
    terms.append(Term("rollout", "sampling logits", rows * shape.vocab_size * 4 * 4, "rollout",
                      "seqs x V x 4B x 4 (logits, processed, log-softmax, probs)"))
    return terms


def server_terms(shape: ModelShape, strat: Strategy, devices: int, workload_kv: int,
                 capacity_bytes: int | None) -> list[Term]:
    """Engine servers in their own processes: on the device, never in rlctl's process (nor in its smoke-step
    measurement). Attached servers (``servers`` 0) live elsewhere and add nothing here."""
    if strat.servers <= 0:
        return []
    n = math.ceil(strat.servers / max(1, devices))  # servers per device
    where = f"{n} server{'s' if n > 1 else ''}, own processes"
    if strat.server_memory_fraction is not None and strat.gpu and capacity_bytes:
        return [Term("engine servers", "memory", int(n * strat.server_memory_fraction * capacity_bytes), "persistent",
                     f"{where}: {strat.server_memory_fraction:g} of the device each (weights, KV, workspace)")]
    kv, kv_formula = (strat.server_kv_bytes, "engine args") if strat.server_kv_bytes is not None else \
        (workload_kv, "the step's rows, as if the engine held only them")
    return [Term("engine servers", "weights", n * shape.num_params * strat.rollout_bytes, "persistent",
                 f"{where}: P x {strat.rollout_bytes}B each"),
            Term("engine servers", "KV cache", n * kv, "persistent", f"{where}: {fmt_bytes(kv)} each ({kv_formula})")]


def runtime_terms(shape: ModelShape, strat: Strategy, has_rollout: bool, has_learner: bool,
                  place: Placement) -> list[Term]:
    terms = []
    if has_learner:
        terms.append(Term("policy", "communication buffers", comm_bytes(shape, strat, place.learner_devices),
                          "train", _comm_formula(strat, place.learner_devices)))
        publish = shape.num_params * strat.param_bytes if strat.engine == "in-process" else \
            shape.layer_params * strat.param_bytes * 2
        terms.append(Term("policy", "weight-sync buffers", publish, "sync",
                          "full state-dict copy (in-process publish)" if strat.engine == "in-process"
                          else "2 layer buckets (layer-wise publish)"))
    if has_rollout and strat.engine == "in-process" and has_learner:
        terms.append(Term("rollout", "weight-sync staging", shape.num_params * strat.rollout_bytes, "sync",
                          "staged copy checked before swap"))
    if strat.gpu:
        terms.append(Term("runtime", "CUDA context + kernels", 1 * GiB, "persistent", "~1 GiB per process"))
        if has_rollout and strat.engine == "serving":
            terms.append(Term("runtime", "CUDA graphs", 1 * GiB, "persistent", "~1 GiB decode graph pool"))
    return terms


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, elem_bytes: int) -> int:
    """M_KV = 2 . B . L . H_kv . d . T . bytes (keys and values, every layer, every position)."""
    return 2 * sequences * shape.num_layers * shape.num_kv_heads * shape.head_dim * tokens * elem_bytes


def kv_budget_rows(shape: ModelShape, tokens: int, elem_bytes: int, budget_bytes: int) -> int:
    """Rows whose KV cache (``tokens`` positions each) fits in ``budget_bytes``: floor(budget / per-row bytes)."""
    return budget_bytes // kv_cache_bytes(shape, 1, tokens, elem_bytes)


def activation_bytes(shape: ModelShape, work: Workload, strat: Strategy) -> int:
    b, h, i = strat.param_bytes, shape.hidden_size, shape.intermediate_size
    per_layer_token = b * (6 * h + 4 * i) + 2 * (4 + b) * h
    outside = (4 + 2 * b) * h  # final norm and embedding output
    tokens = work.trained_tokens
    # the shared prefill copies each prompt's keys/values to its G rows (kept for backward)
    expanded = kv_cache_bytes(shape, work.micro_batch_size, work.prompt_tokens, b) if work.shared_prefill else 0
    if strat.checkpointing:  # inputs of every layer kept, one layer recomputed at a time
        return tokens * (shape.num_layers * b * h + per_layer_token + outside) + expanded
    return tokens * (shape.num_layers * per_layer_token + outside) + expanded


def logits_bytes(shape: ModelShape, work: Workload, strat: Strategy) -> int:
    return work.logit_tokens * shape.vocab_size * (strat.param_bytes + 8)


def comm_bytes(shape: ModelShape, strat: Strategy, world: int) -> int:
    if world <= 1:
        return 0
    if strat.zero_stage >= 3:  # gathered layer + prefetched layer (b) and a reduce-scatter bucket (fp32)
        return shape.layer_params * (2 * strat.param_bytes + 4)
    return 2 * 25 * MiB  # DDP-style gradient buckets


def advice(shape: ModelShape, work: Workload, strat: Strategy, place: Placement, capacity: int,
           headroom: float, device: str) -> list[str]:
    """What to change so ``device`` fits, checked by re-running the ledger.

    Greedy: repeatedly apply the remedy for the largest term at the peak that has one
    (shard / offload state, checkpoint / shrink the micro-batch, tensor-parallel
    rollout, a KV budget) until the device fits; single changes that fit on
    their own are listed first.
    """
    tips = []
    for label, w, s in _single_changes(work, strat, place):
        trial = _device(shape, w, s, place, capacity, headroom, device)
        if trial.fits:
            tips.append(f"{label} alone: {fmt_bytes(trial.required_bytes)} per device (fits)")
        if len(tips) == 2:
            return tips
    steps, w, s = [], work, strat
    dev = _device(shape, w, s, place, capacity, headroom, device)
    while not dev.fits:
        live = sorted((t for t in dev.terms if t.phase in ("persistent", dev.peak_phase)), key=lambda t: -t.bytes)
        change = next((c for c in (_remedy(t, w, s, place) for t in live) if c is not None), None)
        if change is None:
            break
        label, w, s = change
        steps.append(label)
        dev = _device(shape, w, s, place, capacity, headroom, device)
    steps = _collapse(steps)
    verdict = "fits" if dev.fits else f"still does not fit: add devices ({dev.largest.role} {dev.largest.name} " \
        f"is the largest term)"
    tips.append(f"{' + '.join(steps) or 'no single change'}: {fmt_bytes(dev.required_bytes)} per device ({verdict})")
    return tips


def _collapse(steps: list[str]) -> list[str]:
    """Keep the last change of each kind: 'ZeRO-1 + ZeRO-3' -> 'ZeRO-3', 'TP=2 + TP=4' -> 'TP=4'."""
    def kind(label: str) -> str:
        return "ZeRO" if label.startswith("ZeRO") else "KV" if label.startswith("KV") else label.split("=")[0]

    last = {kind(s): s for s in steps}
    return [s for s in steps if last[kind(s)] == s]


def _single_changes(work: Workload, strat: Strategy, place: Placement):
    stages = range(strat.zero_stage + 1, 4) if place.learner_devices > 1 else ()  # sharding needs >1 learner
    out = [(f"shard with ZeRO-{n}" + (" (FSDP full shard)" if n == 3 else ""), work, replace(strat, zero_stage=n))
           for n in stages]
    if not strat.checkpointing:
        out.append(("activation checkpointing", work, replace(strat, checkpointing=True)))
    if work.micro_batch_size > 1:
        out.append((f"micro_batch_size={max(1, work.micro_batch_size // 2)}",
                    replace(work, micro_batch_size=max(1, work.micro_batch_size // 2)), strat))
    return out


def _remedy(term: Term, work: Workload, strat: Strategy, place: Placement):
    """The next change that shrinks ``term``, or None when none is left."""
    state = term.name in ("parameters", "gradients", "optimizer states", "master weights")
    if state and term.role in ("policy", "reference"):
        need = {"optimizer states": 1, "master weights": 1, "gradients": 2, "parameters": 3}[term.name]
        shardable = place.learner_devices > 1
        if shardable and strat.zero_stage < need:
            return f"ZeRO-{need}", work, replace(strat, zero_stage=need)
        if term.name in ("optimizer states", "master weights") and not strat.offload_optimizer:
            return "optimizer offload to CPU", work, replace(strat, offload_optimizer=True)
        if shardable and strat.zero_stage < 3:
            return "ZeRO-3", work, replace(strat, zero_stage=3)
        return None
    if term.name in ("activations", "logits"):
        if term.name == "activations" and not strat.checkpointing:
            return "activation checkpointing", work, replace(strat, checkpointing=True)
        if work.micro_batch_size > 1:
            mb = work.micro_batch_size // 2
            return f"micro_batch_size={mb}", replace(work, micro_batch_size=mb), strat
        return None
    if term.role == "rollout" and term.name in ("weights", "KV cache", "engine workspace"):
        if strat.rollout_tp * 2 <= max(1, place.rollout_devices):
            return f"rollout TP={strat.rollout_tp * 2}", work, replace(strat, rollout_tp=strat.rollout_tp * 2)
        if term.name == "KV cache" and work.rollout_rows > 1:
            rows = work.rollout_rows // 2
            return f"KV budget {rows} seqs/engine", replace(work, rollout_rows=rows), strat
    return None


def _device(shape: ModelShape, work: Workload, strat: Strategy, place: Placement, capacity: int, headroom: float,
            device: str) -> DeviceLedger:
    return next(d for d in ledger(shape, work, strat, place, capacity, headroom, advise=False) if d.device == device)


def _act_formula(strat: Strategy) -> str:
    per = "b(6h+4i)+2(4+b)h per token per layer"
    return f"mb x T x (L x b h + {per})" if strat.checkpointing else f"mb x T x L x {per}"


def _comm_formula(strat: Strategy, world: int) -> str:
    if world <= 1:
        return "single device: none"
    return "layer x (2b + 4B) gather/prefetch + reduce-scatter" if strat.zero_stage >= 3 else "2 x 25 MiB buckets"


def _div(value: int, by: int) -> int:
    return -(-value // max(1, by))


def fmt_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals: '1.50 GiB', '512 B'."""
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def parse_bytes(text: str) -> int:
    """'80GiB', '80G', '512MiB', '1.5TB' -> bytes (binary units for i-suffixes and bare letters)."""
    t = text.strip().replace(" ", "")
    units = {"tib": 1 << 40, "gib": GiB, "mib": MiB, "kib": 1024, "tb": 10**12, "gb": 10**9, "mb": 10**6,
             "kb": 10**3, "t": 1 << 40, "g": GiB, "m": MiB, "k": 1024, "b": 1}
    for suffix in sorted(units, key=len, reverse=True):
        if t.lower().endswith(suffix):
            number = t[: -len(suffix)]
            try:
                return int(float(number) * units[suffix])
            except ValueError:
                break
    try:
        return int(float(t))
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a size; write e.g. 80GiB") from None
