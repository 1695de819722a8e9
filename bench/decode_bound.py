"""Benchmark: where the local engine's batch-128 decode spends its time, and the best ratio to ``model.generate``
that fp32 allows on this machine.

Run:  OMP_NUM_THREADS=1 taskset -c 0 python bench/decode_bound.py [--shapes quickstart,25m] [--rows 128]
      [--new-tokens 64] [--repeats 3] [--markdown FILE]

For each shape (bench/engines.py's random-init Llama directories: the quickstart's 0.8M and a 25.7M one), the
workload is ``--rows`` distinct arith prompts x ``--new-tokens`` fixed tokens (EOS ignored), one core:

1. tokens/s of rlctl's local engine and of ``model.generate(do_sample=True)``, median of ``--repeats``
   interleaved repeats (bench/engines.py's engines, the same tokens checked);
2. one more local run under ``torch.profiler``: the self time of its GEMMs (the projections and the LM head:
   ``mkldnn::_linear_pointwise``, ``aten::mm``/``addmm``) and of its attention over the KV cache
   (``aten::bmm``, softmax, the prefill's SDPA); the rest is norms, RoPE, sampling and bookkeeping;
3. the GEMMs' achieved FLOP/s (2 x matmul parameters x tokens through them, from the model config) against
   this machine's fp32 and bf16 GEMM roofline (rlctl.planning.roofline.measure_gemm, 512^3), and the
   attention's KV-cache read rate (bytes of keys and values each decode step reads);
4. the bound: ``generate`` time / (local GEMM time + local attention time) = the ratio to ``model.generate``
   the engine would reach if everything but its GEMMs and attention took no time at all. ``generate`` runs the
   same products (unfused) and the same attention, so a bound under 2 means 2x ``model.generate`` at fp32 needs
   fewer or cheaper FLOPs (lower precision), not less overhead;
5. what lower precision does for the baseline: ``model.generate`` on a bf16 copy of the model (timed with the
   others; the local engine has no bf16 path: it decodes fp32 models only, numerically equal to the learner).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402, F401  (one thread, offline; must precede torch)

import torch  # noqa: E402

import engines  # noqa: E402

GEMM_OPS = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm")
ATTENTION_OPS = ("aten::bmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default="quickstart,25m", help="comma list of bench/engines.py shapes")
    p.add_argument("--rows", type=int, default=128, help="distinct prompts, one sample each (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens every row generates (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timing repeats (default 3)")
    p.add_argument("--markdown", help="also write the table as markdown to this file")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in args.shapes if s not in engines.SHAPES]
    if unknown or args.rows < 1 or args.new_tokens < 2 or args.repeats < 1:
        p.error(f"--shapes takes {', '.join(engines.SHAPES)}; --rows >= 1, --new-tokens >= 2, --repeats >= 1"
                + (f" (unknown shape: {', '.join(unknown)})" if unknown else ""))
    return args


def self_seconds(run: Any) -> dict[str, float]:
    """Self CPU seconds of one ``run()`` under torch.profiler, by op name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}


def workload_flops(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """(GEMM FLOPs, KV-cache bytes read by attention) of one call: prefill over the padded prompts (the LM head
    on the last position only), then ``new_tokens - 1`` decode steps over every row."""
    from rlctl.planning.shapes import from_hf_config

    shape = from_hf_config(model.config.to_dict(), "bench", "bench")
    rows, width = len(prompts), max(map(len, prompts))
    layer_matmul = shape.layer_params - 2 * shape.hidden_size  # without the two RMSNorm gains
    head = shape.vocab_size * shape.hidden_size
    decode = new_tokens - 1
    flops = 2.0 * (layer_matmul * shape.num_layers * rows * (width + decode) + head * rows * new_tokens)
    contexts = sum(width + t + 1 for t in range(decode))  # keys each decode step attends to, summed
    kv_bytes = 2.0 * shape.num_layers * shape.kv_dim * rows * contexts * model.dtype.itemsize
    return flops, kv_bytes


def bench_shape(shape: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    _, model, tok, prompts = engines.model_dir(shape, root)
    rows = prompts[: args.rows]
    if len(rows) < args.rows:
        raise SystemExit(f"error: the arith task has {len(rows)} train prompts; pass --rows {len(rows)} or fewer")
    lengths = [args.new_tokens] * len(rows)
    local = engines.local_engine(model, tok, rows, lengths)
    generate = engines.hf_generate(model, tok, rows, lengths)
    generate_bf16 = engines.hf_generate(copy.deepcopy(model).to(torch.bfloat16), tok, rows, lengths)
    rates = engines.interleave({"local": local, "generate": generate, "generate_bf16": generate_bf16}, args.repeats,
                               sum(lengths))
    ops = self_seconds(local)
    gemm = sum(ops.get(k, 0.0) for k in GEMM_OPS)
    attention = sum(ops.get(k, 0.0) for k in ATTENTION_OPS)
    profiled = sum(ops.values())
    flops, kv_bytes = workload_flops(model, rows, args.new_tokens)
    generate_s = sum(lengths) / rates["generate"]
    print(f"{shape}: local {rates['local']:,.0f} tok/s, generate {rates['generate']:,.0f}; profiled local "
          f"{profiled:.2f} s (GEMM {gemm:.2f}, attention {attention:.2f})", flush=True)
    return {"shape": shape, "local": rates["local"], "generate": rates["generate"],
            "generate_bf16": rates["generate_bf16"], "profiled": profiled,
            "gemm": gemm, "attention": attention, "gemm_flops": flops / gemm, "kv_rate": kv_bytes / attention,
            "bound": generate_s / (gemm + attention)}


def render(rows: list[dict[str, Any]], fp32: float, bf16: float, caption: str) -> tuple[Any, str]:
    from rich.table import Table

    heads = ["shape", "local tok/s", "generate tok/s", "local / generate", "local profiled s", "GEMM s",
             "GEMM GFLOP/s (% fp32 roofline)", "attention s (KV GB/s)", "other s",
             "bound: generate s / (GEMM + attention) s", "generate bf16 tok/s (x generate)"]
    table = Table(title=f"batch decode at fp32, one core; GEMM roofline fp32 {fp32 / 1e9:.0f} GFLOP/s, "
                  f"bf16 {bf16 / 1e9:.0f} GFLOP/s", caption=caption)
    for h in heads:
        table.add_column(h, justify="left" if h == "shape" else "right")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in rows:
        cells = [r["shape"], f"{r['local']:,.0f}", f"{r['generate']:,.0f}", f"{r['local'] / r['generate']:.2f}",
                 f"{r['profiled']:.4f}", f"{r['gemm']:.4f}",
                 f"{r['gemm_flops'] / 1e9:.1f} ({100 * r['gemm_flops'] / fp32:.0f}%)",
                 f"{r['attention']:.4f} ({r['kv_rate'] / 1e9:.1f})",
                 f"{r['profiled'] - r['gemm'] - r['attention']:.4f}", f"{r['bound']:.2f}",
                 f"{r['generate_bf16']:,.0f} ({r['generate_bf16'] / r['generate']:.2f})"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    return table, "\n".join(lines) + f"\n\n{caption}\n"


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    from rlctl.planning.roofline import measure_gemm

    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="decode-bound-"))
    os.environ.setdefault("RLCTL_HOME", str(root / "home"))
    load_before, started = os.getloadavg(), time.time()
    threads = torch.get_num_threads()
    fp32, bf16 = measure_gemm("float32", threads), measure_gemm("bfloat16", threads)
    rows = [bench_shape(shape, args, root) for shape in args.shapes]
    load_after = os.getloadavg()
    command = "OMP_NUM_THREADS=1 python bench/decode_bound.py " + " ".join(argv if argv is not None else sys.argv[1:])
    caption = (f"`{command}`: {args.rows} rows x {args.new_tokens} tokens; tok/s are medians of {args.repeats} "
               f"interleaved repeats, the split one profiled local run; {time.time() - started:.0f} s in all. "
               f"Load average (1 min) {load_before[0]:.2f} at the start, {load_after[0]:.2f} at the end, "
               f"on {os.cpu_count()} CPUs.")
    table, markdown = render(rows, fp32, bf16, caption)
    Console(width=200).print(table)
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
