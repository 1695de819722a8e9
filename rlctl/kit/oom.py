"""Classify a learner out-of-memory error from a memory snapshot.

What this is: ``classify_oom`` splits the memory in use into parameters,
gradients, optimizer state, activations (estimated for the failing
micro-batch) and, on CUDA, allocator fragmentation (reserved but not
allocated), and names the largest part. On CUDA the snapshot is
``torch.cuda.memory_stats``; on CPU it is the sizes of the live tensors the
learner owns plus the activation estimate.

What this is not: recovery (the learner halves its micro-batch) or the dry-run
memory ledger (rlctl.planning.memory), which plans memory before a run.
"""

from __future__ import annotations

from typing import Any

import torch


def _bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def classify_oom(model: Any, optimizer: Any, rows: int, width: int) -> tuple[str, dict[str, int]]:
    """``(class, bytes per part)``; class is parameters / gradients / optimizer / activations / fragmentation."""
    params = list(model.parameters())
    cfg = model.config
    hidden = int(getattr(cfg, "hidden_size", 0))
    layers = int(getattr(cfg, "num_hidden_layers", 0))
    vocab = int(getattr(cfg, "vocab_size", 0))
    elem = params[0].element_size() if params else 4
    # Per token: ~16 saved hidden-size tensors per layer (attention + MLP), plus logits and their log-softmax.
    activations = rows * width * (16 * hidden * layers + 2 * vocab) * elem
    parts = {
        "parameters": _bytes(params),
        "gradients": _bytes(p.grad for p in params),
        "optimizer": _bytes(v for state in optimizer.state.values() for v in state.values()),
        "activations": activations,
    }
    if torch.cuda.is_available() and any(p.is_cuda for p in params):
        stats = torch.cuda.memory_stats()
        reserved, allocated = stats.get("reserved_bytes.all.current", 0), stats.get("allocated_bytes.all.current", 0)
        parts["fragmentation"] = max(0, reserved - allocated)
    return max(parts, key=parts.__getitem__), parts
