"""Typed payloads of weight versions: what a publisher sends and a rollout engine loads.

What this is: frozen dataclasses for one logical tensor, one shard, a whole published version (its manifest)
and an in-process weight update. Importable from rlctl.contracts.types as well.

What this is not: the codecs or transports that move the bytes (rlctl.engine.weight_codec, transports/).
This module imports nothing from rlctl.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

_FROZEN = dict(frozen=True, slots=True, kw_only=True)


@dataclass(**_FROZEN)
class TensorInfo:
    """One logical tensor of a published weight version.

    ``shape`` and ``dtype`` are what the receiver holds after decoding.
    ``encoding`` is how values travel: "raw" (as is), "bf16", or "fp8_e4m3"
    (per-row scale, stored next to it as ``<name>::scale``). ``layout`` is
    "dense" (every element sent), or "gaps", "sparse" or "masked" (only the
    ``num_changed`` elements that changed since the manifest's
    ``base_version``: ``<name>::val`` plus their positions as 16-bit gaps
    ``<name>::gap``, int32 indices ``<name>::idx`` or a bitmask ``<name>::mask``).

    >>> TensorInfo(name="lm_head.weight", shape=(99, 32), dtype="float32")
    TensorInfo(name='lm_head.weight', shape=(99, 32), dtype='float32', encoding='raw', layout='dense', num_changed=0)
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    encoding: str = "raw"
    layout: str = "dense"
    num_changed: int = 0


@dataclass(**_FROZEN)
class WeightShard:
    """One unit of transfer: a safetensors blob (a file on disk, a bucket on a collective)."""

    path: str  # relative to the manifest's directory (disk) or a bucket name (collective)
    sha256: str  # of the blob's bytes; "" only for the in-process transport (nothing is copied)
    num_bytes: int
    tensors: tuple[TensorInfo, ...]


@dataclass(**_FROZEN)
class WeightManifest:
    """A published weight version: shards plus checksums, visible only once committed.

    ``fingerprint`` is a hash over every decoded tensor's bytes in name order
    (rlctl.models.fingerprint), so a receiver can prove it serves exactly these
    weights. A delta manifest (``base_version`` set) carries only what changed
    since that version: tensors in ``carried`` are taken unchanged from the
    receiver's copy of the base, whose fingerprint must equal ``base_fingerprint``.

    >>> m = WeightManifest(version=3, fingerprint="ab", shards=(), created_at=0.0)
    >>> (m.is_delta, m.num_bytes)
    (False, 0)
    """

    version: int
    fingerprint: str
    shards: tuple[WeightShard, ...]
    created_at: float
    base_version: int | None = None
    base_fingerprint: str = ""
    carried: tuple[TensorInfo, ...] = ()

    @property
    def is_delta(self) -> bool:
        return self.base_version is not None

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)

    def tensors(self) -> tuple[TensorInfo, ...]:
        """Every logical tensor of the version: the sent ones, then the carried ones."""
        return tuple(t for s in self.shards for t in s.tensors) + self.carried


@dataclass(**_FROZEN)
class WeightUpdate:
    """New policy weights handed to a rollout backend in-process (colocated path)."""

    version: int
    state_dict: Mapping[str, Any]  # name -> torch.Tensor
    fingerprint: str
