"""The seeds' falsifiable experiment: 10% verifier timeouts vs raw tokens/s, ESR and effective tokens/s.

    OMP_NUM_THREADS=1 python bench/verifier_timeout_esr.py [--seeds 3] [--steps 12] [--rate 0.1]

Prediction (from the seeds): injecting verifier timeouts on a fraction p of the samples
leaves raw generated tokens/s unchanged, while ESR (effective sample ratio: samples that are
scored and carry a non-zero advantage, over samples generated) and effective tokens/s
(= raw x ESR) fall by about p.

Each seed trains the tiny config (deterministic CPU mode) three times from the same warm
start: without the fault, with `verifier-timeout` at rate p and no retries
(faults.verifier_retries=0), and with p and the default 2 retries. rlctl's policy is that a
sample the grader cannot score is never scored 0: its whole group is dropped and counted.
Values are read back from the run's registry metrics; per run the mean over its steps
(tokens/s: total tokens over total rollout time T_r), then the median over seeds. Ratios are to the fault-free row of the same seeds. The "predicted"
column gives the ESR ratio for three readings: per sample (1-p), per whole group of G without
retries ((1-p)^G), and per group with R retries ((1-p^(R+1))^G).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _setup  # noqa: F401  (one torch thread, offline, repo importable)

TINY = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
    "model.intermediate_size=64", "model.warm_start.steps=30", "model.warm_start.batch_size=16",
    "task.options.num_train=200", "task.options.num_dev=16", "task.options.num_hidden=16",
    "algo.group_size=4", "rollout.max_tokens=6", "eval.at_end=false", "train.deterministic=true",
    "train.metric_sinks=[]", "checkpoint.every_steps=0", "faults.alerts=false", "train.seeds=1",
    "model.warm_start.target_dev_accuracy=null",
]
METRICS = ("generated_tokens_per_s", "esr", "effective_tokens_per_s", "verifier_fail_frac", "groups_dropped", "T_r",
           "response_length_mean")


def run(tmp: Path, name: str, seed: int, steps: int, prompts: int, extra: list[str]) -> dict[str, float]:
    from rlctl.cli._options import rlctl_home
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    cfg = load_config(None, [*TINY, f"run.seed={seed}", f"train.steps={steps}", f"algo.prompts_per_step={prompts}",
                             f"run.name=esr-{name}-s{seed}", *extra])
    registry = Registry.open(f"sqlite:///{tmp / 'registry.db'}")
    run_dir = tmp / f"{name}-s{seed}"
    train(cfg, registry=registry, plugins=load_plugins(), home=rlctl_home(), run_dir=run_dir)
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    series: dict[str, dict[int, float]] = {}
    for point in registry.metrics(run_id, list(METRICS)):
        series.setdefault(point.name, {})[point.step] = point.value
    events = registry.events(run_id)
    out = {name: statistics.fmean(values.values()) for name, values in series.items()}
    # tokens/s pooled over the run (total tokens / total rollout time): per-step rates of a few ms are noise
    t_r = sum(series["T_r"].values())
    for name in ("generated_tokens_per_s", "effective_tokens_per_s"):
        out[name] = sum(rate * series["T_r"][step] for step, rate in series[name].items()) / t_r
    out["verifier_fail_frac"] = out.get("verifier_fail_frac", 0.0)
    out["group_drop_frac"] = out.get("groups_dropped", 0.0) / prompts
    out["dropped_events"] = float(sum(int(e.data.get("groups_dropped", 0)) for e in events
                                      if e.kind == "groups_dropped"))
    out["retry_events"] = float(sum(int(e.data.get("retries", 0)) for e in events if e.kind == "verifier_retry"))
    registry.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8, help="algo.prompts_per_step (B)")
    parser.add_argument("--rate", type=float, default=0.1)
    args = parser.parse_args()
    p, g = args.rate, 4
    fault = "faults.inject=" + json.dumps([{"kind": "verifier-timeout", "rate": p}])
    conditions = {
        "no fault": [],
        f"{p:.0%} timeouts, 0 retries": [fault, "faults.verifier_retries=0"],
        f"{p:.0%} timeouts, 2 retries": [fault, "faults.verifier_retries=2"],
    }
    predicted = {"no fault": "1.000", f"{p:.0%} timeouts, 0 retries": f"{1 - p:.3f} / {(1 - p) ** g:.3f}",
                 f"{p:.0%} timeouts, 2 retries": f"{1 - p:.3f} / {(1 - p ** 3) ** g:.3f}"}
    started = time.perf_counter()
    results: dict[str, list[dict[str, float]]] = {c: [] for c in conditions}
    with tempfile.TemporaryDirectory(prefix="rlctl-esr-") as tmp:
        for seed in range(1, args.seeds + 1):
            for name, extra in conditions.items():  # interleaved: the box's load hits every condition alike
                tag = name.split(",")[-1].strip().replace(" ", "")
                results[name].append(run(Path(tmp), tag if name != "no fault" else "base", seed, args.steps,
                                         args.prompts, extra))
                print(f"seed {seed} {name}: done ({time.perf_counter() - started:.0f}s)", file=sys.stderr)
    med = {c: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for c, rows in results.items()}
    base = med["no fault"]
    print(f"\nverifier-timeout rate p={p}, B={args.prompts} groups of G={g}, {args.steps} steps, {args.seeds} seeds; "
          f"per run mean over steps, median over seeds; ratio = vs no fault")
    head = (f"{'condition':<24}{'raw tok/s':>10}{'ratio':>7}{'ESR':>7}{'ratio':>7}{'eff tok/s':>10}{'ratio':>7}"
            f"{'resp len':>9}{'timed-out':>10}{'grp drop':>9}{'predicted ESR ratio (sample / group)':>38}")
    print(head)
    print("-" * len(head))
    for name, m in med.items():
        print(f"{name:<24}{m['generated_tokens_per_s']:>10.0f}{m['generated_tokens_per_s'] / base['generated_tokens_per_s']:>7.3f}"
              f"{m['esr']:>7.3f}{m['esr'] / base['esr']:>7.3f}{m['effective_tokens_per_s']:>10.0f}"
              f"{m['effective_tokens_per_s'] / base['effective_tokens_per_s']:>7.3f}"
              f"{m['response_length_mean']:>9.2f}{m['verifier_fail_frac']:>10.3f}{m['group_drop_frac']:>9.3f}{predicted[name]:>38}")
    print("\nregistry events (median over seeds): "
          + "; ".join(f"{name}: {med[name]['dropped_events']:.0f} groups dropped, {med[name]['retry_events']:.0f} "
                      f"retries" for name in conditions if name != "no fault"))
    print(f"wall time {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
