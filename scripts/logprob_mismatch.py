"""Engine vs learner logprob mismatch of finished runs, per run, from their metrics.jsonl.

    python scripts/logprob_mismatch.py $RLCTL_HOME/runs/<run> [$RLCTL_HOME/runs/<run> ...]

Every training step records ``logprob_mismatch_max`` and ``logprob_mismatch_mean``: |behaviour
logprob from the rollout engine - the learner's recomputation| over the step's tokens, before the
update. Per run (rollout backend and RL seed from its config.json) this prints the largest per-step
max, the median per-step max, the mean and largest per-step mean, and the median rollout and sync
times (``T_r``, ``T_s``). docs/vllm.md compares the local engine with vLLM this way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def summary(run_dir: Path) -> dict[str, object]:
    config = json.loads((run_dir / "config.json").read_text())
    config = config.get("config", config)
    steps = [json.loads(line)["metrics"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    worst = [m["logprob_mismatch_max"] for m in steps]
    mean = [m["logprob_mismatch_mean"] for m in steps]
    return {"run": run_dir.name, "backend": config["rollout"]["backend"], "seed": config["run"]["seed"],
            "steps": len(steps), "max_max": max(worst), "median_max": statistics.median(worst),
            "mean_mean": statistics.fmean(mean), "max_mean": max(mean),
            "T_r": statistics.median(m["T_r"] for m in steps), "T_s": statistics.median(m["T_s"] for m in steps)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="run directories (with metrics.jsonl and config.json)")
    args = parser.parse_args()
    missing = [str(r) for r in args.runs if not (r / "metrics.jsonl").is_file() or not (r / "config.json").is_file()]
    if missing:
        print(f"error: no metrics.jsonl and config.json in {', '.join(missing)}", file=sys.stderr)
        print("hint: pass run directories, e.g. $RLCTL_HOME/runs/<run id> (`rlctl runs list` names them)",
              file=sys.stderr)
        return 1
    print("| run | backend | seed | steps | logprob_mismatch_max: largest | median step | "
          "logprob_mismatch_mean: mean | largest | T_r median | T_s median |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        s = summary(run)
        print(f"| {s['run']} | {s['backend']} | {s['seed']} | {s['steps']} | {s['max_max']:.1e} | {s['median_max']:.1e} "
              f"| {s['mean_mean']:.1e} | {s['max_mean']:.1e} | {s['T_r']:.3f} s | {s['T_s']:.3f} s |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
