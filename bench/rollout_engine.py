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

``--mode slots``: the slot scheduler (``rollout.options.scheduler: slots``) vs the batch scheduler (today's
default) vs ``model.generate``, on the random-weight Qwen2 shapes of bench/_shapes.py (``--shapes``):

a. Long tail: ``--prompts`` x ``--group`` rows whose lengths follow a Pareto(``--alpha``, min 4) capped at
   ``--cap`` new tokens. The lengths are the distribution's quantiles at (i + 0.5) / N (so the longest rows
   do reach the cap), shuffled with seed 0, and each row gets its length as a fixed max_tokens with EOS
   ignored (an untrained model's EOS would end most rows within a few dozen tokens, and the bench is about
   the schedule, not the model). batch = ``sampler.sample`` with all rows in one forward (the engine's
   default max_batch_sequences 512): the call lasts as long as its longest row, finished rows leave the
   batch at 75 % live. slots S = ``slots.sample_slots`` on S slots. generate = ``model.generate`` to the cap
   (it has no per-row length): its padding past a row's length is waste. tokens/s = sum of the row lengths
   / time for every case.
b. Equal lengths: every row generates ``--new-tokens`` tokens (EOS ignored), 16 prompts x 8 samples (the
   prefill of a prompt shared by its 8 rows) and 128 distinct prompts x 1; slots = as many slots as rows.
"""

from __future__ import annotations

import argparse
import math
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
    p.add_argument("--mode", choices=("default", "slots"), default="default")
    p.add_argument("--shapes", default="tiny,small", help="--mode slots: bench/_shapes.py shapes")
    p.add_argument("--slots", default="32,64", help="--mode slots: slot counts for the long tail")
    p.add_argument("--prompts", type=int, default=32, help="--mode slots: long-tail prompts")
    p.add_argument("--group", type=int, default=8, help="--mode slots: long-tail samples per prompt")
    p.add_argument("--alpha", type=float, default=1.2, help="--mode slots: Pareto tail index")
    p.add_argument("--cap", type=int, default=256, help="--mode slots: longest response")
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


def pareto_lengths(n: int, alpha: float, cap: int, minimum: int = 4) -> list[int]:
    """The Pareto(alpha, minimum) quantiles at (i + 0.5) / n, capped, in a seed-0 shuffled order."""
    import random

    lengths = [min(cap, math.ceil(minimum * (1 - (i + 0.5) / n) ** (-1 / alpha))) for i in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


def slot_cases(model: Any, tok: Any, rows: list[list[int]], lengths: list[int], slot_counts: list[int],
               repeats: int) -> dict[str, float]:
    from transformers import GenerationConfig

    from rlctl.contracts.types import SamplingConfig
    from rlctl_local_engine.sampler import sample
    from rlctl_local_engine.slots import sample_slots
    from rlctl_local_engine.streams import row_key

    cap = max(lengths)
    sampling = SamplingConfig(temperature=1.0, max_tokens=cap)
    keys = [row_key(0, 1, i) for i in range(len(rows))]
    ids, mask = _left_pad(rows, tok.pad_token_id)
    gen_cfg = GenerationConfig(do_sample=True, max_new_tokens=cap, min_new_tokens=cap, temperature=1.0, top_k=0,
                               top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=None)
    work = sum(lengths)

    def checked(out: Any) -> int:
        assert [len(t) for t in out.tokens] == lengths, "a row did not run to its own length"
        return work

    cases: dict[str, Callable[[], int]] = {
        "batch": lambda: checked(sample(model, rows, sampling, eos_id=-1, pad_id=tok.pad_token_id,
                                        generator=torch.Generator().manual_seed(0), max_lengths=lengths)),
    }

    def chunked(size: int) -> int:  # the engine with max_batch_sequences = size: forwards of size rows, in order
        for start in range(0, len(rows), size):
            out = sample(model, rows[start: start + size], sampling, eos_id=-1, pad_id=tok.pad_token_id,
                         generator=torch.Generator().manual_seed(0), max_lengths=lengths[start: start + size])
            assert [len(t) for t in out.tokens] == lengths[start: start + size]
        return work

    for s in slot_counts:
        if s < len(rows):
            cases[f"batch {s}"] = lambda s=s: chunked(s)
        cases[f"slots {s}"] = lambda s=s: checked(sample_slots(model, rows, keys, sampling, eos_id=-1, num_slots=s,
                                                               max_lengths=lengths))

    def generate() -> int:
        model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        return work

    cases["generate"] = generate
    return _interleave(cases, repeats)


def slots_main(args: argparse.Namespace) -> int:
    import tempfile

    from _shapes import SHAPES, build_model_dir
    from rlctl.models.load import load_policy

    tmp = Path(tempfile.mkdtemp(prefix="slot-bench-"))
    slot_counts = [int(s) for s in args.slots.split(",")]
    n = args.prompts * args.group
    lengths = pareto_lengths(n, args.alpha, args.cap)
    print(f"\nslots vs batch vs model.generate; OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}, "
          f"median of {args.repeats}, load average at start {os.getloadavg()[0]:.2f}")
    print(f"long tail: {args.prompts} prompts x {args.group} = {n} rows, Pareto(alpha {args.alpha}, min 4) capped "
          f"at {args.cap}: mean {statistics.fmean(lengths):.1f}, median {statistics.median(lengths):.0f}, "
          f"max {max(lengths)}, {sum(x == args.cap for x in lengths)} rows at the cap; EOS ignored")
    print(f"\n{'shape':>6}{'workload':>22}{'scheduler':>12}{'tokens/s':>10}{'x batch':>9}{'x batch S':>11}"
          f"{'x generate':>12}")
    for shape in args.shapes.split(","):
        model_dir, params = build_model_dir(shape, tmp)
        model, tok = load_policy(model_dir)
        prompts = [tok(f"{i} + {3 * i + 7} = ")["input_ids"] for i in range(128)]
        label = f"{shape} ({SHAPES[shape]['hidden_size']}h {SHAPES[shape]['num_hidden_layers']}L {params / 1e6:.2f}M)"
        print(label)
        rows = [prompts[i] for i in range(args.prompts) for _ in range(args.group)]
        _slot_rows(shape, "long tail", slot_cases(model, tok, rows, lengths, slot_counts, args.repeats))
        for workload, rows in ((f"16 x 8, {args.new_tokens} tokens", [prompts[i] for i in range(16) for _ in range(8)]),
                               (f"128 x 1, {args.new_tokens} tokens", prompts[:128])):
            r = slot_cases(model, tok, rows, [args.new_tokens] * len(rows), [len(rows)], args.repeats)
            _slot_rows(shape, workload, r)
    return 0


def _slot_rows(shape: str, workload: str, r: dict[str, float]) -> None:
    """One line per scheduler: x batch = vs all rows in one forward; x batch S = vs forwards of S rows."""
    for name, rate in r.items():
        same = r.get(f"batch {name.split()[-1]}") if name.startswith("slots") else None
        vs_chunked = f"{rate / same:>11.2f}" if same else f"{'':>11}"
        print(f"{shape:>6}{workload:>22}{name:>12}{rate:>10,.0f}{rate / r['batch']:>9.2f}{vs_chunked}"
              f"{rate / r['generate']:>12.2f}")


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    if args.mode == "slots":
        return slots_main(args)
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
