"""The critic's training metrics per PPO run of an ablation (or of the given runs): explained variance early and late.

For each run with an ``explained_variance`` metric (``algo.name: ppo``): its mean over the first 10 steps, its
median over the late half of the run (the steps after the middle one), its max, and the value loss first 10 -> last
10 steps. The metric is the critic's own (values vs GAE returns over response tokens, before its update:
docs/algorithms.md, "How explained_variance is computed"). Reads the registry ($RLCTL_HOME or --registry).

    python scripts/critic_metrics.py abl-20261203-181000-123abc
    python scripts/critic_metrics.py --runs RUN_ID RUN_ID
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ids", nargs="+", help="An ablation id (or, with --runs, run ids).")
    parser.add_argument("--runs", action="store_true", help="The ids are run ids, not an ablation's.")
    parser.add_argument("--registry", default=None, help="SQLAlchemy URL (default: RLCTL_REGISTRY_URL or $RLCTL_HOME).")
    args = parser.parse_args()

    from rlctl.registry.ablations import AblationStore
    from rlctl.registry.store import Registry

    with Registry.open(args.registry) as registry:
        if args.runs:
            rows = [("-", registry.get_run(i).seed, i) for i in args.ids]
        else:
            rows = [(r.cell, r.seed, r.run_id) for i in args.ids for r in AblationStore(registry).runs(i) if r.run_id]
        print(f"{'cell':<14}{'seed':>5}  {'run':<28}{'EV first 10':>12}{'EV late median':>16}{'EV max':>8}"
              f"  value loss first 10 -> last 10")
        lates = []
        for cell, seed, run_id in rows:
            ev = [p.value for p in registry.metrics(run_id, ["explained_variance"]) if math.isfinite(p.value)]
            if not ev:
                continue
            vl = [p.value for p in registry.metrics(run_id, ["value_loss"]) if math.isfinite(p.value)]
            late = statistics.median(ev[len(ev) // 2:])
            lates.append(late)
            print(f"{cell:<14}{seed:>5}  {run_id:<28}{statistics.fmean(ev[:10]):>12.3f}{late:>16.3f}{max(ev):>8.3f}"
                  f"  {statistics.fmean(vl[:10]):.4f} -> {statistics.fmean(vl[-10:]):.4f}")
        if lates:
            print(f"late medians: mean {statistics.fmean(lates):.3f}, min {min(lates):.3f} over {len(lates)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
