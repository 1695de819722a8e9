"""Sweep the quickstart's GRPO settings on the DEV split and print one table row per setting.

Each row is ``rlctl train configs/quickstart.yaml eval.split=dev <overrides> --seeds N``
run through the same library call (rlctl.ops.seeds.train_seeds), from the one
cached warm start the quickstart config builds: dev greedy pass@1 of the warm
start, after RL, the gain with its paired bootstrap 95% CI per seed, and the
pooled CI when N > 1. The hidden split is never touched here; it is for the
final number only.

    OMP_NUM_THREADS=1 python scripts/sweep_quickstart.py --seeds 1
    OMP_NUM_THREADS=1 python scripts/sweep_quickstart.py --seeds 2 --only 2,3 --home /tmp/sweep-home

The grid is GRID below (edit it to sweep other settings); ``--only`` picks rows
by index. Runs go into the registry under ``--home`` (default $RLCTL_HOME).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Overrides on top of configs/quickstart.yaml; row 0 is the quickstart's own setting.
GRID: list[list[str]] = [
    [],
    ["train.optim.lr=1e-5"],
    ["train.optim.lr=4e-5"],
    ["train.optim.lr=1e-4"],
    ["train.steps=100"],
    ["algo.prompts_per_step=32", "train.steps=40"],
    ["rollout.temperature=0.7"],
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--seeds", type=int, default=1, help="RL seeds per row (from the same warm start).")
    parser.add_argument("--only", default="", help="Comma-separated row indices of GRID to run (default: all).")
    parser.add_argument("--home", default=None, help="RLCTL_HOME for the runs and the warm-start cache.")
    parser.add_argument("extra", nargs="*", help="Overrides applied to every row (e.g. train.steps=30).")
    args = parser.parse_args()
    if args.home:
        os.environ["RLCTL_HOME"] = args.home
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    from rlctl.cli._options import rlctl_home
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.ops.seeds import train_seeds
    from rlctl.registry.store import Registry

    rows = [int(i) for i in args.only.split(",") if i.strip()] or list(range(len(GRID)))
    plugins = load_plugins()
    home = rlctl_home()
    header = f"{'#':>2}  {'setting':<44} {'seed':>4}  {'dev start':>9}  {'after':>6}  {'gain':>6}  {'95% CI':>15}  wall"
    print(header, flush=True)
    with Registry.open() as registry:
        for index in rows:
            overrides = ["eval.split=dev", *args.extra, *GRID[index]]
            config = load_config(args.config, overrides)
            started = time.perf_counter()
            result = train_seeds(config, args.seeds, registry=registry, plugins=plugins, home=home)
            wall = time.perf_counter() - started
            setting = " ".join(GRID[index]) or "(quickstart)"
            for record, _ in result.evaluation.evals:
                run = registry.get_run(record.run_id)
                print(f"{index:>2}  {setting:<44} {run.seed:>4}  {record.baseline_pass_at_1 * 100:>8.1f}%  "
                      f"{record.candidate_pass_at_1 * 100:>5.1f}%  {record.diff * 100:>+6.1f}  "
                      f"[{record.ci_low * 100:+5.1f}, {record.ci_high * 100:+5.1f}]  {wall:.0f}s", flush=True)
            pooled = result.evaluation.pooled
            if pooled is not None:
                print(f"{index:>2}  {setting:<44} {'all':>4}  {'':>9}  {'':>6}  {pooled.diff * 100:>+6.1f}  "
                      f"[{pooled.ci_low * 100:+5.1f}, {pooled.ci_high * 100:+5.1f}]", flush=True)
            print(f"    command: rlctl train {os.path.relpath(args.config, REPO)} {' '.join(overrides)} "
                  f"--seeds {args.seeds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
