"""Benchmark: rlctl's local rollout engine vs plain ``model.generate``, and both against the CPU's GEMM roofline.

Run:  OMP_NUM_THREADS=1 python bench/rollout_engine.py [--repeats 5] [--new-tokens 64] [--long-tokens 128]

Model: the quickstart's built-in tiny Llama (hidden 128, 4 layers, 4/2 heads, MLP 384, vocabulary 99), random
init (seed 0); prompts are arithmetic-task prompts tokenized by the built-in character tokenizer. Sampling:
temperature 1, top-p 1, top-k off, fp32, one thread.

1. Fixed length: every row generates exactly ``--new-tokens`` tokens (EOS disabled on both sides), at batch
   1, 16 and 128. ``rlctl`` = the engine's sampler (plugins/rlctl_local_engine/sampler.py, static-cache fast
   path); ``rlctl HF path`` = the same sampler through the model's own forward (``fast=False``);
   ``generate`` = ``model.generate(do_sample=True)`` (transformers 5.24). tokens/s = rows x new tokens / time.
2. Long responses with natural EOS (``--long-tokens`` max new tokens, B x G = 4 x 4 and 16 x 8 rows, an
   untrained model so lengths spread over the whole range): the full ``LocalEngine.generate`` (Trajectory
   records included) vs ``model.generate``; tokens/s counts real tokens only (up to and including EOS), so
   padding work after a row finished is waste for whoever does it.

Roofline: ``GEMM GFLOP/s`` is the median fp32 throughput of a 1024 x 1024 x 1024 ``torch.mm`` measured in the
same run; the roofline for the model is that divided by its FLOPs per generated token (2 x matmul parameters
+ attention over the average context). "of roofline" = measured tokens/s / roofline tokens/s.

Every figure is a median over ``--repeats`` interleaved repeats (the machine is shared); ratios are taken in
the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)

import torch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,16,128")
    return p.parse_args(argv)


def gemm_flops(repeats: int) -> float:
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t)
    return 2 * 1024**3 / statistics.median(times[1:])


def flops_per_token(shape: Any, context: float) -> float:
    attention = 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * context  # QK^T and PV
    return shape.flops_per_token + attention


def tiny_model(tmp: Path) -> tuple[Any, Any, Any, list[list[int]]]:
    """The quickstart-shaped model saved as a HF directory (for LocalEngine) plus arithmetic prompts."""
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.models.load import build_tiny, load_policy
    from rlctl.models.tokenizer import build_char_tokenizer
    from rlctl.planning.shapes import builtin_shape

    cfg = load_config(REPO / "configs" / "quickstart.yaml", [])
    tok = build_char_tokenizer()
    model = build_tiny(cfg.model, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=0)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    model, tok = load_policy(tmp)
    task = load_plugins().build("task_source", "arith", cfg.task.options, "task.options", seed=0).load()
    prompts = [tok(p.text)["input_ids"] for p in task.train[:128]]
    return model, tok, builtin_shape(cfg.model, len(tok)), prompts


def timed(fn: Callable[[], int]) -> tuple[float, int]:
    t = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - t, tokens


def fixed_length(model: Any, tok: Any, prompts: list[list[int]], batch: int, new: int, repeats: int
                 ) -> dict[str, float]:
    from transformers import GenerationConfig

    from rlctl.contracts.types import SamplingConfig
    from rlctl_local_engine.sampler import sample

    rows = [prompts[i % len(prompts)] for i in range(batch)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=new)
    ids, mask = _left_pad(rows, tok.pad_token_id)
    gen_cfg = GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new, temperature=1.0, top_k=0,
                               top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=None)
    cases = {
        "rlctl": lambda: sum(map(len, sample(model, rows, sampling, eos_id=-1, pad_id=tok.pad_token_id,
                                             generator=torch.Generator().manual_seed(0)).tokens)),
        "rlctl HF path": lambda: sum(map(len, sample(model, rows, sampling, eos_id=-1, pad_id=tok.pad_token_id,
                                                     generator=torch.Generator().manual_seed(0), fast=False).tokens)),
        "generate": lambda: int(model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
                                [:, ids.shape[1]:].numel()),
    }
    return _interleave(cases, repeats)


def long_responses(model: Any, tok: Any, model_dir: Path, prompts: list[list[int]], new: int, repeats: int,
                   num_prompts: int, group: int) -> dict[str, float]:
    from transformers import GenerationConfig

    from rlctl.contracts.types import RolloutContext, RolloutRequest, SamplingConfig
    from rlctl_local_engine.engine import LocalEngine

    engine = LocalEngine(RolloutContext(model_dir=str(model_dir), tokenizer_hash="bench", seed=0))
    sampling = SamplingConfig(temperature=1.0, max_tokens=new)
    requests = [RolloutRequest(prompt_id=f"p{i}", prompt_tokens=tuple(p), group_size=group, sampling=sampling,
                               dataset_version="bench") for i, p in enumerate(prompts[:num_prompts])]
    rows = [list(r.prompt_tokens) for r in requests for _ in range(group)]
    ids, mask = _left_pad(rows, tok.pad_token_id)
    gen_cfg = GenerationConfig(do_sample=True, max_new_tokens=new, temperature=1.0, top_k=0, top_p=1.0,
                               pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)

    def generate() -> int:
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)[:, ids.shape[1]:]
        is_eos = out == tok.eos_token_id
        first = torch.where(is_eos.any(1), is_eos.int().argmax(1) + 1, torch.full((out.shape[0],), out.shape[1]))
        return int(first.sum())

    cases = {"rlctl LocalEngine": lambda: sum(t.num_response_tokens for t in engine.generate(requests)),
             "generate": generate}
    return _interleave(cases, repeats)


def _interleave(cases: dict[str, Callable[[], int]], repeats: int) -> dict[str, float]:
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in cases.items():
            seconds, tokens = timed(fn)
            rates[name].append(tokens / seconds)
    return {k: statistics.median(v) for k, v in rates.items()}


def _left_pad(rows: list[list[int]], pad: int) -> tuple[Any, Any]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    return ids, mask


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="rollout-bench-"))
    model, tok, shape, prompts = tiny_model(tmp)
    peak = gemm_flops(args.repeats)
    avg_prompt = statistics.fmean(map(len, prompts))
    roof = peak / flops_per_token(shape, avg_prompt + args.new_tokens / 2)
    print(f"\nGEMM (1024^3 fp32 torch.mm): {peak / 1e9:.1f} GFLOP/s -> roofline {roof:,.0f} tokens/s for "
          f"{flops_per_token(shape, avg_prompt + args.new_tokens / 2) / 1e6:.2f} MFLOP/token; "
          f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, median of {args.repeats}")
    print(f"\n1. fixed length: {args.new_tokens} new tokens per row, EOS disabled")
    print(f"{'batch':>6}{'rlctl tok/s':>14}{'HF path tok/s':>15}{'generate tok/s':>16}{'rlctl/generate':>16}"
          f"{'rlctl of roofline':>19}{'generate of roofline':>22}")
    for batch in (int(b) for b in args.batches.split(",")):
        r = fixed_length(model, tok, prompts, batch, args.new_tokens, args.repeats)
        print(f"{batch:>6}{r['rlctl']:>14,.0f}{r['rlctl HF path']:>15,.0f}{r['generate']:>16,.0f}"
              f"{r['rlctl'] / r['generate']:>16.2f}{r['rlctl'] / roof:>19.1%}{r['generate'] / roof:>22.1%}")
    print(f"\n2. long responses: up to {args.long_tokens} new tokens, natural EOS, real tokens/s")
    print(f"{'prompts x G':>12}{'rlctl LocalEngine':>20}{'generate':>12}{'ratio':>8}")
    for num_prompts, group in ((4, 4), (16, 8)):
        r = long_responses(model, tok, tmp, prompts, args.long_tokens, args.repeats, num_prompts, group)
        print(f"{f'{num_prompts} x {group}':>12}{r['rlctl LocalEngine']:>20,.0f}{r['generate']:>12,.0f}"
              f"{r['rlctl LocalEngine'] / r['generate']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
