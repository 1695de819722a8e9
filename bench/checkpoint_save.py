"""Checkpoint save cost for the quickstart model: sync save time vs how long an async save blocks a step.

Run:  OMP_NUM_THREADS=1 python bench/checkpoint_save.py [--repeats N] [--config configs/quickstart.yaml]

What it does: builds the quickstart session (model shape, batch and rollout
settings of the config; the SFT warm start is skipped because the weights'
values do not change the cost), runs a few GRPO steps to warm up, then
measures, as the median of N:

  - the step time with no checkpoint,
  - a synchronous save (snapshot + write + fsync + verify + commit), as a
    fraction of the step time,
  - an asynchronous save taken after every step: how long it blocks the loop
    (the snapshot copy, plus any wait for the previous save) as a fraction of
    the step time, how long the background write takes, and the step time
    while a save runs beside it.

Everything is measured, nothing estimated; the machine's load is printed with
the numbers because other processes on a shared box move them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "quickstart.yaml"))
    parser.add_argument("--repeats", type=int, default=5, help="N: measurements per row (the median is shown)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    import torch

    from dataclasses import replace

    from rlctl.config.load import load_config
    from rlctl.engine.checkpoint import DiskCheckpointStore
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec
    from rlctl.placement import place
    from rlctl.engine.snapshot import Provenance, StepCheckpointer, capture, shadow_batch
    from rlctl.hooks.manager import load_plugins

    n = args.repeats
    with tempfile.TemporaryDirectory(prefix="rlctl-bench-") as tmp:
        root = Path(tmp)
        cfg = load_config(args.config, ["model.warm_start.enabled=false", f"train.steps={2 + 3 * n}",
                                        "checkpoint.every_steps=1"])
        session = place(cfg, load_plugins(), cache_root=root / "cache").roles
        provenance = Provenance(run_id="bench", config_hash="bench", code_version="bench")
        num_params = sum(p.numel() for p in session.learner.model.parameters())

        def steps(first: int, count: int, checkpointer=None) -> list[float]:
            stamps: list[float] = []
            before = time.perf_counter()
            run_sync(session, replace(LoopSpec.from_config(session.config), steps=first + count), [],
                     observer=lambda step, m: stamps.append(time.perf_counter()), start_step=first,
                     checkpoint=checkpointer)
            return [b - a for a, b in zip([before] + stamps[:-1], stamps)]

        steps(0, 2)  # warm up
        plain = steps(2, n)

        sync_store = DiskCheckpointStore(root / "sync", keep_last=1, async_save=False)
        shadow = shadow_batch(session)
        sync_s = []
        for i in range(n):
            started = time.perf_counter()
            sync_store.save(capture(session, 100 + i, {}, provenance, shadow))
            sync_s.append(time.perf_counter() - started)
        size = sum(f.stat().st_size for f in (root / "sync").rglob("*") if f.is_file())

        async_store = DiskCheckpointStore(root / "async", keep_last=1, async_save=True)
        write_s: list[float] = []
        original_write = async_store._write

        def timed_write(state, target):
            started = time.perf_counter()
            original_write(state, target)
            write_s.append(time.perf_counter() - started)

        async_store._write = timed_write  # type: ignore[method-assign]
        checkpointer = StepCheckpointer(session, async_store, provenance, every_steps=1, total_steps=10**9)
        with_async = steps(2 + n, n, checkpointer)
        checkpointer.close()

    step = statistics.median(plain)
    sync, block = statistics.median(sync_s), statistics.median(checkpointer.blocking_s)
    rows = [
        ("step time, no checkpoint", f"{step * 1000:.0f} ms", ""),
        ("sync save (blocks the step)", f"{sync * 1000:.0f} ms", f"{100 * sync / step:.1f}% of a step"),
        ("async save: time the step is blocked", f"{block * 1000:.1f} ms", f"{100 * block / step:.2f}% of a step"),
        ("async save: background write to commit", f"{statistics.median(write_s) * 1000:.0f} ms", ""),
        ("step time with an async save beside it", f"{statistics.median(with_async) * 1000:.0f} ms",
         f"{100 * (statistics.median(with_async) / step - 1):+.1f}% vs no checkpoint"),
    ]
    print(f"checkpoint save, {Path(args.config).name} model: {num_params / 1e6:.2f}M params, "
          f"checkpoint {size / 2**20:.1f} MiB, batch {cfg.algo.prompts_per_step}x{cfg.algo.group_size}, "
          f"median of {n}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"load avg {os.getloadavg()[0]:.1f}")
    width = max(len(r[0]) for r in rows)
    for label, value, note in rows:
        print(f"  {label:<{width}}  {value:>10}  {note}")
    verdict = "OK" if block <= 0.10 * step else "OVER BUDGET"
    print(f"async blocking {100 * block / step:.2f}% of a step (budget 10%): {verdict}")


if __name__ == "__main__":
    main()
