"""Benchmark: rlctl's GRPO step time vs TRL's GRPOTrainer, same random-weight model and settings, CPU or CUDA.

Run:  python bench/trl_step_time.py --device cpu --shape tiny --shape small          (CPU, two shapes)
      python bench/trl_step_time.py --device cuda --shape qwen2-0.5b --vocab qwen    (tests/gpu/run.sh)
(needs the bench extra: pip install -e '.[bench]'; TRL 1.16.0, accelerate 1.15.0, datasets 5.2.0)

Models: random-weight Qwen2 directories built from a config (bench/_shapes.py: ``tiny`` 0.13M, ``small``
1.0M, ``qwen2-0.5b`` = Qwen2-0.5B's layout, 494M with ``--vocab qwen``), rlctl's character tokenizer, its
built-in arithmetic task. Nothing is downloaded and nothing is warm-started: the point is the cost of a
step, not learning (random models mostly run to ``--max-tokens``).

Settings, identical for both trainers (bench/grpo_vs_trl.py's, which this reuses): B prompts x G samples
per step, temperature 1, top-p 1, top-k off, at most ``--max-tokens`` new tokens, reward math + 0.1 x format,
PPO clip 0.2, one epoch, one mini-batch, all B x G sequences in one micro-batch, no KL reference, token-mean
loss, group-std advantages, AdamW lr 5e-5 constant, grad clip 1.0, no activation checkpointing on either
(TRL's default would recompute activations). Precision (``--dtype``, default fp32 on
CPU, bf16 on CUDA): fp32 is fp32 on both; bf16 is rlctl's torch learner with bf16 parameters, an fp32 master
copy and fp32 AdamW, against TRL with Trainer's ``bf16=True`` (autocast over fp32 weights and AdamW). The
rlctl learner is the single-process ``torch`` learner, the one-device equivalent of TRL's trainer.

Measurement: per shape, both trainers load the same directory and run interleaved in one process (TRL's
step-end callback runs one rlctl step), so both see the same machine load. rlctl's step is one call of its
real loop (rollout, reward, advantages, learner, weight sync, metrics); TRL's is ``on_step_begin`` to
``on_step_end`` (its logging excluded). On CUDA both are bracketed by ``torch.cuda.synchronize``. The first
``--warmup`` steps of each are dropped; medians; ratio = TRL step time / rlctl step time (> 1: rlctl faster).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402,F401  (one thread, offline; must precede torch)
from _shapes import SHAPES, build_model_dir  # noqa: E402
from grpo_vs_trl import RlctlStepper, build_trl, describe, rlctl_config  # noqa: E402

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--shape", action="append", choices=tuple(SHAPES), help="Model shape (repeatable; default "
                   "tiny and small).")
    p.add_argument("--vocab", choices=("char", "qwen"), default="char", help="Embedding rows (bench/_shapes.py).")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="Default: float32 on cpu, bfloat16 on cuda.")
    p.add_argument("--steps", type=int, default=8, help="Measured + warm-up steps per trainer.")
    p.add_argument("--warmup", type=int, default=2, help="Leading steps of each trainer not counted.")
    p.add_argument("--prompts", type=int, default=8, help="B: prompts per step.")
    p.add_argument("--group", type=int, default=4, help="G: samples per prompt.")
    p.add_argument("--max-tokens", type=int, default=16, help="Max new tokens per response.")
    p.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "rlctl-bench-models"),
                   help="Where the random-weight model directories are built (reused when present).")
    p.add_argument("--home", default=os.environ.get("RLCTL_HOME", str(Path("~/.rlctl").expanduser())))
    args = p.parse_args(argv)
    args.shape = args.shape or ["tiny", "small"]
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.task, args.warm_start_steps = None, 0  # what grpo_vs_trl.rlctl_config reads: built-in task, no SFT
    if args.steps <= args.warmup:
        p.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    return args


def bench_shape(args: argparse.Namespace, shape: str) -> dict[str, Any]:
    model_dir, _ = build_model_dir(shape, Path(args.models), args.vocab)
    config = rlctl_config(args, str(model_dir), (
        "train.seeds=1", f"train.device={args.device}", f"rollout.options.device={args.device}",
        f"train.learner_options.dtype={args.dtype}"))
    home = Path(args.home).expanduser()
    ours = RlctlStepper(config, home, device=args.device)
    trainer, timer, counted = build_trl(config, ours.session.policy_dir, ours.session.task, args, ours.step,
                                        device=args.device, bf16=args.dtype == "bfloat16")
    if getattr(trainer.model, "is_activation_checkpointing", False):
        raise SystemExit("error: TRL's model recomputes activations (activation checkpointing on) but rlctl's "
                         "learner does not; the settings would not be equal")
    trainer.train()
    ours.session.rollout.close()
    w = args.warmup
    out = {"shape": f"{shape}: {describe(trainer.model)}", "rl_t": statistics.median(ours.times[w:]),
           "trl_t": statistics.median(timer.times[w:]), "rl_tok": statistics.median(ours.tokens[w:]),
           "trl_tok": statistics.median(counted[w:len(timer.times)]), "n": len(ours.times) - w}
    print(f"{shape} per-step times rlctl: {[round(x, 3) for x in ours.times]}")
    print(f"{shape} per-step times TRL:   {[round(x, 3) for x in timer.times]}", flush=True)
    del trainer, ours
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = [bench_shape(args, s) for s in args.shape]
    where = (torch.cuda.get_device_name(0) if args.device == "cuda"
             else f"CPU, OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, CPUs {sorted(os.sched_getaffinity(0))}")
    print(f"\nGRPO step, {where}, {args.dtype}, B={args.prompts} G={args.group} max_tokens={args.max_tokens}, "
          f"median of {results[0]['n']} steps each (rlctl and TRL interleaved per shape)")
    print(f"{'model':<58}{'rlctl s':>9}{'TRL s':>9}{'TRL/rlctl':>10}{'tok/step rlctl/TRL':>20}")
    for r in results:
        print(f"{r['shape']:<58}{r['rl_t']:>9.3f}{r['trl_t']:>9.3f}{r['trl_t'] / r['rl_t']:>10.2f}"
              f"{r['rl_tok']:>14.0f}/{r['trl_tok']:<5.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
