"""GRPO steps with the FSDP2 learner on one device: step time, peak memory, and the dry-run ledger per role
next to what the allocator measured.

Run:  python bench/fsdp_ledger.py --device cuda --shape qwen2-0.5b --vocab qwen     (tests/gpu/run.sh)
      python bench/fsdp_ledger.py --device cpu --shape tiny                          (the same path on CPU)

The model is a random-weight Qwen2 built from a config (bench/_shapes.py; nothing is downloaded), the task
rlctl's built-in arithmetic. rlctl's real loop (rlctl.engine.loop.run_sync) runs ``--steps`` GRPO steps, one
call per step, with ``train.learner=fsdp2`` at ``world_size`` 1 (the sharding code path on one device: every
parameter is a DTensor over a 1-rank mesh), the local engine on the same device (colocated), bf16 compute
with fp32 master shards on CUDA (``--dtype``), no checkpoints or eval.

Memory per role: the roles' verbs run inside meter phases, exactly as the dry run's smoke step does
(rlctl.planning.dryrun): ``rollout`` = the engine's generate, ``train`` = the learner's train_step (+ reference
log-probs), ``sync`` = weight export and apply. On CUDA the meter is ``torch.cuda.max_memory_allocated``
(peak reset at each phase's start, so a phase's number includes what the other roles keep resident); on CPU
it counts live tensor bytes. The ledger is rlctl.planning.memory's, for this config and the response lengths the
steps really produced; ratio = ledger / measured (1.0 = exact, > 1 = the ledger over-predicts).
Step time: median of the steps after the first (the first one compiles kernels and fills allocator pools).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)
from _shapes import SHAPES, build_model_dir  # noqa: E402

import torch  # noqa: E402

ROLE = {"rollout": "rollout engine (generate)", "train": "learner (train_step)", "sync": "weight sync",
        "critic": "critic"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--shape", choices=tuple(SHAPES), default="qwen2-0.5b")
    p.add_argument("--vocab", choices=("char", "qwen"), default="qwen", help="Embedding rows (bench/_shapes.py).")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="Learner compute dtype (default: bf16 on "
                   "cuda, fp32 on cpu).")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--prompts", type=int, default=8, help="B: prompts per step.")
    p.add_argument("--group", type=int, default=4, help="G: samples per prompt.")
    p.add_argument("--max-tokens", type=int, default=64, help="Max new tokens per response.")
    p.add_argument("--micro-batch", type=int, default=8, help="Sequences per learner forward/backward.")
    p.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "rlctl-bench-models"),
                   help="Where the random-weight model directories are built (reused when present).")
    p.add_argument("--home", default=os.environ.get("RLCTL_HOME", str(Path("~/.rlctl").expanduser())))
    return p.parse_args(argv)


def config_for(args: argparse.Namespace, model_dir: Path) -> Any:
    from rlctl.config.load import load_config

    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return load_config(REPO / "configs" / "quickstart.yaml", [
        f"model.path={model_dir}", "train.seeds=1", f"train.steps={args.steps}", "train.learner=fsdp2",
        f"train.learner_options={{world_size: 1, dtype: {dtype}, rank_timeout_s: 600}}",
        f"train.device={args.device}", f"rollout.options.device={args.device}",
        f"algo.prompts_per_step={args.prompts}", f"algo.group_size={args.group}",
        f"algo.micro_batch_size={args.micro_batch}", f"rollout.max_tokens={args.max_tokens}",
        "train.optim.warmup_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.metric_sinks=[]",
    ])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec
    from rlctl.placement import place
    from rlctl.hooks.manager import load_plugins
    from rlctl.planning import dryrun as d
    from rlctl.planning import meter as m
    from rlctl.planning.memory import Placement, ledger

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but torch.cuda.is_available() is False; use --device cpu")
    model_dir, n_params = build_model_dir(args.shape, Path(args.models), args.vocab)
    config = config_for(args, model_dir)
    plugins = load_plugins()
    placement = place(config, plugins, cache_root=Path(args.home) / "cache")
    meter = m.make_meter(placement.roles)
    session = replace(placement.roles,
                      rollout=m.Phased(placement.roles.rollout, meter, {"generate": "rollout", "update_weights": "sync"}),
                      learner=m.Phased(placement.roles.learner, meter, {
                          "train_step": "train", "train_step_with_logprobs": "train", "export_weights": "sync",
                          "ref_logprobs": "train"}))
    times: list[float] = []
    longest = [1.0]
    try:
        with meter:
            for step in range(args.steps):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                metrics = run_sync(session, replace(LoopSpec.from_config(config), steps=step + 1), [], start_step=step)
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
                longest.append(float(metrics.get("response_length_max", 1.0)))
        # the meter resets the CUDA peak at each phase's start: the run's peak is the largest phase peak (or what
        # came after the last phase, within the same step)
        peak = (max([int(torch.cuda.max_memory_allocated()), *meter.peaks.values()]) if args.device == "cuda"
                else m.rss_peak_bytes())
    finally:
        placement.close()
    # the ledger at the lengths the steps really produced, allocator bytes (as the smoke step checks it)
    tokenizer = session.tokenizer
    shape = d.config_shape(config, tokenizer)
    prompt_max = max(len(tokenizer(p.text)["input_ids"]) for p in session.task.train)
    roles = d.role_memory(config, plugins, gpu_plan=False)
    strat = d.strategy(d.DryrunOptions(smoke=False, zero_stage=None), roles, gpu=False)
    work = replace(d.workload(config, prompt_max, roles), response_tokens=max(1, int(max(longest))))
    dev = ledger(shape, work, strat, Placement("colocate", 1, 1, 1), d.host_memory_bytes(), advise=False)[0]
    smoke = d.compare(dev, meter, sum(times), False, args.steps, dict(metrics))
    return {"params": n_params, "times": times, "peak": peak, "smoke": smoke, "meter": meter.kind,
            "strategy": strat.describe(), "device": _device_name(args.device), "metrics": metrics}


def _device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"CPU ({len(os.sched_getaffinity(0))} cores usable, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']})"


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    from rlctl.planning.memory import fmt_bytes

    times = out["times"]
    steady = times[1:] or times
    print(f"fsdp2 (world_size 1) GRPO on {out['device']}: Qwen2 {args.shape}, vocab {args.vocab}, "
          f"{out['params'] / 1e6:.1f}M parameters, {out['strategy']}; B={args.prompts} G={args.group} "
          f"max_tokens={args.max_tokens} micro-batch {args.micro_batch}")
    print(f"step time: median {statistics.median(steady):.3f} s over steps 2-{len(times)} "
          f"(all: {', '.join(f'{t:.3f}' for t in times)}); generated tokens/step "
          f"{out['metrics'].get('response_length_mean', 0) * args.prompts * args.group:.0f}")
    label = ("torch.cuda.max_memory_allocated, largest phase" if args.device == "cuda"
             else "peak RSS (whole process)")
    print(f"peak memory ({label}): {fmt_bytes(out['peak'])}")
    print(f"\ndry-run ledger vs measured per role ({out['meter']}); ratio = ledger / measured")
    print(f"{'phase':<14}{'role':<28}{'ledger':>12}{'measured':>12}{'ratio':>8}")
    smoke = out["smoke"]
    for c in (*smoke.phases, smoke.peak):
        ratio = c.ledger_bytes / c.measured_bytes if c.measured_bytes else float("nan")
        role = ROLE.get(c.phase, "the device's peak phase")
        print(f"{c.phase:<14}{role:<28}{fmt_bytes(c.ledger_bytes):>12}{fmt_bytes(c.measured_bytes):>12}{ratio:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report(args, run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
