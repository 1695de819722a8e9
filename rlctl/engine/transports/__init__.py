"""Weight transports: how encoded shards get from the publisher to receivers.

What this is: the helpers every transport (rlctl.contracts.roles.WeightTransport)
shares (a shard is a safetensors blob named by its sha256). Three transports
sit side by side behind it, each with its ordering invariant:

- ``InProcessTransport`` (colocated): publish swaps one reference after every
  shard is built; a receiver sees the old version or the new one.
- ``DiskTransport`` (shared disk): shards, fsync, manifest temp file, rename,
  directory fsync; a version exists only once its manifest is renamed in.
- ``DistTransport`` (torch.distributed broadcast, gloo on CPU, NCCL on GPU):
  the manifest, then one bucket per shard; receivers check every bucket's
  sha256 before decoding; every collective has a timeout that names the peer.

What this is not: encoding or delta logic (rlctl.engine.weight_codec) or the
publish / apply protocol (rlctl.engine.weight_sync).
"""

from __future__ import annotations

import hashlib
from typing import Any

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightManifest, WeightShard
from rlctl.engine.weight_codec import ShardDraft, check_stored


_ST_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64", "int32": "I32",
    "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}


def safetensors_parts(draft: ShardDraft) -> list[memoryview]:
    """A shard in the safetensors format as buffers to write in order: header, then each tensor's memory.

    Zero-copy: the tensor parts are views of the tensors themselves, so a
    transport can hash and write them without building the blob (safetensors'
    own ``save`` copies every tensor twice). Tensors are laid out by element
    size, largest first, so every offset stays aligned, as safetensors does.
    """
    import json
    import struct

    order = sorted(draft.stored, key=lambda n: (-draft.stored[n].element_size(), n))
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    views: list[memoryview] = []
    offset = 0
    for name in order:
        t = draft.stored[name]
        size = t.numel() * t.element_size()
        dtype = _ST_DTYPES[str(t.dtype).removeprefix("torch.")]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        views.append(memoryview(t.reshape(-1).view(_uint8()).numpy()) if size else memoryview(b""))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return [memoryview(struct.pack("<Q", len(head)) + head), *views]


def _uint8() -> Any:
    import torch

    return torch.uint8


def serialize(draft: ShardDraft) -> bytes:
    """A shard as one safetensors blob (loadable by Hugging Face and SGLang when names are plain)."""
    return b"".join(safetensors_parts(draft))


def sha256_hex(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def load_blob(manifest: WeightManifest, shard: WeightShard, data: bytes | memoryview) -> dict[str, Any]:
    """Verify one received blob against its manifest entry, then parse it. Names the shard on failure."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if len(data) != shard.num_bytes:
        raise RoleError(f"shard {shard.path} of weight version {manifest.version} has {len(data)} bytes, "
                        f"the manifest says {shard.num_bytes}: it is truncated or was replaced",
                        "the receiver keeps its current weights; republish this version")
    got = sha256_hex(data)
    if got != shard.sha256:
        raise RoleError(f"shard {shard.path} of weight version {manifest.version} failed its sha256 check "
                        f"({got[:12]} != {shard.sha256[:12]}): it is corrupt",
                        "the receiver keeps its current weights; republish this version")
    try:
        stored = load(bytes(data))
    except SafetensorError as err:
        raise RoleError(f"shard {shard.path} of weight version {manifest.version} is not a safetensors file: {err}",
                        "republish this version") from err
    check_stored(manifest, shard, stored)
    return stored


__all__ = ["safetensors_parts", "serialize", "sha256_hex", "load_blob"]
