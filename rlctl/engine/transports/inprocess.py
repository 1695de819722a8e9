"""In-process (colocated) weight transport: publisher and receiver share one address space.

What this is: a slot holding the newest committed (manifest, stored tensors)
pair. ``send`` builds everything first and then swaps the slot under a lock,
so ``fetch`` returns the previous version or the new one, never a mix.
Nothing is copied or serialised, so there are no shard checksums to verify
(sha256 is ""); the receiver proves what it applied with the fingerprint.

What this is not: a queue. A receiver that fetches twice gets the newest
version both times; versions in between are skipped by design.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any, Sequence

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightManifest, WeightShard
from rlctl.engine.weight_codec import ShardDraft


class InProcessTransport:
    """Hands the encoded tensors over by reference."""

    name = "inprocess"
    location = ""  # a version lives in the receivers' memory, not at a place a reader could open

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slot: tuple[WeightManifest, dict[str, Any]] | None = None

    def send(self, draft: WeightManifest, shards: Sequence[ShardDraft]) -> WeightManifest:
        stored: dict[str, Any] = {}
        committed = []
        for i, shard in enumerate(shards):
            stored.update(shard.stored)
            committed.append(WeightShard(path=f"memory-{i:05d}", sha256="", num_bytes=shard.num_bytes,
                                         tensors=shard.tensors))
        manifest = replace(draft, shards=tuple(committed))
        with self._lock:
            self._slot = (manifest, stored)
        return manifest

    def fetch(self, timeout_s: float | None = None) -> tuple[WeightManifest, dict[str, Any]]:
        with self._lock:
            slot = self._slot
        if slot is None:
            raise RoleError("no weight version has been published in this process yet",
                            "publish a version before a receiver fetches one")
        return slot

    def close(self) -> None:
        with self._lock:
            self._slot = None
