"""Benchmark: a sharded learner's step with its ranks as Ray actors vs as local processes (CPU, gloo).

Run:  OMP_NUM_THREADS=1 python bench/sharded_ray.py [--shapes tiny small] [--repeats 7] [--prompts 8] [--group 4]

What one "step" is: what the overlapped loop asks of the learner per step, ``train_step_with_logprobs`` on
one rollout batch then ``export_weights`` (the gathered full weights for publishing), on the same FSDP2
learner (``world_size`` 2, fp32) whose ranks run

- ``local ranks`` (baseline): rank 0 in this process, rank 1 a spawned process (``cluster.backend=local``);
- ``Ray rank actors``: both ranks Ray actors of a local Ray cluster, the batch shipped through the object
  store, the exported weights left there (``cluster.backend=ray``; fetching them is the rollout actors' job
  and not timed here);
- ``torch, 1 process``: the one-process torch learner, for scale.

The models are random-weight Qwen2 shapes (bench/_shapes.py, character vocabulary; nothing is downloaded),
the batch one rollout of ``--prompts`` x ``--group`` sequences from rlctl's local engine with advantages +1/-1
alternating. Learners are built once; each repeat runs one step on each, interleaved, and the table gives the
median per learner and its ratio to the local ranks in the same run. Start-up (building the rank group) is
timed once per learner and shown apart.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)
from _shapes import SHAPES, build_model_dir  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["tiny", "small"], choices=[s for s in SHAPES if s != "qwen2-0.5b"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "rlctl-bench-models"))
    return p.parse_args(argv)


def batch_for(model_dir: Path, args: argparse.Namespace) -> tuple[Any, Any]:
    """(learner context, one rollout batch) for ``model_dir``, from the quickstart's settings."""
    from rlctl.config.load import load_config
    from rlctl.contracts.types import LearnerContext, RolloutContext, RolloutRequest
    from rlctl.engine.batching import build_batch
    from rlctl.placement.build import load_task, sampling_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.models.tokenizer import tokenizer_hash
    from transformers import AutoTokenizer

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [
        f"model.path={model_dir}", f"algo.prompts_per_step={args.prompts}", f"algo.group_size={args.group}",
        f"algo.micro_batch_size={args.prompts * args.group}", f"rollout.max_tokens={args.max_tokens}",
        "train.optim.warmup_steps=0"])
    plugins = load_plugins()
    task = load_task(cfg, plugins)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    engine = plugins.build("rollout_backend", "local", {}, "rollout.options",
                           ctx=RolloutContext(model_dir=str(model_dir), tokenizer_hash=tokenizer_hash(model_dir), seed=0))
    sampling = sampling_config(cfg)
    requests = [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(tok(p.text)["input_ids"]), group_size=args.group,
                               sampling=sampling, dataset_version=task.version) for p in task.train[:args.prompts]]
    trajectories = engine.generate(requests)
    engine.close()
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(trajectories))]
    ctx = LearnerContext(model_dir=str(model_dir), algo=cfg.algo, optim=cfg.train.optim, seed=0,
                         max_response_tokens=args.max_tokens, device="cpu")
    return ctx, build_batch(trajectories, advantages, tok.pad_token_id, sampling)


def learners(ctx: Any) -> dict[str, tuple[Any, float]]:
    """name -> (learner, start-up seconds)."""
    from rlctl.config.models import ClusterConfig
    from rlctl.placement.ray_ranks import RayRanks
    from rlctl.kit import TorchLearner
    from rlctl_fsdp_learner.learner import FsdpLearner
    from rlctl_fsdp_learner.options import FsdpLearnerOptions

    out = {}
    options = FsdpLearnerOptions(world_size=2, rank_timeout_s=600)
    cluster = ClusterConfig(backend="ray", learner_num_cpus=0.5)
    for name, build in (("local ranks", lambda: FsdpLearner(ctx, options)),
                        ("Ray rank actors", lambda: FsdpLearner(replace(ctx, rank_launcher=partial(RayRanks, cluster)),
                                                                options)),
                        ("torch, 1 process", lambda: TorchLearner(ctx))):
        started = time.perf_counter()
        out[name] = (build(), time.perf_counter() - started)
    return out


def step(learner: Any, batch: Any) -> float:
    started = time.perf_counter()
    learner.train_step_with_logprobs(batch)
    learner.export_weights()
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    import ray
    from rich.console import Console
    from rich.table import Table

    args = parse_args(argv)
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    table = Table(title=f"sharded learner step (train_step_with_logprobs + export_weights), FSDP2 world_size 2, "
                        f"B={args.prompts} G={args.group}, median of {args.repeats}")
    for col in ("shape", "params", "learner", "step (s)", "vs local ranks", "start-up (s)"):
        table.add_column(col, justify="right" if col not in ("shape", "learner") else "left")
    console = Console()
    try:
        for shape in args.shapes:
            model_dir, n = build_model_dir(shape, Path(args.models))
            ctx, batch = batch_for(model_dir, args)
            built = learners(ctx)
            times: dict[str, list[float]] = {name: [] for name in built}
            for r in range(args.repeats + 1):  # the first round warms up and is dropped
                for name, (learner, _) in built.items():
                    t = step(learner, batch)
                    if r:
                        times[name].append(t)
                console.print(f"{shape}: round {r + 1}/{args.repeats + 1}", style="dim")
            base = statistics.median(times["local ranks"])
            for name, (learner, startup) in built.items():
                med = statistics.median(times[name])
                table.add_row(shape, f"{n / 1e6:.2f}M", name, f"{med:.3f}", f"{med / base:.2f}x", f"{startup:.1f}")
                close = getattr(learner, "close", None)
                if close is not None:
                    close()
    finally:
        ray.shutdown()
    console.print(table)


if __name__ == "__main__":
    main()
