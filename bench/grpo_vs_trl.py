"""Benchmark: rlctl's synchronous GRPO step vs Hugging Face TRL's GRPOTrainer, same model and settings, CPU.

Run:  OMP_NUM_THREADS=1 taskset -c 0 python bench/grpo_vs_trl.py [--model DIR ...] [--task TASKDIR]
          [--steps 10] [--prompts 16] [--group 8] [--max-tokens 12]
(needs the bench extra: pip install -e '.[bench]'; ``bench/make_model.py`` writes a ~1M-parameter Qwen2 DIR and
its TASKDIR locally)

Shapes, one table row each, all in one run: the quickstart's built-in tiny model (Llama shape, hidden 128, 4
layers, GQA 4/2 heads, MLP 384), warm-started once by rlctl (``--warm-start-steps`` SFT steps, cached under
RLCTL_HOME), on the built-in arithmetic task; then every ``--model DIR`` (a local Hugging Face causal-LM
directory with its tokenizer) on the task in ``--task TASKDIR`` (train/dev/hidden.jsonl, ``{"prompt",
"answer"}`` per line; default the built-in task). ``--no-builtin`` drops the built-in shape.

Settings (identical for both trainers): the task's train prompts; B prompts x G samples per step;
temperature 1, top-p 1, top-k off, at most ``--max-tokens`` new tokens; reward = math + 0.1 x format with a
response cut at max tokens scored 0 (rlctl's truncation rule, applied in TRL's reward function too); PPO clip
0.2, one epoch, one mini-batch, all B x G sequences in one micro-batch, no KL reference (beta = 0), token-mean
loss (TRL "dapo"), group-std advantage scaling, AdamW lr 5e-5 constant, grad clip 1.0, fp32, no activation
checkpointing (TRL's GRPOConfig turns it on by default; this bench turns it off since 2026-12-02).

Measurement: per shape, both trainers load the same directory and run interleaved in one process (TRL's
step-end callback runs one rlctl step), so both see the same machine load. A step's wall time is, for rlctl,
one call of its real loop (rlctl.engine.loop.run_sync) for one step: rollout, reward, advantages, learner,
weight sync, metrics; for TRL the time from ``on_step_begin`` to ``on_step_end`` (generation, reward, loss,
optimizer; its logging is excluded, which favours TRL slightly). The first ``--warmup`` steps of each are
dropped; the table shows medians and the ratio TRL step time / rlctl step time (> 1: rlctl is faster),
measured in the same run for that shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="Measured + warm-up steps per trainer.")
    p.add_argument("--warmup", type=int, default=2, help="Leading steps of each trainer not counted.")
    p.add_argument("--prompts", type=int, default=16, help="B: prompts per step.")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt.")
    p.add_argument("--max-tokens", type=int, default=12, help="Max new tokens per response.")
    p.add_argument("--warm-start-steps", type=int, default=300, help="SFT steps of the shared starting policy.")
    p.add_argument("--home", default=os.environ.get("RLCTL_HOME", str(Path("~/.rlctl").expanduser())),
                   help="RLCTL_HOME holding the warm-start cache.")
    p.add_argument("--model", action="append", default=[], metavar="DIR",
                   help="A local Hugging Face causal-LM directory to benchmark as another shape (repeatable).")
    p.add_argument("--task", metavar="TASKDIR",
                   help="Directory with train.jsonl, dev.jsonl, hidden.jsonl for the --model shapes.")
    p.add_argument("--no-builtin", action="store_true", help="Skip the built-in tiny model shape.")
    return p.parse_args(argv)


def rlctl_config(args: argparse.Namespace, model_dir: str | None = None, extra: tuple[str, ...] = ()) -> Any:
    """The quickstart config at the benchmark's settings; ``model_dir`` (with ``--task``) for another shape;
    ``extra`` overrides last."""
    from rlctl.config.load import load_config

    overrides = [
        f"model.warm_start.steps={args.warm_start_steps}", "model.warm_start.target_dev_accuracy=null",
        f"algo.prompts_per_step={args.prompts}",
        f"algo.group_size={args.group}", f"algo.micro_batch_size={args.prompts * args.group}",
        f"rollout.max_tokens={args.max_tokens}", "train.optim.warmup_steps=0", "train.optim.lr=5e-5",
        "eval.at_end=false", "checkpoint.every_steps=0", "train.metric_sinks=[]", f"train.steps={args.steps}",
    ]
    if model_dir is not None:
        overrides.append(f"model.path={model_dir}")
        if args.task:
            task = Path(args.task).resolve()
            overrides += ["task.source=jsonl", "task.options={train: %s, dev: %s, hidden: %s}"
                          % (task / "train.jsonl", task / "dev.jsonl", task / "hidden.jsonl")]
    return load_config(REPO / "configs" / "quickstart.yaml", [*overrides, *extra])


class RlctlStepper:
    """Runs rlctl's real loop (rlctl.engine.loop.run_sync) one step at a time and times each step."""

    def __init__(self, config: Any, home: Path, device: str = "cpu") -> None:
        from rlctl.placement import place
        from rlctl.hooks.manager import load_plugins

        self.placement = place(config, load_plugins(), cache_root=home / "cache")
        self.session = self.placement.roles
        self.done, self.times, self.tokens, self.device = 0, [], [], device

    def step(self) -> None:
        from dataclasses import replace

        from rlctl.engine.loop import run_sync
        from rlctl.engine.spec import LoopSpec

        s = self.session
        _sync(self.device)
        started = time.perf_counter()
        metrics = run_sync(s, replace(LoopSpec.from_config(s.config), steps=self.done + 1), [], start_step=self.done)
        _sync(self.device)
        self.times.append(time.perf_counter() - started)
        n = s.config.algo.prompts_per_step * s.config.algo.group_size
        self.tokens.append(metrics["response_length_mean"] * n)
        self.done += 1


def _sync(device: str) -> None:
    """Wait for queued GPU work, so a step's wall time includes its kernels."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def trl_reward(config: Any, eos_id: int) -> Any:
    """rlctl's configured mixed reward (math + format) as a TRL reward function, with the truncation rule."""
    from rlctl.contracts.types import SamplingConfig, TerminalReason
    from rlctl.placement.build import build_reward
    from rlctl.hooks.manager import load_plugins

    mixed = build_reward(config, load_plugins())
    sampling = SamplingConfig(max_tokens=config.rollout.max_tokens)
    penalty = config.rollout.truncation_penalty
    counted: list[int] = []

    def reward(completions: list[str], completion_ids: list[list[int]], answer: list[str],
               **_: Any) -> list[float]:
        out = []
        counted.append(sum(len(c) for c in completion_ids))
        for text, ids, ref in zip(completions, completion_ids, answer):
            ended = bool(ids) and ids[-1] == eos_id
            traj = SimpleNamespace(response_text=text, num_response_tokens=len(ids), sampling_config=sampling,
                                   terminal_reason=TerminalReason.EOS if ended else TerminalReason.LENGTH)
            result = mixed.score(traj, ref)
            out.append(penalty if (not ended and penalty is not None) else result.total)
        return out

    return reward, counted


def build_trl(config: Any, policy_dir: Path, task: Any, args: argparse.Namespace, on_step_end: Any,
              device: str = "cpu", bf16: bool = False) -> Any:
    """TRL's GRPOTrainer at the benchmark's settings; ``device="cuda"`` trains on the first GPU and ``bf16``
    turns on Trainer's bf16 autocast (fp32 weights and optimizer state, bf16 compute)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(policy_dir, local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(policy_dir, local_files_only=True, dtype=torch.float32)
    rows = list(task.train)
    data = Dataset.from_dict({"prompt": [r.text for r in rows], "answer": [r.answer for r in rows]})
    reward, counted = trl_reward(config, tokenizer.eos_token_id)
    reward.__name__ = "rlctl_mix"
    n = args.prompts * args.group
    cfg = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-bench-"), per_device_train_batch_size=n, gradient_accumulation_steps=1,
        num_generations=args.group, max_completion_length=args.max_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, epsilon=0.2, num_iterations=1, loss_type="dapo", scale_rewards="group",
        learning_rate=config.train.optim.lr, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_steps=args.steps, logging_steps=1,
        use_cpu=device == "cpu", report_to=[], save_strategy="no", seed=0, disable_dropout=True, bf16=bf16,
        dataloader_num_workers=0, log_completions=False,
        gradient_checkpointing=False,  # TRL's default is True; rlctl's learner does not recompute activations
    )

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.started = 0.0

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            _sync(device)
            self.started = time.perf_counter()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            _sync(device)
            self.times.append(time.perf_counter() - self.started)
            on_step_end()

    timer = Timer()
    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=cfg, train_dataset=data, processing_class=tokenizer,
                          callbacks=[timer])
    return trainer, timer, counted


def describe(model: Any) -> str:
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return (f"{c.model_type} h{c.hidden_size} L{c.num_hidden_layers} heads {c.num_attention_heads}/"
            f"{c.num_key_value_heads} MLP {c.intermediate_size}, {n / 1e6:.2f}M")


def bench_shape(args: argparse.Namespace, home: Path, model_dir: str | None) -> dict[str, Any]:
    """Both trainers on one model directory, interleaved; medians of the measured steps."""
    config = rlctl_config(args, model_dir)
    t0 = time.perf_counter()
    ours = RlctlStepper(config, home)
    print(f"setup: policy {ours.session.policy_dir} ({time.perf_counter() - t0:.1f}s incl. warm start if not cached)",
          flush=True)
    trainer, timer, counted = build_trl(config, ours.session.policy_dir, ours.session.task, args, ours.step)
    trainer.train()
    w = args.warmup
    out = {
        "shape": describe(trainer.model), "rl_t": statistics.median(ours.times[w:]),
        "trl_t": statistics.median(timer.times[w:]), "rl_tok": statistics.median(ours.tokens[w:]),
        "trl_tok": statistics.median(counted[w:len(timer.times)]), "n": len(ours.times) - w,
        "rl_times": ours.times, "trl_times": timer.times,
    }
    ours.placement.close()
    print(f"per-step times rlctl: {[round(x, 3) for x in ours.times]}")
    print(f"per-step times TRL:   {[round(x, 3) for x in timer.times]}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    home = Path(args.home).expanduser()
    shapes = ([None] if not args.no_builtin else []) + args.model
    results = [bench_shape(args, home, m) for m in shapes]
    n = args.prompts * args.group
    print(f"\nsync GRPO step, B={args.prompts} G={args.group} max_tokens={args.max_tokens}, median of "
          f"{results[0]['n']} steps each (rlctl and TRL interleaved per shape), "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, CPUs {sorted(os.sched_getaffinity(0))}")
    print(f"{'model':<44}{'rlctl s':>9}{'TRL s':>9}{'TRL/rlctl':>10}{'rlctl tok/s':>12}{'TRL tok/s':>11}"
          f"{'tok/step':>10}")
    for r in results:
        print(f"{r['shape']:<44}{r['rl_t']:>9.3f}{r['trl_t']:>9.3f}{r['trl_t'] / r['rl_t']:>10.2f}"
              f"{r['rl_tok'] / r['rl_t']:>12.0f}{r['trl_tok'] / r['trl_t']:>11.0f}"
              f"{r['rl_tok']:>5.0f}/{r['trl_tok']:<4.0f}")
    print(f"(completions/s = {n} / step time; tok/step = generated tokens per step, rlctl/TRL)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
