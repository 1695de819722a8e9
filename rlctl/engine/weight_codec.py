"""The weight wire format: value encodings, delta against a base version, shards, manifest JSON.

What this is: pure functions. ``encode_state`` turns a state dict into shard
drafts (logical TensorInfo entries plus the tensors actually stored) and the
fingerprint of what a receiver will hold after decoding; ``decode_state``
turns verified stored tensors (plus, for a delta, the receiver's copy of the
base version) back into a full state dict. Encodings:

- ``raw``: tensors travel as they are (bit-exact; the fp32 default).
- ``bf16``: floating tensors travel as bfloat16 and are cast back to their
  dtype on receive (relative error <= 2**-8 per element).
- ``fp8``: floating tensors travel as float8_e4m3fn with one fp32 scale per
  row (amax / 448), dequantised on receive (relative error <= 2**-4 for
  normal values, absolute <= scale * 2**-10 below).

Delta (raw or bf16): a tensor whose wire bytes did not change since the base
is not sent (``carried``); one where some elements changed is sent as the
smallest of: "gaps" (16-bit distances between changed elements + the new
wire values), "sparse" (int32 element indices + values), "masked" (a bitmask
of changed elements + values) or "dense".
Elements are compared bit-for-bit in the wire encoding, so a bf16 delta skips
every weight whose bf16 value an optimizer step did not move. (An fp32 Adam
step moves every weight, so a raw fp32 delta is about as big as a full
publish; the saving comes with bf16 transfer at RL-sized learning rates.)

What this is not: I/O or the commit protocol (rlctl.engine.transports and
rlctl.engine.weight_sync).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import TensorInfo, WeightManifest, WeightShard
from rlctl.models.fingerprint import fingerprint

ENCODINGS = ("raw", "bf16", "fp8")
FORMAT = "rlctl.weights/1"
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DELTA_LAYOUTS = ("gaps", "sparse", "masked")  # entries that patch the base tensor
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class ShardDraft:
    """One shard before a transport has serialised it: its logical tensors and what is stored."""

    tensors: tuple[TensorInfo, ...]
    stored: dict[str, torch.Tensor]

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.stored.values())


@dataclass(frozen=True, slots=True)
class WireState:
    """What the publisher keeps of the last version to compute the next delta."""

    version: int
    fingerprint: str  # of the decoded state (what receivers hold)
    wire: dict[str, torch.Tensor]  # name -> dense wire tensor


@dataclass(frozen=True, slots=True)
class Encoded:
    shards: tuple[ShardDraft, ...]
    fingerprint: str
    full_bytes: int  # what a full publish in this encoding would move
    wire: WireState
    base_version: int | None = None
    base_fingerprint: str = ""
    carried: tuple[TensorInfo, ...] = field(default_factory=tuple)

    def manifest_draft(self, version: int, created_at: float) -> WeightManifest:
        shards = tuple(WeightShard(path="", sha256="", num_bytes=s.num_bytes, tensors=s.tensors) for s in self.shards)
        return WeightManifest(version=version, fingerprint=self.fingerprint, shards=shards, created_at=created_at,
                              base_version=self.base_version, base_fingerprint=self.base_fingerprint,
                              carried=self.carried)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise RoleError(f"weight manifest names an unknown dtype {name!r}", "publisher and receiver need the same torch")
    return found


# -- encode -------------------------------------------------------------------


def encode_state(state: Mapping[str, Any], *, version: int, encoding: str, bucket_bytes: int,
                 raw_fingerprint: str | None = None, base: WireState | None = None) -> Encoded:
    """Encode ``state`` into shard drafts; a delta against ``base`` when it is given."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown weight encoding {encoding!r}; use one of {', '.join(ENCODINGS)}")
    if base is not None and encoding == "fp8":
        raise ValueError("delta publish needs a stable wire value per weight; fp8 scales change every step, "
                         "so use encoding raw or bf16 with delta")
    groups: list[tuple[TensorInfo, dict[str, torch.Tensor]]] = []
    carried: list[TensorInfo] = []
    wire: dict[str, torch.Tensor] = {}
    full_bytes = 0
    seen_storage: set[int] = set()
    for name in sorted(state):
        tensor = _plain(state[name], seen_storage)
        used, parts = _encode_dense(name, tensor, encoding)
        full_bytes += sum(p.numel() * p.element_size() for p in parts.values())
        info = TensorInfo(name=name, shape=tuple(tensor.shape), dtype=dtype_name(tensor.dtype), encoding=used)
        if used != "fp8_e4m3":
            wire[name] = parts[name]
        if base is None:
            groups.append((info, parts))
            continue
        layout, stored, changed = _delta(name, parts[name], base.wire.get(name))
        if layout == "same":
            carried.append(info)
        else:
            groups.append((TensorInfo(name=name, shape=info.shape, dtype=info.dtype, encoding=used, layout=layout,
                                      num_changed=changed), parts if layout == "dense" else stored))
    if encoding == "raw" and raw_fingerprint:
        fp = raw_fingerprint  # raw decodes to the input bit for bit: the exporter's fingerprint holds
    else:
        fp = fingerprint(_Decoded(groups, carried, base))
    shards = _pack(groups, bucket_bytes)
    state_now = WireState(version=version, fingerprint=fp, wire=wire)
    if base is None:
        return Encoded(shards=shards, fingerprint=fp, full_bytes=full_bytes, wire=state_now)
    return Encoded(shards=shards, fingerprint=fp, full_bytes=full_bytes, wire=state_now, base_version=base.version,
                   base_fingerprint=base.fingerprint, carried=tuple(carried))


def _plain(value: Any, seen_storage: set[int]) -> torch.Tensor:
    """A contiguous CPU tensor that shares storage with no other one (safetensors refuses aliases)."""
    t = value.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    ptr = t.untyped_storage().data_ptr()
    if (t.numel() and ptr in seen_storage) or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()
        ptr = t.untyped_storage().data_ptr()
    if t.numel():
        seen_storage.add(ptr)
    return t


def _encode_dense(name: str, t: torch.Tensor, encoding: str) -> tuple[str, dict[str, torch.Tensor]]:
    if encoding == "raw" or not t.is_floating_point() or t.numel() == 0:
        return "raw", {name: t}
    if encoding == "bf16":
        return "bf16", {name: t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)}
    rows = _rows(t).float()  # [R, C]
    amax = rows.abs().amax(dim=1, keepdim=True)  # [R, 1]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [R, 1]
    q = (rows / scale).to(torch.float8_e4m3fn).reshape(t.shape)
    return "fp8_e4m3", {name: q, f"{name}::scale": scale}


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1) if t.dim() >= 2 else t.reshape(1, -1)


def _delta(name: str, new: torch.Tensor, old: torch.Tensor | None) -> tuple[str, dict[str, torch.Tensor], int]:
    """("same" | "sparse" | "dense", stored tensors, number of changed elements)."""
    if old is None or old.shape != new.shape or old.dtype != new.dtype:
        return "dense", {}, new.numel()
    a, b = new.reshape(-1), old.reshape(-1)
    if a.is_floating_point():  # compare bit patterns: NaN == NaN, -0.0 != 0.0
        bits = _BITS[a.element_size()]
        a_bits, b_bits = a.view(bits), b.view(bits)
    else:
        a_bits, b_bits = a, b
    diff = a_bits != b_bits  # [N]
    changed = torch.nonzero(diff).flatten()  # [K], increasing
    k, n, size = changed.numel(), a.numel(), a.element_size()
    if k == 0:
        return "same", {}, 0
    index_dtype = torch.int32 if n < 2**31 else torch.int64
    gaps = torch.diff(changed, prepend=changed.new_tensor([-1]))  # [K], each >= 1
    cost = {"dense": n * size, "gaps": k * (2 + size) if int(gaps.max()) <= 1 << 16 else n * size,
            "sparse": k * ((4 if index_dtype == torch.int32 else 8) + size), "masked": (n + 7) // 8 + k * size}
    layout = min(cost, key=lambda name: (cost[name], list(cost).index(name)))
    values = {f"{name}::val": a[changed]}
    if layout == "dense":
        return "dense", {}, k
    if layout == "gaps":  # distance to the previous change, minus one, as 16 bits
        return "gaps", {f"{name}::gap": (gaps - 1 - 32768).to(torch.int16), **values}, k
    if layout == "sparse":
        return "sparse", {f"{name}::idx": changed.to(index_dtype), **values}, k
    mask = torch.from_numpy(np.packbits(diff.numpy(), bitorder="little"))  # [ceil(N/8)] uint8
    return "masked", {f"{name}::mask": mask, **values}, k


def _changed_index(info: TensorInfo, stored: Mapping[str, torch.Tensor], numel: int) -> torch.Tensor:
    """Flat indices of the elements a sparse or masked entry replaces, in increasing order."""
    if info.layout == "sparse":
        return stored[f"{info.name}::idx"].long()
    if info.layout == "gaps":
        return torch.cumsum(stored[f"{info.name}::gap"].long() + 32769, dim=0) - 1
    bits = np.unpackbits(stored[f"{info.name}::mask"].numpy(), count=numel, bitorder="little")
    return torch.from_numpy(bits.astype(bool)).nonzero().flatten()


def _pack(groups: list[tuple[TensorInfo, dict[str, torch.Tensor]]], bucket_bytes: int) -> tuple[ShardDraft, ...]:
    """Pack whole logical tensors into shards of at most ``bucket_bytes`` (a bigger tensor goes alone)."""
    shards: list[ShardDraft] = []
    infos: list[TensorInfo] = []
    stored: dict[str, torch.Tensor] = {}
    size = 0
    for info, parts in groups:
        nbytes = sum(p.numel() * p.element_size() for p in parts.values())
        if infos and size + nbytes > bucket_bytes:
            shards.append(ShardDraft(tensors=tuple(infos), stored=stored))
            infos, stored, size = [], {}, 0
        infos.append(info)
        stored.update(parts)
        size += nbytes
    if infos:
        shards.append(ShardDraft(tensors=tuple(infos), stored=stored))
    return tuple(shards)


class _Decoded(Mapping[str, torch.Tensor]):
    """The receiver's view of an encoded state, decoded one tensor at a time (for the fingerprint)."""

    def __init__(self, groups: list[tuple[TensorInfo, dict[str, torch.Tensor]]], carried: list[TensorInfo],
                 base: WireState | None) -> None:
        self._groups = {info.name: (info, parts) for info, parts in groups}
        self._carried = {info.name: info for info in carried}
        self._base = base

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._carried:
            info = self._carried[name]
            assert self._base is not None
            return _decode_values(self._base.wire[name], info)
        info, parts = self._groups[name]
        if info.layout in DELTA_LAYOUTS:
            assert self._base is not None
            wire = self._base.wire[name].clone().reshape(-1)
            wire[_changed_index(info, parts, wire.numel())] = parts[f"{name}::val"]
            return _decode_values(wire.reshape(info.shape), info)
        return decode_dense(info, parts)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._groups) + list(self._carried))

    def __len__(self) -> int:
        return len(self._groups) + len(self._carried)


# -- decode -------------------------------------------------------------------


def stored_keys(info: TensorInfo) -> tuple[str, ...]:
    """The names under which ``info`` is stored in its shard."""
    if info.layout == "sparse":
        return (f"{info.name}::idx", f"{info.name}::val")
    if info.layout == "masked":
        return (f"{info.name}::mask", f"{info.name}::val")
    if info.layout == "gaps":
        return (f"{info.name}::gap", f"{info.name}::val")
    if info.encoding == "fp8_e4m3":
        return (info.name, f"{info.name}::scale")
    return (info.name,)


def _decode_values(wire: torch.Tensor, info: TensorInfo) -> torch.Tensor:
    dtype = to_dtype(info.dtype)
    return wire if wire.dtype == dtype else wire.to(dtype)


def decode_dense(info: TensorInfo, stored: Mapping[str, torch.Tensor]) -> torch.Tensor:
    value = stored[info.name]
    if info.encoding == "fp8_e4m3":
        rows = _rows(value).float() * stored[f"{info.name}::scale"]  # [R, C]
        return rows.to(to_dtype(info.dtype)).reshape(info.shape)
    return _decode_values(value, info)


def decode_state(manifest: WeightManifest, stored: Mapping[str, torch.Tensor],
                 base: Mapping[str, torch.Tensor] | None = None, base_fingerprint: str | None = None,
                 ) -> dict[str, torch.Tensor]:
    """The full decoded state of ``manifest`` from its verified stored tensors (and the base, for a delta)."""
    if manifest.is_delta and (base is None or base_fingerprint != manifest.base_fingerprint):
        raise RoleError(
            f"weight version {manifest.version} is a delta against version {manifest.base_version} "
            f"(fingerprint {manifest.base_fingerprint}), but this receiver holds fingerprint {base_fingerprint}",
            "resync the receiver with a full publish of the current version")
    out: dict[str, torch.Tensor] = {}
    for shard in manifest.shards:
        for info in shard.tensors:
            if info.layout in DELTA_LAYOUTS:
                out[info.name] = _apply_changes(manifest, shard, info, stored, base)
                continue
            value = decode_dense(info, stored)
            if tuple(value.shape) != info.shape:
                raise RoleError(f"tensor {info.name} in shard {shard.path} has shape {tuple(value.shape)}, "
                                f"the manifest says {info.shape}", "republish this version")
            out[info.name] = value
    for info in manifest.carried:
        out[info.name] = _base_tensor(base, info, manifest)
    return out


def _apply_changes(manifest: WeightManifest, shard: WeightShard, info: TensorInfo,
                   stored: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
    """A copy of the base tensor with a delta entry's changed elements replaced."""
    new = _base_tensor(base, info, manifest).detach().clone()
    flat = new.view(-1)
    index = _changed_index(info, stored, flat.numel())
    in_range = not index.numel() or 0 <= int(index.min()) <= int(index.max()) < flat.numel()
    if index.numel() != info.num_changed or not in_range:
        raise RoleError(f"delta entry {info.name} in shard {shard.path} changes {index.numel()} elements "
                        f"(in range: {in_range}), the manifest says {info.num_changed}", "republish this version")
    flat[index] = _decode_values(stored[f"{info.name}::val"], info)
    return new


def _base_tensor(base: Mapping[str, torch.Tensor] | None, info: TensorInfo, manifest: WeightManifest) -> torch.Tensor:
    found = None if base is None else base.get(info.name)
    if found is None or tuple(found.shape) != info.shape or dtype_name(found.dtype) != info.dtype:
        raise RoleError(f"delta weight version {manifest.version} needs tensor {info.name} {info.shape} "
                        f"{info.dtype} from the base version, and the receiver does not hold it",
                        "resync the receiver with a full publish")
    return found


def check_stored(manifest: WeightManifest, shard: WeightShard, stored: Mapping[str, torch.Tensor]) -> None:
    """Refuse a shard whose stored tensor names differ from what its manifest entry lists."""
    expected = {key for info in shard.tensors for key in stored_keys(info)}
    missing, extra = sorted(expected - set(stored)), sorted(set(stored) - expected)
    if missing or extra:
        what = f"lacks {missing[0]}" if missing else f"has unlisted tensor {extra[0]}"
        raise RoleError(f"shard {shard.path} of weight version {manifest.version} {what}",
                        "the shard does not belong to this manifest; republish the version")


# -- manifest JSON ---------------------------------------------------------------


def _info_dict(t: TensorInfo) -> dict[str, Any]:
    return {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "encoding": t.encoding,
            "layout": t.layout, "num_changed": t.num_changed}


def _info(d: Mapping[str, Any]) -> TensorInfo:
    return TensorInfo(name=d["name"], shape=tuple(d["shape"]), dtype=d["dtype"], encoding=d.get("encoding", "raw"),
                      layout=d.get("layout", "dense"), num_changed=d.get("num_changed", 0))


def manifest_to_dict(m: WeightManifest) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": m.version, "fingerprint": m.fingerprint, "created_at": m.created_at,
        "base_version": m.base_version, "base_fingerprint": m.base_fingerprint,
        "shards": [{"path": s.path, "sha256": s.sha256, "num_bytes": s.num_bytes,
                    "tensors": [_info_dict(t) for t in s.tensors]} for s in m.shards],
        "carried": [_info_dict(t) for t in m.carried],
    }


def manifest_from_dict(d: Mapping[str, Any], where: str = "manifest") -> WeightManifest:
    if d.get("format") != FORMAT:
        raise RoleError(f"{where} has format {d.get('format')!r}, expected {FORMAT!r}",
                        "publisher and receiver run different rlctl versions; upgrade both")
    try:
        shards = tuple(WeightShard(path=s["path"], sha256=s["sha256"], num_bytes=int(s["num_bytes"]),
                                   tensors=tuple(_info(t) for t in s["tensors"])) for s in d["shards"])
        return WeightManifest(version=int(d["version"]), fingerprint=d["fingerprint"], shards=shards,
                              created_at=float(d["created_at"]), base_version=d.get("base_version"),
                              base_fingerprint=d.get("base_fingerprint", ""),
                              carried=tuple(_info(t) for t in d.get("carried", ())))
    except (KeyError, TypeError, ValueError) as err:
        raise RoleError(f"{where} is malformed: {err!r}", "republish the version") from err
