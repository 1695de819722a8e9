"""``rlctl dryrun``: validate a run without training it, ledger its memory, and check the ledger by measurement.

What this is: ``dryrun()``, the library function behind the command:

1. checks: the config (already validated on load), every plugin name and its
   options, the task data (every split non-empty) and the tokenizer (special
   tokens, prompt lengths measured with it);
2. the memory ledger (rlctl.planning.memory) per placement and device, for the
   config's model or a shape preset / config.json (``shape``), without
   loading weights;
3. a smoke step (two real sync steps of the config through rlctl.engine.loop;
   the built-in model starts untrained when its warm start is not cached yet)
   while a meter records the peak of live tensor bytes per phase: rollout,
   train, sync. On CPU the meter is a TorchDispatchMode that counts every
   tensor storage allocated and freed (what torch's CUDA allocator reports as
   "allocated"); when the learner's model is on CUDA it reads
   torch.cuda.max_memory_allocated per phase instead. The ledger of the smoke
   run is then compared with the measurement: relative error per phase and at
   the device peak.

What this is not: the ledger arithmetic (rlctl.planning.memory), the planner
(rlctl.planning.plan) or rendering (rlctl.cli.dryrun).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

from rlctl.config.models import RunConfig, sink_specs
from rlctl.contracts.errors import ConfigError
from rlctl.contracts.roles import ShardedLearnerOptions, ZeroStagedOptions
from rlctl.contracts.types import LearnerMemory, RolloutMemory
from rlctl.hooks.manager import Plugins
from rlctl.planning.engine_servers import engine_launch_check, engine_server_notes
from rlctl.planning.meter import Meter, Phased, make_meter, rss_peak_bytes
from rlctl.planning.memory import (PHASES, DeviceLedger, Placement, Strategy, Workload, fmt_bytes, kv_budget_rows,
                              kv_cache_bytes, ledger)
from rlctl.planning.shapes import ModelShape, builtin_shape, from_hf_config, resolve_shape

LEDGER_TOLERANCE = 0.25  # acceptance bound for |ledger - measured| / measured on the tiny model


@dataclass(frozen=True, slots=True)
class DryrunOptions:
    devices: int = 1
    device_memory_bytes: int | None = None  # None: host RAM on CPU
    placements: tuple[str, ...] = ("colocate",)
    shape: str | None = None  # preset name or config.json; None: the config's model
    zero_stage: int | None = None  # None: what the learner reports (its memory_terms)
    prompt_tokens: int | None = None  # None: measured from the train split with the run's tokenizer
    headroom: float = 0.15
    smoke: bool = True


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True, slots=True)
class PhaseComparison:
    phase: str
    ledger_bytes: int
    measured_bytes: int

    @property
    def error(self) -> float:
        return (self.ledger_bytes - self.measured_bytes) / self.measured_bytes if self.measured_bytes else 0.0


@dataclass(frozen=True, slots=True)
class SmokeResult:
    steps: int
    wall_s: float
    meter: str  # "torch dispatch (live tensor bytes)" or "torch.cuda.max_memory_allocated"
    untrained_policy: bool
    phases: tuple[PhaseComparison, ...]
    persistent: dict[str, tuple[int, int]]  # term -> (ledger, measured)
    peak: PhaseComparison
    rss_peak_bytes: int
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def within_tolerance(self) -> bool:
        return abs(self.peak.error) <= LEDGER_TOLERANCE


@dataclass(frozen=True, slots=True)
class DryrunReport:
    checks: tuple[Check, ...]
    shape: ModelShape
    workload: Workload
    strategy: Strategy
    placements: dict[str, list[DeviceLedger]]
    smoke: SmokeResult | None
    notes: tuple[str, ...] = ()
    staleness: Any = None  # rlctl.planning.staleness.RunPrediction for mode one_step_off / async (needs the smoke step)

    @property
    def fits(self) -> dict[str, bool]:
        return {name: all(d.fits for d in devs) for name, devs in self.placements.items()}


def dryrun(config: RunConfig, plugins: Plugins, home: Path, options: DryrunOptions) -> DryrunReport:
    """Checks, ledgers per placement, and (unless disabled) a measured smoke step."""
    from rlctl.placement.build import build_estimator

    checks, task, tokenizer, prompt_max = validate(config, plugins, home)
    shape = resolve_shape(options.shape) if options.shape else config_shape(config, tokenizer)
    gpu = options.device_memory_bytes is not None
    roles = role_memory(config, plugins, gpu_plan=gpu and (options.shape is not None or not config.model.builtin))
    critic = build_estimator(config, plugins).needs_critic
    strat = strategy(options, roles, gpu=gpu)
    capacity = options.device_memory_bytes or host_memory_bytes()
    work = workload(config, options.prompt_tokens or prompt_max, roles, critic=critic, shape=shape,
                    kv_elem_bytes=strat.rollout_bytes, device_memory_bytes=options.device_memory_bytes)
    placements, places = {}, []
    for text in options.placements:
        try:
            place = Placement.parse(text, options.devices)
        except ValueError as err:
            raise ConfigError(str(err), "use --placement colocate or split:4+4 (a comma list for both)") from None
        placements[place.label] = ledger(shape, work, strat, place, capacity, options.headroom)
        places.append(place)
    notes = [f"prompt tokens: {work.prompt_tokens} "
             + ("(--prompt-tokens)" if options.prompt_tokens else "(longest train prompt, run's tokenizer)")]
    notes += world_size_notes(config, places, gpu)
    notes += roles.notes
    notes += rollout_budget_notes(roles.rollout, work, gpu)
    notes += learner_notes(config, plugins, roles, strat.zero_stage)
    smoke = None
    if options.smoke:
        if options.shape:
            notes.append("smoke step runs the config's own model; the ledger above is for the --shape model")
        smoke = smoke_step(config, plugins, home, task, options)
    staleness = None
    if config.mode != "sync":
        if smoke is None:
            notes.append("staleness prediction needs the smoke step's timings (drop --no-smoke)")
        else:
            from rlctl.planning.staleness import length_tail, predict_for_run

            staleness = predict_for_run(config, smoke.metrics, tail=length_tail(config, plugins))
    return DryrunReport(checks=tuple(checks), shape=shape, workload=work, strategy=strat, placements=placements,
                        smoke=smoke, notes=tuple(notes), staleness=staleness)


def world_size_notes(config: RunConfig, places: Sequence[Any], gpu: bool) -> list[str]:
    """A placement whose learner pool differs from the sharded learner's ``world_size``: the ledger shards over
    the placement's learner devices, the run would shard over ``world_size`` ranks; say so rather than hide it."""
    world = (config.train.learner_options or {}).get("world_size")
    if not gpu or not isinstance(world, int):
        return []
    return [f"placement {p.label} gives the learner {p.learner_devices} devices but train.learner_options.world_size "
            f"is {world}: the ledger assumes {p.learner_devices}; run this layout with "
            f"train.learner_options.world_size={p.learner_devices}" for p in places if p.learner_devices != world]

# -- checks ------------------------------------------------------------------------------------


def validate(config: RunConfig, plugins: Plugins, home: Path) -> tuple[list[Check], Any, Any, int]:
    """Plugins and options, task data, tokenizer; raises the first real error (as train would)."""
    from rlctl.config.load import validate_options
    from rlctl.placement.build import build_reward, load_task

    checks = [Check("config", True, "schema and cross-field rules")]
    for kind, name, opts, where in (
        ("rollout_backend", config.rollout.backend, config.rollout.options, "rollout.options"),
        ("learner_backend", config.train.learner, config.train.learner_options, "train.learner_options"),
    ):
        comp = plugins.get(kind, name)
        validate_options(comp.options, opts, where)
        checks.append(Check(f"plugin {kind}", True, f"{name!r} from {comp.plugin}, options valid"))
    for i, (sink, opts) in enumerate(sink_specs(config.train.metric_sinks)):
        validate_options(plugins.get("metric_sink", sink).options, opts, f"train.metric_sinks.{i}.options")
    if config.rollout.environment is not None:
        from rlctl.placement.build import check_environment

        check_environment(config, plugins)
        env = config.rollout.environment
        checks.append(Check("environment", True, f"{env.name!r} from {plugins.get('environment', env.name).plugin}, "
                            "options and tools valid"))
    from rlctl.placement.build import build_estimator

    estimator = build_estimator(config, plugins)
    checks.append(Check("plugin advantage_estimator", True, f"{config.algo.name!r} from "
                        f"{plugins.get('advantage_estimator', config.algo.name).plugin}, options valid"
                        + ("; needs a critic" if estimator.needs_critic else "")))
    reward = build_reward(config, plugins)
    checks.append(Check("reward", True, reward.version))
    task = load_task(config, plugins, reward)
    sizes = {s: len(task.split(s)) for s in ("train", "dev", "hidden")}
    checks.append(Check("data", True, f"task {task.name!r} version {task.version[:12]}; "
                        + ", ".join(f"{k} {v}" for k, v in sizes.items())))
    tokenizer, tok_detail = load_tokenizer(config, home)
    lengths = [len(tokenizer(p.text)["input_ids"]) for p in task.train]
    checks.append(Check("tokenizer", True, f"{tok_detail}; train prompts {min(lengths)}-{max(lengths)} tokens"))
    launch = engine_launch_check(config, plugins, config_shape(config, tokenizer).head_dim)
    checks += [Check("engine launch", True, launch)] if launch else []
    return checks, task, tokenizer, max(lengths)


def load_tokenizer(config: RunConfig, home: Path) -> tuple[Any, str]:
    """The run's tokenizer without loading model weights."""
    if config.model.builtin:
        from rlctl.models.tokenizer import build_char_tokenizer

        tok = build_char_tokenizer()
        return tok, f"built-in char tokenizer, vocab {len(tok)}"
    from transformers import AutoTokenizer

    from rlctl.models.load import check_model_dir

    root = check_model_dir(config.model.path)
    tok = AutoTokenizer.from_pretrained(root, local_files_only=True)
    if tok.eos_token_id is None:
        raise ConfigError(f"the tokenizer in {root} has no eos token", "set eos_token in tokenizer_config.json")
    return tok, f"{type(tok).__name__} from {root}, vocab {len(tok)}"


# -- ledger inputs -----------------------------------------------------------------------------


def config_shape(config: RunConfig, tokenizer: Any) -> ModelShape:
    if config.model.builtin:
        return builtin_shape(config.model, len(tokenizer))
    import json

    path = Path(config.model.path).expanduser() / "config.json"
    return from_hf_config(json.loads(path.read_text()), name=Path(config.model.path).name, source=str(path))


@dataclass(frozen=True, slots=True)
class RoleMemory:
    """What the configured learner and rollout backends report about their memory."""

    learner: LearnerMemory
    rollout: RolloutMemory
    notes: tuple[str, ...] = ()


def role_memory(config: RunConfig, plugins: Plugins, *, gpu_plan: bool) -> RoleMemory:
    """Ask each configured backend's validated options for its memory terms (defaults, with a note, if it has none)."""
    from rlctl.config.load import validate_options
    from rlctl.contracts.roles import LearnerMemoryTerms, RolloutMemoryTerms

    notes = []
    learner_opts = validate_options(plugins.get("learner_backend", config.train.learner).options,
                                    config.train.learner_options, "train.learner_options")
    rollout_opts = validate_options(plugins.get("rollout_backend", config.rollout.backend).options,
                                    config.rollout.options, "rollout.options")
    if isinstance(learner_opts, LearnerMemoryTerms):
        learner = learner_opts.memory_terms(gpu_plan=gpu_plan)
    else:
        learner = LearnerMemory()
        notes.append(f"learner {config.train.learner!r} reports no memory terms: the ledger assumes fp32 "
                     "parameters, fp32 AdamW and no sharding")
    if isinstance(rollout_opts, RolloutMemoryTerms):
        rollout = rollout_opts.memory_terms(gpu_plan=gpu_plan)
    else:
        rollout = RolloutMemory()
        notes.append(f"rollout backend {config.rollout.backend!r} reports no memory terms: the ledger assumes a "
                     "serving engine that holds the whole batch")
    return RoleMemory(learner=learner, rollout=rollout, notes=tuple(notes))


def sharding_learners(plugins: Plugins, stage: int) -> list[str]:
    """Installed learner backends that shard at ``stage``: by their default memory terms, or any stage their
    options' optional ``zero_stages()`` lists (a learner whose stage is an option)."""
    from rlctl.contracts.roles import LearnerMemoryTerms

    out = []
    for name in plugins.names("learner_backend"):
        model = plugins.get("learner_backend", name).options
        try:
            opts = model() if model is not None else None
        except Exception:  # options without defaults cannot be judged here
            continue
        if not isinstance(opts, LearnerMemoryTerms):
            continue
        stages = opts.zero_stages() if isinstance(opts, ZeroStagedOptions) else ()
        if stage in stages or opts.memory_terms(gpu_plan=True).zero_stage == stage:
            out.append(name)
    return out


def _stage_label(stage: int) -> str:
    return {0: "no sharding", 3: "ZeRO-3 / FSDP full shard"}.get(stage, f"ZeRO-{stage}")


def learner_unavailable(plugins: Plugins, name: str, options: Any = None) -> str | None:
    """Why learner plugin ``name`` cannot run here (e.g. its optional dependency is missing), or None."""
    from rlctl.contracts.roles import LearnerAvailability

    if options is None:
        model = plugins.get("learner_backend", name).options
        try:
            options = model() if model is not None else None
        except Exception:
            return None
    return options.unavailable() if isinstance(options, LearnerAvailability) else None


def learner_notes(config: RunConfig, plugins: Plugins, roles: RoleMemory, stage: int) -> list[str]:
    """Which learner plugin and sharding the ledger assumes, and whether a learner that shards so is installed."""
    from rlctl.config.load import validate_options

    name = config.train.learner
    own = roles.learner.zero_stage
    notes = [f"learner: {name!r} ({_stage_label(own)})"]
    try:
        options = validate_options(plugins.get("learner_backend", name).options, config.train.learner_options,
                                   "train.learner_options")
    except Exception:
        options = None
    missing = learner_unavailable(plugins, name, options) if options is not None else None
    if missing:
        notes.append(f"learner {name!r} cannot run in this environment: {missing}")
    if stage != own:
        providers = sharding_learners(plugins, stage)
        ready = [p for p in providers if not learner_unavailable(plugins, p)]
        shown = [p if p in ready else f"{p} (not runnable here: {learner_unavailable(plugins, p)})" for p in providers]
        first = (ready or providers or [""])[0]
        where = (f"installed learner(s) that do: {', '.join(shown)} (set train.learner: {first})"
                 if providers else "no installed learner plugin does (rlctl plugins list shows the learners)")
        notes.append(f"the ledger models {_stage_label(stage)} (--zero-stage), which learner {name!r} does not do; "
                     + where)
    return notes


def workload(config: RunConfig, prompt_tokens: int, roles: RoleMemory, critic: bool = False,
             shape: ModelShape | None = None, kv_elem_bytes: int = 4,
             device_memory_bytes: int | None = None) -> Workload:
    """The step's shapes; the rollout's rows per forward are the engine's chunk, capped by its KV budget (which
    needs ``shape``; a fractional budget needs ``device_memory_bytes``, a GPU plan)."""
    rows = config.algo.prompts_per_step * config.algo.group_size
    chunk = min(rows, roles.rollout.max_rows or rows)
    budget = rollout_kv_budget(roles.rollout, device_memory_bytes)
    if budget is not None and shape is not None:
        tokens = prompt_tokens + config.rollout.max_tokens
        fit = kv_budget_rows(shape, tokens, kv_elem_bytes, budget)
        if fit < 1:
            raise ConfigError(f"rollout.options.kv_cache_budget {fmt_bytes(budget)} is too small for one row of "
                              f"{tokens} tokens ({fmt_bytes(kv_cache_bytes(shape, 1, tokens, kv_elem_bytes))} of "
                              "KV cache)", "raise kv_cache_budget, or lower rollout.max_tokens")
        chunk = min(chunk, fit)
    return Workload(prompts_per_step=config.algo.prompts_per_step, group_size=config.algo.group_size,
                    prompt_tokens=prompt_tokens, response_tokens=config.rollout.max_tokens,
                    micro_batch_size=min(config.algo.micro_batch_size, rows // config.algo.num_mini_batches),
                    rollout_rows=chunk, kl_reference=config.algo.kl.coef > 0,
                    critic=critic,
                    shared_prefill=roles.learner.shared_prefill and config.algo.group_size > 1)


def rollout_kv_budget(rollout: RolloutMemory, device_memory_bytes: int | None) -> int | None:
    """The engine's KV budget in bytes: its byte count, or its fraction of the planned device (GPU plans)."""
    if rollout.kv_budget_bytes is not None:
        return rollout.kv_budget_bytes
    if rollout.kv_budget_fraction is not None and device_memory_bytes is not None:
        return int(rollout.kv_budget_fraction * device_memory_bytes)
    return None


def rollout_budget_notes(rollout: RolloutMemory, work: Workload, gpu: bool) -> list[str]:
    """What the ledger did with the engine's KV budget and weight offload."""
    notes = []
    if rollout.kv_budget_fraction is not None and not gpu:
        notes.append(f"rollout kv_cache_budget {rollout.kv_budget_fraction} is a fraction of a GPU's memory: not "
                     "applied without --gpu-mem (and the engine refuses a fraction on CPU; give bytes there)")
    elif rollout.kv_budget_bytes is not None or rollout.kv_budget_fraction is not None:
        notes.append(f"rollout KV budget: {work.rollout_rows} rows per forward "
                     f"({work.seq_tokens} tokens each)")
    notes += engine_server_notes(rollout)
    if rollout.offload_weights:
        notes.append("rollout offload_weights: the engine's weights are counted in the rollout phase only"
                     if gpu else "rollout offload_weights does nothing on CPU: the engine's weights stay counted")
    return notes


def strategy(options: DryrunOptions, roles: RoleMemory, gpu: bool) -> Strategy:
    """Precision and sharding as the learner reports them (``--zero-stage`` overrides the stage)."""
    mem = roles.learner
    stage = options.zero_stage if options.zero_stage is not None else mem.zero_stage
    if not 0 <= stage <= 3:
        raise ConfigError(f"--zero-stage must be 0..3, got {stage}", "use 3 for ZeRO-3 / FSDP full shard")
    # on GPUs the rollout is modelled as a serving engine (bf16, layer-bucketed weight sync): an in-process
    # engine is a CPU / small-model engine
    engine = "in-process" if roles.rollout.in_process and not gpu else "serving"
    servers = roles.rollout
    if servers.out_of_process:
        engine = "out-of-process"
    return Strategy(param_bytes=mem.param_bytes, master_weights=mem.master_weights,
                    optim_state_bytes=mem.optim_state_bytes, zero_stage=stage, checkpointing=mem.checkpointing,
                    rollout_bytes=2 if gpu and engine != "in-process" else 4, engine=engine, gpu=gpu,
                    rollout_offload=gpu and roles.rollout.offload_weights, servers=servers.servers,
                    server_kv_bytes=servers.server_kv_bytes, server_memory_fraction=servers.server_memory_fraction)


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# -- smoke step + measurement --------------------------------------------------------------------


def smoke_config(config: RunConfig, task: Any, home: Path) -> tuple[RunConfig, bool]:
    """Two steps, no eval or checkpoints; the built-in model untrained unless its warm start is cached."""
    from rlctl.models.warm_start import warm_start_key

    cfg = config.model_copy(deep=True)
    cfg.train.steps, cfg.eval.at_end, cfg.checkpoint.every_steps = 2, False, 0
    cfg.cluster.backend = "local"  # the smoke steps run in this process (a sharded learner's ranks as local processes)
    untrained = False
    if cfg.model.builtin and cfg.model.warm_start.enabled:
        key = warm_start_key(cfg.model, task, cfg.run.seed)
        if not (home / "cache" / "warm_start" / key / "COMPLETE").is_file():
            cfg.model.warm_start.enabled, untrained = False, True
    return cfg, untrained


def smoke_step(config: RunConfig, plugins: Plugins, home: Path, task: Any, options: DryrunOptions) -> SmokeResult:
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec
    from rlctl.placement import place

    cfg, untrained = smoke_config(config, task, home)
    placement = place(cfg, plugins, cache_root=home / "cache", task=task)
    try:
        roles = placement.roles
        meter = make_meter(roles)
        metered = replace(roles, rollout=Phased(roles.rollout, meter, {"generate": "rollout", "update_weights": "sync"}),
                          learner=Phased(roles.learner, meter, {"train_step": "train", "export_weights": "sync",
                                                                 "train_step_with_logprobs": "train",
                                                                 "ref_logprobs": "train"}),
                          critic=None if roles.critic is None else Phased(roles.critic, meter, {
                              "train_step": "critic", "values": "critic"}))
        started = time.perf_counter()
        longest = [1.0]  # longest response the smoke steps actually generated

        def observe(step: int, step_metrics: Any) -> None:
            longest.append(float(step_metrics.get("response_length_max", 1.0)))

        with meter:
            metrics = run_sync(metered, LoopSpec.from_config(cfg), [], observe)
    finally:
        placement.close()
    wall = time.perf_counter() - started
    tokenizer_vocab = len(roles.tokenizer)
    shape = config_shape(cfg, roles.tokenizer) if not cfg.model.builtin else builtin_shape(cfg.model, tokenizer_vocab)
    prompt_max = max(len(roles.tokenizer(p.text)["input_ids"]) for p in task.train)
    memory = role_memory(cfg, plugins, gpu_plan=False)
    critic = roles.critic is not None
    # The meter sees this process: with a sharded learner that is rank 0 (its 1/N of the sharded terms, the
    # rollout engine, the full activations), so the ledger it is held against is one device of N at the
    # learner's own ZeRO stage; otherwise one unsharded device.
    from rlctl.config.load import validate_options

    learner_opts = validate_options(plugins.get("learner_backend", cfg.train.learner).options,
                                    cfg.train.learner_options, "train.learner_options")
    ranks = learner_opts.world_size if isinstance(learner_opts, ShardedLearnerOptions) else 1
    strat = strategy(replace(options, shape=None, zero_stage=None if ranks > 1 else 0), memory, gpu=False)
    strat = replace(strat, servers=0)  # engine servers run in their own processes: the meter sees rlctl's only
    # Check the ledger's formulas at the lengths the smoke steps really had; the planning
    # ledger above budgets every response at rollout.max_tokens (the worst case).
    observed = replace(workload(cfg, prompt_max, memory, critic=critic, shape=shape),
                       response_tokens=max(1, int(max(longest))))
    dev = ledger(shape, observed, strat, Placement("colocate", ranks, ranks, ranks), host_memory_bytes(),
                 advise=False)[0]
    result = compare(dev, meter, wall, untrained, cfg.train.steps, dict(metrics))
    if ranks > 1:
        result = replace(result, meter=f"{result.meter}; this process is learner rank 0 of {ranks}")
    return result


def compare(dev: DeviceLedger, meter: "Meter", wall: float, untrained: bool, steps: int,
            metrics: dict[str, float]) -> SmokeResult:
    phases = tuple(PhaseComparison(p, dev.phase_bytes(p), meter.peaks[p]) for p in PHASES
                   if p in meter.peaks)  # a run without a critic never enters the "critic" phase
    top = max(phases, key=lambda c: c.measured_bytes)
    peak = PhaseComparison(f"peak ({top.phase})", dev.peak_bytes, top.measured_bytes)
    persistent = {f"{t.role} {t.name}": t.bytes for t in dev.terms if t.phase == "persistent" and t.bytes}
    measured = meter.persistent
    return SmokeResult(steps=steps, wall_s=wall, meter=meter.kind, untrained_policy=untrained, phases=phases,
                       persistent={k: (v, measured.get(k, 0)) for k, v in persistent.items()}, peak=peak,
                       rss_peak_bytes=rss_peak_bytes(), metrics=metrics)
