"""``rlctl profile``'s roofline: model FLOPs per token, this machine's GEMM throughput, % of it a stage reached.

What this is: ``forward_flops_per_token`` (2 x matmul parameters, lm_head
included, plus the attention term 4 x layers x heads x head_dim x context per
token), ``peak_flops`` (a short square-matmul benchmark at the run's dtype and
thread count, measured once per machine / torch / threads / dtype and cached
in ``roofline.json`` under RLCTL_HOME), and ``roofline_rows``: for rollout and
learner, the useful FLOPs per second of the stage time (real tokens only) as
a share of that throughput, and the padding waste (tokens computed but
discarded). The learner's forward + backward counts 3 forwards; its no-grad
forwards (reference, pi_old) count 1.

What this is not: a hardware peak (the roofline is what torch's GEMM reaches
on this machine, so a perfectly GEMM-bound stage reads ~100%) or an op-level
FLOP counter (attention's softmax, norms and sampling are not counted).
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from rlctl.planning.shapes import ModelShape

CACHE_FILE = "roofline.json"
LEARNER_PASS = 3.0  # forward + backward ~ 3 forwards
ROLLOUT_METRICS = ("rollout_sequences", "rollout_prompt_tokens", "rollout_real_tokens", "rollout_computed_tokens",
                   "rollout_prefill_tokens", "rollout_padding_waste")
PROBE_SHAPE = ModelShape(name="probe", num_layers=1, hidden_size=1, intermediate_size=1, num_heads=1, num_kv_heads=1,
                         head_dim=1, vocab_size=1, tie_embeddings=True)  # to ask roofline_rows whether rows exist
LEARNER_METRICS = ("learner_real_tokens", "learner_computed_tokens", "learner_flop_tokens", "learner_padding_waste")


def forward_flops_per_token(shape: ModelShape, context: float) -> float:
    """Forward FLOPs of one token that attends to ``context`` tokens (itself included).

    >>> s = ModelShape(name="t", num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2,
    ...                num_kv_heads=1, head_dim=16, vocab_size=99, tie_embeddings=True)
    >>> forward_flops_per_token(s, 0) == s.flops_per_token, forward_flops_per_token(s, 10) - s.flops_per_token
    (True, 2560.0)
    """
    return shape.flops_per_token + 4.0 * shape.num_layers * shape.num_heads * shape.head_dim * context


@dataclass(frozen=True, slots=True)
class Roofline:
    flops_per_s: float  # the machine's measured GEMM throughput
    key: str
    cached: bool  # True: read from the cache, not measured now
    path: str


def machine_key(dtype: str, threads: int, device: str = "cpu") -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    return f"{platform.node()}|{cpu}|{device}|torch {torch.__version__}|threads {threads}|{dtype}"


def measure_gemm(dtype: str, threads: int, size: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul at ``dtype`` on ``threads`` CPU threads (best of a short loop)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(size, size, generator=gen).to(getattr(torch, dtype))
        b = torch.randn(size, size, generator=gen).to(getattr(torch, dtype))
        a @ b  # warm-up
        best, deadline = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        return 2.0 * size**3 / best
    finally:
        torch.set_num_threads(before)


def peak_flops(cache_dir: Path, dtype: str = "float32", threads: int | None = None,
               measure: Callable[[str, int], float] = measure_gemm) -> Roofline:
    """This machine's GEMM FLOP/s at ``dtype`` and ``threads``: from ``cache_dir/roofline.json``, else measured
    now and stored there."""
    import torch

    threads = threads or torch.get_num_threads()
    key = machine_key(dtype, threads)
    path = Path(cache_dir) / CACHE_FILE
    try:
        cache = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        cache = {}  # a damaged cache is measured again and rewritten
    if key in cache:
        return Roofline(float(cache[key]["flops_per_s"]), key, True, str(path))
    value = measure(dtype, threads)
    cache[key] = {"flops_per_s": value, "measured_at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
    tmp.replace(path)
    return Roofline(value, key, False, str(path))


@dataclass(frozen=True, slots=True)
class StageRoofline:
    stage: str  # rollout | learner
    useful_flops: float  # on real tokens, summed over the steps
    seconds: float  # the stage's time (T_r or T_l), summed
    roofline_frac: float  # useful FLOP/s over the machine's GEMM FLOP/s
    padding_waste: float  # computed-but-discarded tokens / computed tokens
    real_tokens: float
    computed_tokens: float


def roofline_rows(shape: ModelShape, per_step: Sequence[Mapping[str, float]], peak: float) -> list[StageRoofline]:
    """Rollout (T_r) and learner (T_l) rows over the steps' metrics (those that logged the token counts).

    Useful FLOPs: rollout, forward FLOPs of each distinct prompt's prefill and each generated token; learner,
    of each real token per forward (3 for a forward with backward). The attention term uses the mean attended
    context, half a mean (prompt + response) sequence. Episodes: the rollout's real tokens are the policy's
    (decoded); the environment's are in its prefill and in the context (rlctl.engine.metrics.rollout_tokens).
    """
    rows = [m for m in per_step if all(k in m for k in (*ROLLOUT_METRICS, *LEARNER_METRICS, "T_r", "T_l"))]
    if not rows:
        return []
    total = lambda k: sum(m[k] for m in rows)  # noqa: E731
    seqs = total("rollout_sequences")
    env = sum(m.get("episode_env_tokens", 0.0) for m in rows)  # an episode's context holds its tools' answers
    ctx = (total("rollout_prompt_tokens") + total("rollout_real_tokens") + env) / seqs / 2.0 if seqs else 0.0
    fpt = forward_flops_per_token(shape, ctx)
    out = []
    for stage, secs, flops, real, computed in (
        ("rollout", total("T_r"), fpt * (total("rollout_prefill_tokens") + total("rollout_real_tokens")),
         total("rollout_real_tokens"), total("rollout_computed_tokens")),
        ("learner", total("T_l"), fpt * total("learner_flop_tokens"), total("learner_real_tokens"),
         total("learner_computed_tokens")),
    ):
        frac = flops / secs / peak if secs > 0 and peak > 0 else 0.0
        out.append(StageRoofline(stage, flops, secs, frac, 1.0 - real / computed if computed else 0.0, real,
                                 computed))
    return out


def run_shape(config: Any, home: Path) -> ModelShape:
    """The run's model shape (no weights loaded)."""
    from rlctl.planning.dryrun import config_shape, load_tokenizer

    tokenizer, _ = load_tokenizer(config, home)
    return config_shape(config, tokenizer)


def run_dtype(config: Any) -> str:
    """The dtype the run's weights load at: float32 for the built-in model, else config.json's torch_dtype."""
    if config.model.builtin:
        return "float32"
    path = Path(config.model.path).expanduser() / "config.json"
    try:
        value = json.loads(path.read_text()).get("torch_dtype") or "float32"
    except (OSError, json.JSONDecodeError):
        return "float32"
    return value if value in ("float32", "bfloat16", "float16") else "float32"
