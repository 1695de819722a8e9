"""Sweep the quickstart's GRPO settings on the DEV split and print one table row per setting.

Each row is ``rlctl train configs/quickstart.yaml eval.split=dev <overrides> --seeds N``
run through the same library call (rlctl.lifecycle.seeds.train_seeds), from the one
cached warm start the quickstart config builds: dev greedy pass@1 of the warm
start, after RL, the gain with its paired bootstrap 95% CI per seed, and the
pooled CI when N > 1. The hidden split is never touched here; it is for the
final number only.

    OMP_NUM_THREADS=1 python scripts/sweep_quickstart.py --seeds 1
    OMP_NUM_THREADS=1 python scripts/sweep_quickstart.py --seeds 2 --only 2,3 --home /tmp/sweep-home
    OMP_NUM_THREADS=1 python scripts/sweep_quickstart.py --grid ppo --metrics explained_variance,value_loss

``--grid`` picks one of GRIDS below (``grpo``, the quickstart's own sweep, by
default; one per other estimator, each row's overrides on top of the
quickstart config); ``--only`` picks rows by index. ``--metrics`` adds, per
run, each named training metric's mean over the first and the last 10 steps
(e.g. a critic's value loss falling). Runs go into the registry under
``--home`` (default $RLCTL_HOME).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Overrides on top of configs/quickstart.yaml; row 0 of "grpo" is the quickstart's own setting, row 0 of every
# other grid is the quickstart with only the estimator switched. Each grid sweeps lr and the estimator's own knob.
GRIDS: dict[str, list[list[str]]] = {
    "grpo": [
        [],
        ["train.optim.lr=1e-5"],
        ["train.optim.lr=4e-5"],
        ["train.optim.lr=1e-4"],
        ["train.steps=100"],
        ["algo.prompts_per_step=32", "train.steps=40"],
        ["rollout.temperature=0.7"],
    ],
    # Why 60 GRPO steps from a 40%-dev warm start gained on one machine and not on another, and what gains from
    # more than one warm start (docs/results.md). Every row names its warm start in full:
    # W40 = target 40% (the earlier quickstart), W30 = target 30% (now the default), W30s1 = the same with SFT seed 1.
    "robust": [
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60"],  # 0: W40, the earlier quickstart
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60", "rollout.temperature=0.7"],
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60", "rollout.temperature=0.5"],
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60", "algo.prompts_per_step=32"],
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60", "algo.group_size=16"],
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60", "algo.group_size=16",
         "algo.prompts_per_step=32"],
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=30", "algo.prompts_per_step=64",
         "train.optim.lr=1e-4"],
        ["model.warm_start.target_dev_accuracy=0.4", "train.steps=60", "algo.ppo_epochs=2", "algo.num_mini_batches=2"],
        ["train.steps=60"],  # 8: W30
        ["model.warm_start.seed=1", "train.steps=60"],  # 9: W30s1
        ["model.warm_start.seed=1", "train.steps=60", "algo.prompts_per_step=32"],
        ["model.warm_start.seed=1", "train.steps=60", "train.optim.lr=4e-5"],
        ["model.warm_start.seed=1", "train.steps=60", "algo.group_size=16"],
        ["train.steps=120"],
        ["model.warm_start.seed=1", "train.steps=120"],
        [],  # 15: W30, 100 steps: the quickstart now
        ["model.warm_start.seed=1"],  # 16: W30s1, 100 steps
        ["train.steps=60", "train.optim.lr=1e-6"],  # 17: control: a near-zero step in the reward's direction
        ["model.warm_start.target_dev_accuracy=0.4"],  # 18: W40, 100 steps
        ["model.warm_start.target_dev_accuracy=0.5", "train.steps=60"],  # 19: W50
    ],
    # The recipe sweeps (docs/algorithms.md): from the quickstart's warm start and step count, every estimator's
    # row 0 is the quickstart's lr 2e-5, rows 1-2 lr 1e-5 / 4e-5, row 3 its own knob at 2e-5. Run with --seeds 3.
    "ppo": [
        ["algo.name=ppo"],  # the quickstart's algo.critic block: 10 critic-only warm-up steps
        ["algo.name=ppo", "train.optim.lr=1e-5"],
        ["algo.name=ppo", "train.optim.lr=4e-5"],
        ["algo.name=ppo", "algo.critic.warmup_steps=0"],
    ],
    # The critic on partial credit: run with --config configs/quickstart-ppo-credit.yaml (row 0: that recipe as is;
    # docs/algorithms.md, "PPO on partial credit"): a 5x longer critic warm-up, a lower critic lr.
    "ppo_credit": [
        [],
        ["algo.critic.warmup_steps=50"],
        ["algo.critic.lr=3e-4", "algo.critic.warmup_steps=50"],
    ],
    "rloo": [
        ["algo.name=rloo"],
        ["algo.name=rloo", "train.optim.lr=1e-5"],
        ["algo.name=rloo", "train.optim.lr=4e-5"],
        ["algo.name=rloo", "algo.group_size=4", "algo.prompts_per_step=32"],
    ],
    "dr_grpo": [
        ["algo.name=dr_grpo"],
        ["algo.name=dr_grpo", "train.optim.lr=1e-5"],
        ["algo.name=dr_grpo", "train.optim.lr=4e-5"],
        ["algo.name=dr_grpo", "algo.loss_agg=token-mean"],
    ],
    "reinforce_pp": [
        ["algo.name=reinforce_pp"],
        ["algo.name=reinforce_pp", "train.optim.lr=1e-5"],
        ["algo.name=reinforce_pp", "train.optim.lr=4e-5"],
        ["algo.name=reinforce_pp", "algo.kl.coef=0.01", "algo.kl.placement=reward"],
    ],
    "gspo": [
        ["algo.name=gspo"],
        ["algo.name=gspo", "train.optim.lr=1e-5"],
        ["algo.name=gspo", "train.optim.lr=4e-5"],
        ["algo.name=gspo", "algo.num_mini_batches=2"],  # 2 updates per batch: the sequence clip can bind
    ],
    "dapo": [
        ["algo.name=dapo"],
        ["algo.name=dapo", "train.optim.lr=1e-5"],
        ["algo.name=dapo", "train.optim.lr=4e-5"],
        ["algo.name=dapo", "algo.options.dynamic_sampling=false"],
    ],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--seeds", type=int, default=1, help="RL seeds per row (from the same warm start).")
    parser.add_argument("--grid", default="grpo", choices=sorted(GRIDS), help="Which grid of GRIDS to sweep.")
    parser.add_argument("--only", default="", help="Comma-separated row indices of the grid (default: all).")
    parser.add_argument("--metrics", default="", help="Comma-separated training metrics to summarise per run "
                        "(mean over the first and the last 10 steps).")
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
    from rlctl.lifecycle.seeds import train_seeds
    from rlctl.registry.store import Registry

    grid = GRIDS[args.grid]
    rows = [int(i) for i in args.only.split(",") if i.strip()] or list(range(len(grid)))
    names = [m.strip() for m in args.metrics.split(",") if m.strip()]
    plugins = load_plugins()
    home = rlctl_home()
    header = f"{'#':>2}  {'setting':<44} {'seed':>4}  {'dev start':>9}  {'after':>6}  {'gain':>6}  {'95% CI':>15}  wall"
    print(header, flush=True)
    with Registry.open() as registry:
        for index in rows:
            overrides = ["eval.split=dev", *args.extra, *grid[index]]
            config = load_config(args.config, overrides)
            started = time.perf_counter()
            result = train_seeds(config, args.seeds, registry=registry, plugins=plugins, home=home)
            wall = time.perf_counter() - started
            setting = " ".join(grid[index]) or "(quickstart)"
            for record, _ in result.evaluation.evals:
                run = registry.get_run(record.run_id)
                print(f"{index:>2}  {setting:<44} {run.seed:>4}  {record.baseline_pass_at_1 * 100:>8.1f}%  "
                      f"{record.candidate_pass_at_1 * 100:>5.1f}%  {record.diff * 100:>+6.1f}  "
                      f"[{record.ci_low * 100:+5.1f}, {record.ci_high * 100:+5.1f}]  {wall:.0f}s"
                      f"{_summary(registry, record.run_id, names)}", flush=True)
            pooled = result.evaluation.pooled
            if pooled is not None:
                print(f"{index:>2}  {setting:<44} {'all':>4}  {'':>9}  {'':>6}  {pooled.diff * 100:>+6.1f}  "
                      f"[{pooled.ci_low * 100:+5.1f}, {pooled.ci_high * 100:+5.1f}]", flush=True)
            print(f"    command: rlctl train {os.path.relpath(args.config, REPO)} {' '.join(overrides)} "
                  f"--seeds {args.seeds}", flush=True)
    return 0


def _summary(registry, run_id: str, names: list[str]) -> str:
    """``  name first10 -> last10`` per metric (NaN steps, e.g. an undefined explained variance, left out)."""
    import math

    out = []
    for name in names:
        values = [p.value for p in registry.metrics(run_id, [name]) if math.isfinite(p.value)]
        if not values:
            out.append(f"  {name} -")
            continue
        head, tail = values[:10], values[-10:]
        out.append(f"  {name} {sum(head) / len(head):.3f} -> {sum(tail) / len(tail):.3f}")
    return "".join(out)


if __name__ == "__main__":
    sys.exit(main())
