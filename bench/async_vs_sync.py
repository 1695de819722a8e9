"""Benchmark: sync vs one-step-off vs async GRPO at an equal prompt budget, with predicted vs measured staleness.

Run:  OMP_NUM_THREADS=1 python bench/async_vs_sync.py [--steps 16] [--workload quickstart,longtail]
      [--placement local] [--modes sync,one_step_off,async1,async2] [--hidden 200]

Setup: the quickstart config (built-in tiny model warm-started for ``--warm-start-steps`` SFT steps, cached
under RLCTL_HOME), B prompts x G samples per step, ``--steps`` steps per mode, so every mode samples the same
number of responses (the generated-token budget is equal up to the sampled lengths, printed per row).
Workloads: ``quickstart`` (responses of a few tokens) and ``longtail`` (the local engine's
``length_tail_alpha`` option keeps each row decoding to a Pareto(alpha)-distributed length, capped at
``--tail-max-tokens``: real decode work with a heavy tail; the trained responses are unchanged).

Modes: ``sync`` is today's loop (rlctl.engine.loop.run_sync, the baseline); the others run the overlapped
driver (rlctl.engine.async_loop) with ``cluster.num_rollout_workers`` threads (``--placement local``) or Ray
actors (``--placement ray``): ``one_step_off``, ``async1`` (async, max_staleness 1), ``async2`` (2).

Columns: wall time of the training loop (model building excluded), trained response tokens per second of
wall time (every mode trains steps x B x G responses), effective tokens/s (those of samples with a non-zero
advantage; the long-tail padding decoded after a response ended is work, not tokens, and is in neither), hidden pass@1 (greedy, ``--hidden`` prompts) and its
paired-bootstrap 95% CI of the difference to sync, mean and P95 measured Δv, and the staleness simulator's
prediction (rlctl.ops.staleness, fed with the sync run's own T_r / T_l / T_s and lengths). Ratios are to the
sync row of the same workload, measured in the same invocation. One run per mode (not a median over
repeats): on a shared 2-core machine expect run-to-run noise of 10-20%.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)

MODES = {"sync": ("sync", 0), "one_step_off": ("one_step_off", 1), "async1": ("async", 1), "async2": ("async", 2)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--prompts", type=int, default=16, help="B")
    p.add_argument("--group", type=int, default=8, help="G")
    p.add_argument("--workers", type=int, default=2, help="rollout workers of the overlapped modes")
    p.add_argument("--workload", default="quickstart,longtail")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--placement", default="local", choices=("local", "ray"))
    p.add_argument("--tail-alpha", type=float, default=1.2)
    p.add_argument("--tail-min", type=int, default=2)
    p.add_argument("--tail-max-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=200, help="hidden prompts graded per mode")
    p.add_argument("--warm-start-steps", type=int, default=600)
    p.add_argument("--home", default=os.environ.get("RLCTL_HOME", str(Path("~/.rlctl").expanduser())))
    return p.parse_args(argv)


def config_for(args: argparse.Namespace, workload: str, mode: str, bound: int) -> Any:
    from rlctl.config.load import load_config

    overrides = [
        f"model.warm_start.steps={args.warm_start_steps}", f"algo.prompts_per_step={args.prompts}",
        f"algo.group_size={args.group}", f"algo.micro_batch_size={args.prompts * args.group}",
        "train.optim.warmup_steps=0", "eval.at_end=false", "checkpoint.every_steps=0", "train.metric_sinks=[]",
        f"train.steps={args.steps}", f"mode={mode}", f"staleness.max_staleness={max(bound, 0)}",
        f"cluster.backend={args.placement}", f"cluster.num_rollout_workers={args.workers}",
    ]
    if workload == "longtail":
        overrides += [f"rollout.max_tokens={args.tail_max_tokens}", f"rollout.options.length_tail_alpha={args.tail_alpha}",
                      f"rollout.options.length_tail_min={args.tail_min}"]
    return load_config(REPO / "configs" / "quickstart.yaml", overrides)


class Sink:
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def write(self, step: int, metrics: Any) -> None:
        self.rows.append(dict(metrics))

    def close(self) -> None:
        pass


def run_mode(args: argparse.Namespace, workload: str, name: str, plugins: Any, home: Path, task: Any) -> dict:
    from rlctl.engine.eval import grade_policy
    from rlctl.engine.loop import run_sync
    from rlctl.engine.session import build_session

    mode, bound = MODES[name]
    config = config_for(args, workload, mode, bound)
    session = build_session(config, plugins, cache_root=home / "cache", task=task)
    sink = Sink()
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        if name == "sync":
            from rlctl.engine.loop import LoopSpec

            run_sync(session, LoopSpec.from_config(config), [sink])
        else:
            from rlctl.dist import run_overlapped

            run_overlapped(session, plugins, Path(tmp), [sink])
        wall = time.perf_counter() - started
        policy = Path(tmp) / "policy"
        session.learner.save_pretrained(str(policy))
        session.tokenizer.save_pretrained(str(policy))
        session.rollout.close()
        eval_config = config.model_copy(update={"rollout": config.rollout.model_copy(update={"options": {}})})
        scores = grade_policy(name, policy, eval_config, plugins, task, task.hidden[: args.hidden])
    return {"name": name, "wall": wall, "rows": sink.rows, "scores": scores, "config": config}


def main(argv: list[str] | None = None) -> None:
    from rlctl.engine.eval import paired_bootstrap
    from rlctl.engine.session import load_task, resolve_policy_dir
    from rlctl.hooks.manager import load_plugins
    from rlctl.ops.staleness import predict_for_run

    args = parse_args(argv)
    home = Path(args.home)
    plugins = load_plugins()
    for workload in args.workload.split(","):
        base = config_for(args, workload, "sync", 0)
        task = load_task(base, plugins)
        resolve_policy_dir(base, task, home / "cache")  # warm start once, outside the timings
        results = [run_mode(args, workload, name, plugins, home, task) for name in args.modes.split(",")]
        sync = next(r for r in results if r["name"] == "sync")
        smoke = {k: statistics.median(r[k] for r in sync["rows"][1:] or sync["rows"])
                 for k in ("T_r", "T_l", "T_s", "response_length_mean", "response_length_max")}
        print(f"\n## {workload}: {args.steps} steps x {args.prompts} prompts x G={args.group}, "
              f"placement {args.placement}, {args.workers} workers (sync: 1 engine)")
        header = ("mode", "wall s", "x sync", "trained tok/s", "x sync", "eff tok/s", "x sync", "hidden pass@1",
                  "diff vs sync [95% CI]", "dv mean", "dv P95", "pred dv mean", "pred dv P95", "drops")
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in results:
            rows = r["rows"]
            n_rows = [m.get("groups_trained", args.prompts) * args.group for m in rows]
            tokens = sum(m["response_length_mean"] * n for m, n in zip(rows, n_rows))
            eff = sum(m["response_length_mean"] * n * m["esr"] for m, n in zip(rows, n_rows))
            r["gen_tps"], r["eff_tps"] = tokens / r["wall"], eff / r["wall"]
            cmp = paired_bootstrap(sync["scores"].correct, r["scores"].correct)
            dv = [m.get("staleness_mean", 0.0) for m in rows] if r["name"] != "sync" else [0.0]
            p95 = max(m.get("staleness_p95", 0.0) for m in rows) if r["name"] != "sync" else 0.0
            if r["name"] == "sync":
                pred_mean, pred_p95 = 0.0, 0.0
            else:
                pred = predict_for_run(r["config"], smoke).prediction
                pred_mean, pred_p95 = pred.staleness_mean, pred.staleness_p95
            drops = sum(rows[-1].get(f"queue_drops_{k}", 0.0) for k in ("stale", "ttl", "orphaned"))
            print(f"| {r['name']} | {r['wall']:.1f} | {sync['wall'] / r['wall']:.2f} | {r['gen_tps']:.0f} | "
                  f"{r['gen_tps'] / sync['gen_tps']:.2f} | {r['eff_tps']:.0f} | {r['eff_tps'] / sync['eff_tps']:.2f} | "
                  f"{r['scores'].pass_at_1:.3f} | {cmp.diff:+.3f} [{cmp.ci_low:+.3f}, {cmp.ci_high:+.3f}] | "
                  f"{statistics.mean(dv):.2f} | {p95:.0f} | {pred_mean:.2f} | {pred_p95:.0f} | {drops:.0f} |")
        print(f"(x sync for wall is sync wall / mode wall: > 1 is faster; the simulator used sync's T_r "
              f"{smoke['T_r']:.2f}s, T_l {smoke['T_l']:.2f}s, T_s {smoke['T_s']:.3f}s)")


if __name__ == "__main__":
    main()
