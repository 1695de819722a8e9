"""Process-group plumbing shared by a sharded learner's local ranks and its Ray rank actors.

What this is: ``free_port`` (a rendezvous port on this host), ``init_group``
(join the torch.distributed group of a sharded learner: gloo on CPU, NCCL for
CUDA tensors with gloo beside it for CPU ones) and ``rank_device`` (the device
string a rank builds its shard on). The rank groups themselves are
rlctl.kit.ranks.LocalRanks (processes on this node, for the sharded learner
plugins) and rlctl.placement.ray_ranks.RayRanks (Ray actors).

What this is not: a launcher; nothing here starts a process.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the rendezvous binds it moments later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(device: Any, local_index: int) -> str:
    """The device a rank builds on: ``cuda:<local_index>`` on a CUDA run, else ``cpu``."""
    return f"cuda:{local_index}" if device.type == "cuda" else "cpu"


def init_group(device: Any, host: str, port: int, rank: int, world: int, timeout_s: float,
               local_index: int | None = None) -> None:
    """Join the group at ``tcp://host:port`` as ``rank`` of ``world``; collectives wait at most ``timeout_s``.

    ``local_index`` is the CUDA device this rank uses (default: its rank, one
    node with one GPU per rank; a Ray actor sees only its own GPU, index 0).
    """
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(rank if local_index is None else local_index)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
