"""torch.distributed weight transport: broadcast from rank 0 over a private process group.

What this is: the collective weight-sync path. Rank 0 publishes, ranks
1..N-1 receive. The group is private (its own TCPStore and ProcessGroupGloo,
or ProcessGroupNCCL on GPU), so it never touches torch's default group. A
version travels as: header length, manifest JSON (with every bucket's
sha256), then one uint8 bucket per shard (a safetensors blob). A receiver
checks each bucket's sha256 before it parses anything and returns only a
complete, verified version.

Timeouts: every collective runs with the group's timeout and in a worker
thread joined with a deadline, so a peer that died or hangs becomes a
RoleError naming it (rank, address, and whether it ever reached this
transfer) within ``timeout_s`` plus a small grace, never an infinite hang.
Joining the group has its own bound, ``join_timeout_s``, because peers may
take longer to start than a transfer may take.
After such an error the transport refuses further use (a collective cannot be
resumed half way): build a new one with a new port.

What this is not: tested on NCCL here (no GPU on the CI machine); the NCCL
branch copies buckets to ``device`` and back, the simplest correct path.
"""

from __future__ import annotations

import datetime
import json
import threading
import warnings
from dataclasses import replace
from typing import Any, Callable, Sequence, TypeVar

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightManifest, WeightShard
from rlctl.engine.transports import load_blob, serialize, sha256_hex
from rlctl.engine.weight_codec import ShardDraft, manifest_from_dict, manifest_to_dict

T = TypeVar("T")
_GRACE_S = 2.0


class DistTransport:
    """One member of a weight-broadcast group; rank 0 sends, every other rank fetches."""

    name = "distributed"
    location = ""  # a version lives in the receivers' memory, not at a place a reader could open

    def __init__(self, *, rank: int, world_size: int, master_port: int, master_addr: str = "127.0.0.1",
                 backend: str = "gloo", timeout_s: float = 60.0, join_timeout_s: float | None = None,
                 bind_addr: str | None = None, device: str | None = None) -> None:
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size (got rank {rank} of {world_size})")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (GPU), got {backend!r}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.master_addr, self.master_port = master_addr, master_port
        self.timeout_s = float(timeout_s)  # every transfer
        self.join_timeout_s = float(join_timeout_s if join_timeout_s is not None else timeout_s)  # peers start up
        self.bind_addr = bind_addr
        self.device = device or ("cuda" if backend == "nccl" else "cpu")
        self._store: Any = None
        self._pg: Any = None
        self._seq = 0
        self._broken: str | None = None

    # -- group -------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"

    def connect(self) -> None:
        """Join the group (every rank calls this); bounded by ``timeout_s``."""
        if self._pg is not None:
            return
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=self.timeout_s)
        join = datetime.timedelta(seconds=self.join_timeout_s)

        def store_only() -> Any:
            store = dist.TCPStore(self.master_addr, self.master_port, self.world_size, self.rank == 0,
                                  timeout=join, wait_for_workers=False)
            store.set(f"rlctl/joined/{self.rank}", "1")
            return store

        self._store = self._bounded(store_only, "reach the weight-sync store", self._peer_names,
                                    self.join_timeout_s)

        def group() -> Any:
            # Every rank is in the store before the group forms, and the group's own rendezvous runs
            # under the join bound; only then do transfers get the (shorter) transfer timeout.
            self._store.wait([f"rlctl/joined/{r}" for r in range(self.world_size)], join)
            if self.backend == "nccl":
                nccl_opts = dist.ProcessGroupNCCL.Options()
                nccl_opts._timeout = join
                pg = dist.ProcessGroupNCCL(self._store, self.rank, self.world_size, nccl_opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = join
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.bind_addr)
                                 if self.bind_addr else dist.ProcessGroupGloo.create_default_device()]
                pg = dist.ProcessGroupGloo(self._store, self.rank, self.world_size, opts)
            pg.set_timeout(timeout)
            return pg

        self._pg = self._bounded(group, "form the weight-sync group", self._missing_peers, self.join_timeout_s)

    def _peer_names(self) -> str:
        if self.rank == 0:
            return f"receiver rank(s) 1..{self.world_size - 1} via the store at {self._where}"
        return f"publisher rank 0 (store at {self._where})"

    def _missing_peers(self) -> str:
        missing = [r for r in range(self.world_size) if r != self.rank and not self._has(f"rlctl/joined/{r}")]
        if not missing:
            return self._peer_names()
        return f"rank(s) {', '.join(map(str, missing))} never joined the group at {self._where}"

    def _laggards(self, seq: int) -> str:
        """Which peers never reached transfer number ``seq`` (read from the store without blocking)."""
        behind = [r for r in range(self.world_size) if r != self.rank and self._seq_of(r) < seq]
        if behind:
            return f"rank(s) {', '.join(map(str, behind))} at {self._where} never started transfer {seq}"
        return f"{self._peer_names()} stalled in the middle of transfer {seq}"

    def _has(self, key: str) -> bool:
        try:
            return bool(self._store is not None and self._store.check([key]))
        except RuntimeError:
            return False

    def _seq_of(self, rank: int) -> int:
        key = f"rlctl/seq/{rank}"
        if not self._has(key):
            return 0
        return int(self._store.get(key).decode())

    def _bounded(self, fn: Callable[[], T], what: str, peers: Callable[[], str], timeout_s: float | None = None) -> T:
        if self._broken:
            raise RoleError(f"weight-sync transport is unusable after an earlier failure ({self._broken})",
                            "build a new transport (new port) once every rank is back")
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as err:  # noqa: BLE001 - re-raised below, on the caller's thread
                box["error"] = err

        worker = threading.Thread(target=run, name=f"rlctl-weight-sync-{self.rank}", daemon=True)
        worker.start()
        limit = self.timeout_s if timeout_s is None else timeout_s
        worker.join(limit + _GRACE_S)
        if worker.is_alive() or "error" in box:
            cause = box.get("error")
            detail = f": {type(cause).__name__}: {str(cause).splitlines()[0][:200]}" if cause else ""
            self._broken = f"could not {what}"
            raise RoleError(
                f"rank {self.rank} could not {what} within {limit:g}s: {peers()}{detail}",
                "check that process (alive? same port and world size?); the publisher keeps the last version",
            ) from cause
        return box["value"]

    # -- transfer ----------------------------------------------------------------

    def _broadcast(self, tensor: Any) -> Any:
        import torch
        import torch.distributed as dist

        on_device = tensor if self.device == "cpu" else tensor.to(self.device)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        work = self._pg.broadcast([on_device], opts)
        work.wait(datetime.timedelta(seconds=self.timeout_s))
        return on_device if self.device == "cpu" else on_device.to(torch.device("cpu"))

    def _begin(self) -> int:
        self.connect()
        self._seq += 1
        self._store.set(f"rlctl/seq/{self.rank}", str(self._seq))
        return self._seq

    def send(self, draft: WeightManifest, shards: Sequence[ShardDraft]) -> WeightManifest:
        if self.rank != 0:
            raise RoleError(f"rank {self.rank} tried to publish; only rank 0 publishes", "publish from rank 0")
        import torch

        blobs = [serialize(s) for s in shards]
        manifest = replace(draft, shards=tuple(
            WeightShard(path=f"bucket-{i:05d}", sha256=sha256_hex(b), num_bytes=len(b), tensors=s.tensors)
            for i, (s, b) in enumerate(zip(shards, blobs))))
        header = json.dumps(manifest_to_dict(manifest)).encode()
        seq = self._begin()

        def work() -> None:
            with warnings.catch_warnings():  # the sender only reads its buffers
                warnings.simplefilter("ignore", UserWarning)
                self._broadcast(torch.tensor([len(header)], dtype=torch.int64))
                self._broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
                for blob in blobs:
                    self._broadcast(torch.frombuffer(blob, dtype=torch.uint8))

        self._bounded(work, f"broadcast weight version {draft.version}", lambda: self._laggards(seq))
        return manifest

    def fetch(self, timeout_s: float | None = None) -> tuple[WeightManifest, dict[str, Any]]:
        if self.rank == 0:
            raise RoleError("rank 0 is the publisher and cannot fetch", "fetch on ranks 1..N-1")
        import torch

        seq = self._begin()

        def work() -> tuple[WeightManifest, list[Any]]:
            size = self._broadcast(torch.zeros(1, dtype=torch.int64))
            header = self._broadcast(torch.empty(int(size.item()), dtype=torch.uint8))
            manifest = manifest_from_dict(json.loads(header.numpy().tobytes()), where="broadcast manifest")
            buckets = [self._broadcast(torch.empty(s.num_bytes, dtype=torch.uint8)) for s in manifest.shards]
            return manifest, buckets

        manifest, buckets = self._bounded(work, "receive a weight version", lambda: self._laggards(seq))
        stored: dict[str, Any] = {}
        for shard, bucket in zip(manifest.shards, buckets):  # every bucket arrived: verify, then parse
            stored.update(load_blob(manifest, shard, memoryview(bucket.numpy())))
        return manifest, stored

    def close(self) -> None:
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None and hasattr(pg, "shutdown") and not self._broken:
            pg.shutdown()
