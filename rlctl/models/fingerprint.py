"""Weight fingerprints: one hash that proves two sides hold the same tensors.

What this is: sha256 over every tensor's name, dtype, shape and bytes in name
order. The learner tags each exported version with it and a rollout backend
recomputes it after applying an update.

What this is not: a per-shard checksum (weight manifests have those).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping


def fingerprint(state_dict: Mapping[str, Any]) -> str:
    """24 hex digits of sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        if t.numel():
            h.update(t.view(-1).view(dtype=torch.uint8).numpy())  # hashed in place: no bytes copy
    return h.hexdigest()[:24]
