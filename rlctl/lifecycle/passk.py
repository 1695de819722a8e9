"""pass@k: the unbiased estimator over n samples per prompt, per-prompt records and a bootstrap CI.

What this is: ``pass_at_k(n, c, k)``, the unbiased estimator of Chen et al.
(2021), 1 - C(n-c, k) / C(n, k), in its numerically stable product form
1 - prod_{i=n-c+1..n} (1 - k/i); ``parse_ks`` for ``--k 1,10``; and
``summarize`` which turns per-prompt correct counts into the mean pass@k for
each k with a 95% percentile bootstrap CI over prompts, plus one record per
prompt.

What this is not: sampling or grading (rlctl.lifecycle.grading).
"""

from __future__ import annotations

from typing import Any, Sequence

from rlctl.contracts.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def parse_ks(text: str) -> list[int]:
    """``"1,10"`` -> [1, 10]; ConfigError naming the fix on anything else."""
    try:
        ks = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        ks = []
    if not ks or ks[0] < 1:
        raise ConfigError(f"--k must be a comma-separated list of positive integers, got {text!r}", "use --k 1,10")
    return ks


def samples_for(ks: Sequence[int], samples: int | None, temperature: float) -> int:
    """Samples per prompt: ``samples`` (default max(ks), at least 1); ConfigError if fewer than max(ks)
    or if k > 1 is asked of greedy decoding (every sample would be the same)."""
    n = samples if samples is not None else max(ks)
    if n < max(ks):
        raise ConfigError(f"--samples {n} is fewer than the largest k ({max(ks)}): pass@k needs n >= k samples",
                          f"pass --samples {max(ks)} or more, or a smaller --k")
    if n > 1 and temperature <= 0.0:
        raise ConfigError(f"{n} samples per prompt at temperature 0 (rollout.temperature) are all the same greedy "
                          "answer", "set rollout.temperature > 0 (e.g. --set rollout.temperature=0.8), or use --k 1")
    return n


def summarize(counts: Sequence[int], n: int, ks: Sequence[int], prompt_ids: Sequence[str],
              bootstrap_samples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Mean pass@k per k with a 95% bootstrap CI over prompts, and per-prompt records.

    Returns ``{"n": n, "ks": [...], "pass_at_k": {"1": {"value", "ci_low", "ci_high"}, ...},
    "prompts": [{"id", "correct", "pass_at_k": {"1": ...}}, ...]}``.
    """
    import numpy as np

    if not counts or len(counts) != len(prompt_ids):
        raise ValueError("pass@k needs one correct count per prompt and at least one prompt")
    per_k = {k: np.array([pass_at_k(n, c, k) for c in counts], dtype=np.float64) for k in ks}
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(counts), size=(bootstrap_samples, len(counts)))
    table = {}
    for k, values in per_k.items():
        means = np.sort(values[draws].mean(axis=1))
        table[str(k)] = {"value": float(values.mean()), "ci_low": float(means[int(0.025 * bootstrap_samples)]),
                         "ci_high": float(means[min(bootstrap_samples - 1, int(0.975 * bootstrap_samples))])}
    prompts = [{"id": pid, "correct": int(c), "pass_at_k": {str(k): float(per_k[k][i]) for k in ks}}
               for i, (pid, c) in enumerate(zip(prompt_ids, counts))]
    return {"n": n, "ks": list(ks), "pass_at_k": table, "prompts": prompts}
