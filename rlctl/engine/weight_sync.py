"""Weight publishing: the Broadcaster (learner side) and the Receiver (rollout side).

What this is: the weight-sync protocol. ``Broadcaster.publish`` encodes a
learner's ``WeightUpdate`` (raw / bf16 / fp8, optionally as a delta against
the last published version), hands the shards to a transport that makes the
version visible only once all of it is in place (see rlctl.engine.transports),
and reports bytes moved and latency. ``Receiver.receive`` fetches the newest
committed version, has every shard checksum verified, decodes it against the
receiver's current weights when it is a delta, and returns a full
``WeightUpdate``; the rollout backend applies it all-or-nothing and proves it
with the fingerprint (never half-old, half-new). ``await_confirmation`` is how
a learner pauses until the rollout side confirms a version (no sample is
drawn from weights the learner has not confirmed): a
bounded retry, then a RoleError that says what is stuck.

Ordering invariants: versions are published in increasing order and are
immutable; a receiver's policy version changes only together with its weights;
every trajectory records the version it was sampled under.

What this is not: an RPC layer. Servers are driven over their HTTP API (the
sglang plugin); collectives go through torch.distributed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightManifest, WeightUpdate
from rlctl.engine.weight_codec import ENCODINGS, WireState, decode_state, encode_state


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncOptions:
    """How versions are encoded and moved.

    >>> SyncOptions(encoding="bf16", delta=True).encoding
    'bf16'
    """

    encoding: str = "raw"  # raw | bf16 | fp8
    delta: bool = False  # send only what changed since the last version (raw or bf16)
    bucket_bytes: int = 256 << 20  # shard / bucket size

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"weight encoding must be one of {', '.join(ENCODINGS)}, got {self.encoding!r}")
        if self.delta and self.encoding == "fp8":
            raise ValueError("delta publish works with encoding raw or bf16 (fp8 scales change every step)")
        if self.bucket_bytes < 1 << 10:
            raise ValueError(f"bucket_bytes must be >= 1024, got {self.bucket_bytes}")


@dataclass(frozen=True, slots=True, kw_only=True)
class PublishReport:
    """What one publish moved and how long it took (bytes are what crossed the transport)."""

    version: int
    transport: str
    encoding: str
    delta: bool  # this version went out as a delta
    num_bytes: int
    full_bytes: int  # what a full publish in the same encoding moves
    num_shards: int
    latency_s: float
    manifest: WeightManifest
    location: str = ""  # the version directory for the disk transport

    @property
    def byte_ratio(self) -> float:
        return self.num_bytes / self.full_bytes if self.full_bytes else 0.0

    def metrics(self) -> dict[str, float]:
        return {"weight_sync_bytes": float(self.num_bytes), "weight_sync_full_bytes": float(self.full_bytes),
                "weight_sync_publish_s": self.latency_s, "weight_sync_version": float(self.version)}


class Broadcaster:
    """Publishes weight versions through one transport; keeps what the next delta needs."""

    def __init__(self, transport: Any, options: SyncOptions | None = None) -> None:
        self.transport = transport
        self.options = options or SyncOptions()
        self.last: PublishReport | None = None
        self._wire: WireState | None = None

    def publish(self, update: WeightUpdate, *, full: bool = False) -> PublishReport:
        """Publish ``update`` as its version; returns once the transport committed it."""
        if self.last is not None and update.version < self.last.version:
            raise RoleError(f"weight version {update.version} is older than the last published version "
                            f"{self.last.version}", "publish versions in increasing order")
        o = self.options
        as_delta = o.delta and not full and self._wire is not None and self._wire.version != update.version
        started = time.perf_counter()
        encoded = encode_state(update.state_dict, version=update.version, encoding=o.encoding,
                               bucket_bytes=o.bucket_bytes, raw_fingerprint=update.fingerprint,
                               base=self._wire if as_delta else None)
        draft = encoded.manifest_draft(update.version, created_at=time.time())
        manifest = self.transport.send(draft, encoded.shards)
        latency = time.perf_counter() - started
        if o.delta:
            self._wire = encoded.wire
        self.last = PublishReport(
            version=update.version, transport=self.transport.name, encoding=o.encoding, delta=manifest.is_delta,
            num_bytes=manifest.num_bytes, full_bytes=encoded.full_bytes, num_shards=len(manifest.shards),
            latency_s=latency, manifest=manifest, location=self.transport.location,
        )
        return self.last

    def republish_full(self) -> PublishReport:
        """A full copy of the last version (to resync a receiver that lost its base, e.g. after a restart)."""
        if self.last is None:
            raise RoleError("nothing has been published yet, so there is no version to republish",
                            "publish a version first")
        if not self.last.delta:
            return self.last
        if self._wire is None:  # pragma: no cover - a delta is only ever made from a kept wire state
            raise RoleError("the last version was a delta but its full state was not kept", "publish a full version")
        return self.publish(_wire_update(self._wire, self.last.manifest), full=True)


def _wire_update(wire: WireState, manifest: WeightManifest) -> WeightUpdate:
    """The decoded state of a kept wire state (raw or bf16), as an update of the same version."""
    from rlctl.engine.weight_codec import to_dtype

    dtypes = {t.name: to_dtype(t.dtype) for t in manifest.tensors()}
    state = {name: t.to(dtypes[name]) for name, t in wire.wire.items()}
    return WeightUpdate(version=wire.version, state_dict=state, fingerprint=wire.fingerprint)


class Receiver:
    """Fetches committed versions from a transport and turns them into full, verified updates."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport

    def receive(self, *, base: Mapping[str, Any] | None = None, base_fingerprint: str | None = None,
                timeout_s: float | None = None, **where: Any) -> WeightUpdate:
        """The newest committed version as a full state dict. ``base`` is the receiver's current weights."""
        manifest, stored = self.transport.fetch(timeout_s, **where)
        return decode_manifest(manifest, stored, base=base, base_fingerprint=base_fingerprint)

    def apply(self, engine: Any, **where: Any) -> WeightUpdate:
        """Receive and apply to ``engine`` (a rollout backend with ``state_dict()`` and a fingerprint)."""
        update = self.receive(base=engine.state_dict(), base_fingerprint=engine.health().get("fingerprint"), **where)
        engine.update_weights(update)
        return update


def decode_manifest(manifest: WeightManifest, stored: Mapping[str, Any], *, base: Mapping[str, Any] | None = None,
                    base_fingerprint: str | None = None) -> WeightUpdate:
    state = decode_state(manifest, stored, base=base, base_fingerprint=base_fingerprint)
    return WeightUpdate(version=manifest.version, state_dict=state, fingerprint=manifest.fingerprint)


MAX_BACKOFF_S = 30.0  # a long outage is retried every 30 s, not at ever longer gaps


def await_confirmation(confirm: Callable[[], tuple[bool, str]], *, what: str, retries: int, backoff_s: float,
                       sleep: Callable[[float], None] = time.sleep) -> int:
    """Call ``confirm`` until it reports success; at most ``retries`` extra tries with doubling backoff
    (capped at ``MAX_BACKOFF_S``).

    ``confirm`` returns (ok, detail). Returns the number of tries used. Past
    the bound, raises a RoleError naming ``what`` and the last detail: the
    caller (the learner) is still paused, nothing trained ahead.
    """
    detail = ""
    for attempt in range(retries + 1):
        ok, detail = confirm()
        if ok:
            return attempt + 1
        if attempt < retries:
            sleep(min(backoff_s * (2 ** attempt), MAX_BACKOFF_S))
    raise RoleError(f"{what} not confirmed after {retries + 1} tries: {detail}",
                    "the learner stayed paused at this version; fix or restart that rollout server, then resume")
