"""Sharded learner checkpoints: the tensor layout the ranks write, and reading it back on one process.

What this is: the naming contract between a sharded learner and core. The
learner's ranks save one flat dict of tensors with torch.distributed.checkpoint
and its Hugging Face safetensors writer (``save_distributed=True``): every rank
writes its own ``shard-0000R-model-00001-of-00001.safetensors`` holding its
pieces of each tensor, with each piece's offset in the full tensor kept as JSON
in the safetensors header (no ``.metadata`` pickle). Keys are

    model.<parameter name>               the fp32 (master) weights, tied aliases dropped
    optim.<parameter name>.<state name>  the optimizer's per-parameter tensors (AdamW step, exp_avg, exp_avg_sq)

``dcp_read`` fills tensors of any sharding (DTensors of a different world
size, or plain full tensors) from such a directory, which is how a resume on a
different number of ranks reshards; ``read_full_model`` rebuilds the full
weights on a single process for ``rlctl export --hf``. Everything read is
safetensors and JSON: nothing is unpickled.

What this is not: the commit protocol (rlctl.engine.checkpoint checksums the
shard files into the COMMITTED manifest) or the learner (plugins).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

MODEL = "model."
OPTIM = "optim."


def dcp_save(tensors: Mapping[str, Any], directory: str | Path) -> None:
    """Write this rank's pieces of ``tensors`` (a collective over the default process group)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    dcp.save(dict(tensors), storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True))


def dcp_read(tensors: Mapping[str, Any], directory: str | Path, *, no_dist: bool = False) -> None:
    """Fill ``tensors`` in place from the shards in ``directory`` (a collective unless ``no_dist``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    dcp.load(dict(tensors), storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=no_dist)


def shapes(directory: str | Path) -> dict[str, tuple[tuple[int, ...], Any]]:
    """Full shape and dtype of every tensor in the shards (read from the safetensors headers)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(directory)).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.items()}


def read_full_model(directory: str | Path) -> dict[str, Any]:
    """The full model weights (Hugging Face names -> tensors) reassembled from every rank's shard file."""
    import torch

    full = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes(directory).items()
            if k.startswith(MODEL)}
    if not full:
        raise ValueError(f"the shards in {directory} hold no {MODEL}* tensors")
    dcp_read(full, directory, no_dist=True)
    return {k[len(MODEL):]: v for k, v in full.items()}
