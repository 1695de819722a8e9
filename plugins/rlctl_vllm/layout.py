"""What a safetensors directory holds (names, dtypes, shapes) and the digests vLLM's weight checker would report.

What this is: stdlib readers of safetensors headers and byte ranges, so the
backend can (1) refuse a version whose tensors differ in name, shape or dtype
from what the servers serve *before* asking them to load it (vLLM's in-place
reload is not transactional), (2) check that the published bytes are the
learner's tensors before any server reads them, and (3) compute, from the published bytes, the
sha256 that ``POST /weight_checker {"action": "checksum"}`` reports for each
served parameter: vLLM fuses q/k/v into ``qkv_proj`` and gate/up into
``gate_up_proj`` by concatenation along dim 0, so the fused digest is the
sha256 of the parts' bytes in that order.

What this is not: a tensor loader (no torch, nothing is decoded).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any, Mapping

Layout = dict[str, tuple[str, tuple[int, ...]]]
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()  # what the CPU build reports for repacked linear weights
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
VOCAB_PADDING = 64  # vLLM's VocabParallelEmbedding rounds the vocabulary up to a multiple of this
_SKIP = ("lm_head.weight",)  # tied to the embedding in the models rlctl builds; vLLM drops it on load


def _headers(directory: str | Path) -> dict[str, tuple[Path, int, dict]]:
    """name -> (file, data offset, header entry) over every *.safetensors file of ``directory``."""
    out: dict[str, tuple[Path, int, dict]] = {}
    for path in sorted(Path(directory).glob("*.safetensors")):
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                out[name] = (path, 8 + size, entry)
    return out


def layout(directory: str | Path) -> Layout:
    """Every tensor of the directory's safetensors files: name -> (dtype, shape); empty when there are none."""
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, (_, _, entry) in _headers(directory).items()
            if name not in _SKIP}


def differences(served: Layout, new: Layout, limit: int = 5) -> list[str]:
    """Why ``new`` cannot replace ``served`` in place: missing, extra and changed tensors (at most ``limit``)."""
    out = [f"{n}: missing" for n in sorted(served.keys() - new.keys())]
    out += [f"{n}: not served" for n in sorted(new.keys() - served.keys())]
    out += [f"{n}: {new[n][0]}{list(new[n][1])} where the server has {served[n][0]}{list(served[n][1])}"
            for n in sorted(served.keys() & new.keys()) if served[n] != new[n]]
    return out[:limit]


def _digest(parts: list[tuple[Path, int, dict]], pad_rows_to: int = 1) -> str:
    h = hashlib.sha256()
    for path, base, entry in parts:
        begin, end = entry["data_offsets"]
        with open(path, "rb") as f:
            f.seek(base + begin)
            h.update(f.read(end - begin))
        rows, row_bytes = entry["shape"][0], (end - begin) // max(1, entry["shape"][0])
        h.update(bytes((-rows % pad_rows_to) * row_bytes))  # vLLM pads the vocabulary rows with zeros
    return h.hexdigest()


def _sources(name: str) -> list[str]:
    """The checkpoint tensors a served parameter is made of, in concatenation order."""
    stem, _, leaf = name.rpartition(".")  # model.layers.0.self_attn.qkv_proj . weight
    module, _, kind = stem.rpartition(".")
    return [f"{module}.{part}.{leaf}" for part in _FUSED[kind]] if kind in _FUSED else [name]


def expected_digests(directory: str | Path, served_names: list[str]) -> dict[str, str]:
    """For each served parameter whose bytes the directory determines (float32), the digest vLLM reports."""
    heads = _headers(directory)
    out: dict[str, str] = {}
    for name in served_names:
        parts = [heads.get(s) for s in _sources(name)]
        if all(p is not None and p[2]["dtype"] == "F32" for p in parts):
            out[name] = _digest(parts, VOCAB_PADDING if "embed_tokens" in name else 1)  # type: ignore[arg-type]
    return out


def state_digests(state: Mapping[str, Any], served_names: list[str]) -> dict[str, str]:
    """The same digests from the learner's own float32 tensors (``WeightUpdate.state_dict``), not from disk:
    a shard damaged between the publish and the reload shows up as a mismatch."""
    out: dict[str, str] = {}
    for name in served_names:
        parts = [state.get(s) for s in _sources(name)]
        if not all(p is not None and str(p.dtype) == "torch.float32" for p in parts):
            continue
        h = hashlib.sha256()
        for tensor in parts:
            data = tensor.detach().cpu().contiguous().numpy().tobytes()
            h.update(data)
            if "embed_tokens" in name:
                rows = tensor.shape[0]
                h.update(bytes((-rows % VOCAB_PADDING) * (len(data) // max(1, rows))))
        out[name] = h.hexdigest()
    return out


def published_mismatches(directory: str | Path, state: Mapping[str, Any]) -> list[str]:
    """Tensors of ``state`` whose bytes in the published ``directory`` are not the learner's own (bit rot
    between the write and the load), every float32 tensor, sorted."""
    heads = _headers(directory)
    wrong = []
    for name, tensor in state.items():
        head = heads.get(name)
        if head is None or head[2]["dtype"] != "F32" or str(tensor.dtype) != "torch.float32":
            continue
        mine = hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()
        if _digest([head]) != mine:
            wrong.append(name)
    return sorted(wrong)
