"""Benchmark: the learner and critic steps with padded vs packed micro-batches (``train.micro_batch_tokens``), CPU.

Run:  OMP_NUM_THREADS=1 taskset -c 0 python bench/learner_packing.py [--quick] [--repeats 5] [--prompts 4]
      [--group 8] [--budget 1024] [--shapes 0.8M,25M]

Setup: random-weight Llama models built locally (nothing downloaded) with rlctl's character tokenizer:
``0.8M`` = the quickstart's built-in shape (hidden 128, 4 layers, 4/2 heads, MLP 384, vocabulary 99) and
``25M`` (hidden 512, 8 layers, 8/4 heads, MLP 1536). One synthetic batch per workload: ``--prompts`` prompts
of 6-12 tokens, each with ``--group`` responses (the G rows of a group share their prompt, as in GRPO), random
tokens, advantages +1/-1 alternating, behaviour log-probs from the model itself (ratios start at 1).
Workloads: ``long-tail`` (response lengths ceil(4 U^(-1/1.2)), a Pareto(alpha 1.2, minimum 4) draw capped at
``--cap`` 256 tokens, the local engine's ``length_tail_alpha`` law) and ``equal`` (every response
``--equal-len`` 64 tokens).

Steps compared, each ``TorchLearner.train_step`` (PPO-clip, token-mean, one optimizer step) on the same batch
from the same weights, interleaved over ``--repeats`` repeats after one warm-up:

- ``padded``: today's default, micro-batches of ``micro_batch_size`` = the whole batch, each distinct prompt
  prefilled once and its KV cache shared by its G responses (``share_prompt_prefill``), responses padded to
  the longest in the micro-batch;
- ``padded, no prefill sharing``: every row padded to the batch's longest sequence;
- ``packed``: ``micro_batch_tokens=--budget``, whole sequences end to end, no padding, each distinct prompt
  forwarded once and attended to by its G responses (``share_prompt_prefill``, the default);
- ``packed, no prefill sharing``: every sequence forwards its own prompt;
- ``critic padded`` / ``critic packed``: PPO's torch critic (``TorchCritic.train_step``: one epoch of the
  clipped value loss, one AdamW step) on the same batch, micro-batches of the whole batch padded, or packed
  under the same budget (the critic never shares prompts).

Columns: median seconds per step, the packed/padded speed ratios (> 1 = packed faster) taken in the same run:
default packed vs default padded, the two without prefill sharing against each other, and the two critics;
the share of real tokens in the padded batch; the number of packed micro-batches.
``torch.set_num_threads(1)``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402,F401  (one thread, offline; must precede torch)

import torch  # noqa: E402

SHAPES: dict[str, dict[str, int]] = {
    "0.8M": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=384),
    "25M": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                intermediate_size=1536),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="2 prompts x 8, 3 repeats: a smoke run (~1 min)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--budget", type=int, default=1024, help="train.micro_batch_tokens of the packed learner")
    p.add_argument("--cap", type=int, default=256, help="longest long-tail response")
    p.add_argument("--equal-len", type=int, default=64, help="response length of the equal workload")
    p.add_argument("--shapes", default="0.8M,25M")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.repeats = 2, 3
    return args


def model_dir(shape: str, root: Path) -> tuple[Path, int]:
    """A random-weight Llama of ``shape`` and the character tokenizer, saved under ``root``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlctl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), max_position_embeddings=512, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True,
                      **SHAPES[shape])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    out = root / shape
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def response_lengths(workload: str, n: int, args: argparse.Namespace, gen: torch.Generator) -> list[int]:
    if workload == "equal":
        return [args.equal_len] * n
    u = torch.rand(n, generator=gen, dtype=torch.float64).clamp(min=1e-12)
    return [int(x) for x in (4 * u.pow(-1.0 / 1.2)).ceil().clamp(max=args.cap).tolist()]


def make_batch(workload: str, args: argparse.Namespace, vocab: int) -> Any:
    """One right-padded TrainBatch: G rows per prompt sharing it, random tokens (never pad/bos/eos ids)."""
    from rlctl.contracts.batch import TrainBatch
    from rlctl.contracts.types import SamplingConfig

    gen = torch.Generator().manual_seed(args.seed)
    n = args.prompts * args.group
    prompts = [torch.randint(4, vocab, (int(torch.randint(6, 13, (1,), generator=gen)),), generator=gen)
               for _ in range(args.prompts)]
    lengths = response_lengths(workload, n, args, gen)
    width = max(len(prompts[i // args.group]) + lengths[i] for i in range(n))
    ids = torch.zeros((n, width), dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    act = torch.zeros((n, width))
    for i in range(n):
        p, r = prompts[i // args.group], lengths[i]
        ids[i, :len(p)] = p
        ids[i, len(p):len(p) + r] = torch.randint(4, vocab, (r,), generator=gen)
        attn[i, :len(p) + r] = 1
        act[i, len(p):len(p) + r] = 1
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(n)])[:, None] * act
    return TrainBatch(input_ids=ids, attention_mask=attn, action_mask=act, behavior_logprobs=torch.zeros_like(act),
                      advantages=adv, sampling=SamplingConfig(temperature=1.0, max_tokens=args.cap),
                      trajectory_ids=tuple(str(i) for i in range(n)), policy_versions=(0,) * n)


def learners(directory: Path, n: int, budget: int) -> dict[str, Any]:
    from rlctl.config.models import AlgoConfig, OptimConfig
    from rlctl.contracts.types import LearnerContext
    from rlctl.kit import TorchLearner, TorchLearnerOptions

    ctx = LearnerContext(model_dir=str(directory), algo=AlgoConfig(micro_batch_size=n), optim=OptimConfig(lr=1e-5),
                         seed=0, max_response_tokens=256, device="cpu")
    return {"padded": TorchLearner(ctx, TorchLearnerOptions()),
            "padded, no prefill sharing": TorchLearner(ctx, TorchLearnerOptions(share_prompt_prefill=False)),
            "packed": TorchLearner(replace(ctx, micro_batch_tokens=budget), TorchLearnerOptions()),
            "packed, no prefill sharing": TorchLearner(replace(ctx, micro_batch_tokens=budget),
                                                       TorchLearnerOptions(share_prompt_prefill=False))}


def critics(directory: Path, n: int, budget: int) -> dict[str, Any]:
    """PPO's torch critic on ``directory``, padded and packed under ``budget``."""
    from rlctl.config.models import CriticConfig, OptimConfig
    from rlctl.contracts.types import CriticContext
    from rlctl_torch_learner.critic import TorchCritic

    ctx = CriticContext(model_dir=str(directory), critic=CriticConfig(), optim=OptimConfig(), seed=0,
                        micro_batch_size=n)
    return {"critic padded": TorchCritic(ctx), "critic packed": TorchCritic(replace(ctx, micro_batch_tokens=budget))}


def time_steps(steps: dict[str, Any], repeats: int) -> dict[str, float]:
    """Median seconds of each step (a callable) over ``repeats`` interleaved repeats, after one warm-up."""
    times: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(repeats + 1):
        for name, run in steps.items():
            t = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v[1:]) for k, v in times.items()}


def run_case(shape: str, directory: Path, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    n = args.prompts * args.group
    steps = learners(directory, n, args.budget)
    vocab = steps["packed"].model.config.vocab_size
    batch = make_batch(workload, args, vocab)
    batch = replace(batch, behavior_logprobs=steps["padded"].logprobs(batch) * batch.action_mask)
    value = critics(directory, n, args.budget)
    returns = batch.advantages.clone()  # any targets on the trained tokens: the timing does not depend on them
    old = value["critic padded"].values(batch)
    runs = {name: (lambda lrn=lrn: lrn.train_step(batch)) for name, lrn in steps.items()}
    runs.update({name: (lambda c=c: c.train_step(batch, returns, old)) for name, c in value.items()})
    med = time_steps(runs, args.repeats)
    real = int(batch.attention_mask.sum())
    lens = batch.action_mask.sum(-1)
    micro = len(list(steps["packed"]._micro_batches(batch)))
    return {"shape": shape, "workload": workload, "rows": n, "width": int(batch.input_ids.shape[1]),
            "real": real / batch.attention_mask.numel(), "resp_mean": float(lens.mean()),
            "resp_max": int(lens.max()), "micro": micro, **med}


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\nlearner step, padded vs packed (micro_batch_tokens={args.budget}), {args.prompts} prompts x "
          f"{args.group}, median of {args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}")
    print(f"{'shape':<6}{'workload':<11}{'resp mean/max':>14}{'real':>6}{'mb':>4}{'padded s':>10}{'packed s':>10}"
          f"{'packed/padded':>14}{'no-share: padded s':>20}{'packed s':>10}{'ratio':>7}"
          f"{'critic: padded s':>18}{'packed s':>10}{'ratio':>7}")
    for r in rows:
        pad, pack = r["padded"], r["packed"]
        pad_ns, pack_ns = r["padded, no prefill sharing"], r["packed, no prefill sharing"]
        pad_c, pack_c = r["critic padded"], r["critic packed"]
        print(f"{r['shape']:<6}{r['workload']:<11}{r['resp_mean']:>8.1f}/{r['resp_max']:<5}{r['real']:>6.0%}"
              f"{r['micro']:>4}{pad:>10.3f}{pack:>10.3f}{pad / pack:>13.2f}x{pad_ns:>20.3f}{pack_ns:>10.3f}"
              f"{pad_ns / pack_ns:>6.2f}x{pad_c:>18.3f}{pack_c:>10.3f}{pad_c / pack_c:>6.2f}x")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes.split(","):
            if shape not in SHAPES:
                raise SystemExit(f"error: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
            directory, params = model_dir(shape, Path(tmp))
            print(f"{shape}: {params / 1e6:.2f}M parameters", flush=True)
            for workload in ("long-tail", "equal"):
                rows.append(run_case(shape, directory, workload, args))
                print(f"  {workload}: done", flush=True)
    print_table(rows, args)
    assert all(math.isfinite(r["packed"]) for r in rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
