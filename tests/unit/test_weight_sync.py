"""Weight publishing: manifest commit protocol, checksums, delta, quantised transfer, timeouts, crashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import WeightUpdate
from rlctl.placement.ranks import free_port
from rlctl.engine.transports.disk import DiskTransport, fetch_directory, read_manifest
from rlctl.engine.transports.inprocess import InProcessTransport
from rlctl.engine.weight_codec import decode_state, encode_state, manifest_from_dict, manifest_to_dict
from rlctl.engine.weight_sync import Broadcaster, Receiver, SyncOptions, await_confirmation
from rlctl.models.fingerprint import fingerprint

REPO = Path(__file__).resolve().parents[2]


def _state(seed: int, width: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(97, width, generator=g) * 0.02,
        "layers.0.proj.weight": torch.randn(width, width, generator=g) * 0.05,
        "layers.0.norm.weight": torch.ones(width),
        "layers.1.proj.weight": torch.randn(width, width, generator=g) * 0.05,
        "head.bias": torch.randn(97, generator=g),
        "step": torch.tensor(7),
    }


def _update(version: int, state: dict[str, torch.Tensor]) -> WeightUpdate:
    return WeightUpdate(version=version, state_dict=state, fingerprint=fingerprint(state))


class ServingReceiver:
    """A fake rollout backend: applies whole updates only, checks the fingerprint (like LocalEngine)."""

    def __init__(self, state: dict[str, torch.Tensor], version: int = 0) -> None:
        self.weights = {k: v.clone() for k, v in state.items()}
        self.policy_version = version
        self.fingerprint = fingerprint(self.weights)

    def state_dict(self):
        return self.weights

    def health(self):
        return {"ok": True, "policy_version": self.policy_version, "fingerprint": self.fingerprint}

    def update_weights(self, update: WeightUpdate) -> None:
        staged = {k: v.clone() for k, v in update.state_dict.items()}
        if set(staged) != set(self.weights) or fingerprint(staged) != update.fingerprint:
            raise RoleError("refused", "")
        self.weights, self.policy_version, self.fingerprint = staged, update.version, update.fingerprint


# -- manifest and disk commit protocol ---------------------------------------------------


def test_manifest_json_round_trip(tmp_path):
    report = Broadcaster(DiskTransport(tmp_path), SyncOptions(bucket_bytes=8 << 10)).publish(_update(1, _state(0)))
    again = manifest_from_dict(json.loads(json.dumps(manifest_to_dict(report.manifest))))
    assert again == report.manifest
    assert report.num_shards > 1 and all(len(s.sha256) == 64 for s in report.manifest.shards)


def test_disk_version_is_a_loadable_directory_with_manifest_last(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    transport = DiskTransport(tmp_path / "pub", extra_files=[tmp_path / "model" / "config.json"])
    state = _state(0)
    report = Broadcaster(transport, SyncOptions(bucket_bytes=8 << 10)).publish(_update(3, state))
    directory = Path(report.location)
    assert directory.name == "v00000003-full"
    names = sorted(p.name for p in directory.iterdir())
    assert "manifest.json" in names and "config.json" in names and "model.safetensors.index.json" in names
    assert [n for n in names if n.endswith(".safetensors")] == [s.path for s in report.manifest.shards]
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(state)
    update = Receiver(transport).receive()
    assert update.version == 3 and update.fingerprint == fingerprint(state) == fingerprint(update.state_dict)
    assert all(torch.equal(update.state_dict[k], state[k]) for k in state)


def test_uncommitted_version_is_invisible_and_replaced_by_the_next_publish(tmp_path):
    transport = DiskTransport(tmp_path)
    broadcaster = Broadcaster(transport)
    broadcaster.publish(_update(1, _state(1)))
    partial = tmp_path / "v00000002-full"
    partial.mkdir()
    (partial / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")
    assert transport.latest_dir().name == "v00000001-full"
    with pytest.raises(RoleError, match="no committed weight version"):
        fetch_directory(partial)
    report = broadcaster.publish(_update(2, _state(2)))
    assert read_manifest(partial).fingerprint == report.manifest.fingerprint
    assert not (partial / "model-00001-of-00002.safetensors").exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupted_shard_is_refused_with_its_name_and_the_receiver_keeps_serving(tmp_path, damage):
    transport = DiskTransport(tmp_path)
    broadcaster = Broadcaster(transport, SyncOptions(bucket_bytes=8 << 10))
    engine = ServingReceiver(_state(0))
    broadcaster.publish(_update(1, _state(1)))
    Receiver(transport).apply(engine)
    report = broadcaster.publish(_update(2, _state(2)))
    shard = Path(report.location) / report.manifest.shards[1].path
    data = bytearray(shard.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(bytes(data[:-10]))
    else:
        shard.unlink()
    with pytest.raises(RoleError) as err:
        Receiver(transport).apply(engine)
    assert shard.name in str(err.value)
    assert engine.policy_version == 1 and engine.fingerprint == fingerprint(_state(1))


def test_versions_are_immutable_and_increasing(tmp_path):
    broadcaster = Broadcaster(DiskTransport(tmp_path))
    first = broadcaster.publish(_update(4, _state(0)))
    assert broadcaster.publish(_update(4, _state(0))).manifest == first.manifest  # same weights: reused
    with pytest.raises(RoleError, match="already published"):
        broadcaster.publish(_update(4, _state(1)))
    with pytest.raises(RoleError, match="older than"):
        broadcaster.publish(_update(3, _state(1)))


def test_retention_keeps_the_newest_versions(tmp_path):
    broadcaster = Broadcaster(DiskTransport(tmp_path, keep_versions=2))
    for v in range(1, 5):
        broadcaster.publish(_update(v, _state(v)))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["v00000003-full", "v00000004-full"]


# -- delta and quantised transfer ----------------------------------------------------------


def _adam_step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """One AdamW step on fp32 master weights with random gradients (the first step moves each weight by ~lr)."""
    params = {k: torch.nn.Parameter(v.clone()) for k, v in state.items() if v.is_floating_point()}
    g = torch.Generator().manual_seed(seed)
    for name, p in params.items():
        p.grad = torch.randn(p.shape, generator=g) if "norm" not in name else torch.zeros_like(p)
    torch.optim.AdamW(params.values(), lr=lr, weight_decay=0.0).step()
    return {k: (params[k].detach() if k in params else v.clone()) for k, v in state.items()}


def test_bf16_delta_after_a_small_step_moves_under_ten_percent_and_decodes_exactly():
    before = _state(0, width=256)
    after = _adam_step(before, lr=1e-6, seed=1)
    transport = InProcessTransport()
    broadcaster = Broadcaster(transport, SyncOptions(encoding="bf16", delta=True))
    full = broadcaster.publish(_update(1, before))
    engine = ServingReceiver(before)
    Receiver(transport).apply(engine)
    delta = broadcaster.publish(_update(2, after))
    assert delta.delta and not full.delta
    assert delta.num_bytes <= 0.10 * full.num_bytes, delta.byte_ratio
    assert {t.name for t in delta.manifest.carried} >= {"layers.0.norm.weight", "step"}
    Receiver(transport).apply(engine)
    assert engine.fingerprint == delta.manifest.fingerprint
    expected = {k: v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() else v for k, v in after.items()}
    assert all(torch.equal(engine.weights[k], expected[k]) for k in after)


def test_raw_delta_of_sparse_change_sends_only_changed_elements_and_is_bit_exact():
    before = _state(0)
    after = {k: v.clone() for k, v in before.items()}
    after["layers.1.proj.weight"][3, :5] += 1.0
    transport = InProcessTransport()
    broadcaster = Broadcaster(transport, SyncOptions(delta=True))
    broadcaster.publish(_update(1, before))
    engine = ServingReceiver(before)
    Receiver(transport).apply(engine)
    report = broadcaster.publish(_update(2, after))
    (entry,) = [t for s in report.manifest.shards for t in s.tensors]
    assert (entry.name, entry.layout, entry.num_changed) == ("layers.1.proj.weight", "gaps", 5)
    assert report.num_bytes == 5 * (2 + 4)  # 16-bit gaps + fp32 values
    Receiver(transport).apply(engine)
    assert all(torch.equal(engine.weights[k], after[k]) for k in after)


@pytest.mark.parametrize("changed, layout", [
    ([3, 4, 5, 60000], "gaps"),  # every gap <= 65536
    ([0, 150000], "sparse"),  # a gap too long for 16 bits
    (list(range(0, 200000, 3)), "masked"),  # a third of the elements
    (list(range(10, 200000)), "dense"),  # nearly all: a bitmask would add to the dense bytes
])
def test_delta_layout_is_the_smallest_and_decodes_exactly(changed, layout):
    before = {"w": torch.arange(200000, dtype=torch.float32)}
    after = {"w": before["w"].clone()}
    after["w"][torch.tensor(changed)] = -1.0
    transport = InProcessTransport()
    broadcaster = Broadcaster(transport, SyncOptions(delta=True))
    broadcaster.publish(_update(1, before))
    report = broadcaster.publish(_update(2, after))
    (entry,) = report.manifest.shards[0].tensors
    assert (entry.layout, entry.num_changed) == (layout, len(set(changed)))
    engine = ServingReceiver(before)
    Receiver(transport).apply(engine)
    assert torch.equal(engine.weights["w"], after["w"])


def test_delta_against_another_base_is_refused_and_a_full_republish_recovers():
    transport = InProcessTransport()
    broadcaster = Broadcaster(transport, SyncOptions(delta=True))
    broadcaster.publish(_update(1, _state(1)))
    broadcaster.publish(_update(2, _state(2)))  # a delta against version 1
    stranger = ServingReceiver(_state(9))
    with pytest.raises(RoleError, match="delta against version 1"):
        Receiver(transport).apply(stranger)
    full = broadcaster.republish_full()
    assert not full.delta and full.version == 2
    Receiver(transport).apply(stranger)
    assert stranger.fingerprint == fingerprint(_state(2))


def test_bf16_and_fp8_round_trip_error_bounds():
    g = torch.Generator().manual_seed(0)
    rows = torch.logspace(-6, 3, 64).unsqueeze(1)  # very different row scales  [64, 1]
    x = torch.randn(64, 256, generator=g) * rows  # [64, 256]
    x[0, :3] = 0.0
    state = {"w": x, "v": torch.randn(300, generator=g), "zero": torch.zeros(4, 4)}
    for encoding, relative in (("bf16", 2.0 ** -8), ("fp8", 2.0 ** -4)):
        enc = encode_state(state, version=1, encoding=encoding, bucket_bytes=1 << 20)
        stored = {k: v for s in enc.shards for k, v in s.stored.items()}
        decoded = decode_state(enc.manifest_draft(1, 0.0), stored)
        assert fingerprint(decoded) == enc.fingerprint
        for name, value in state.items():
            err = (decoded[name] - value).abs()
            bound = value.abs() * relative
            if encoding == "fp8":
                scale = stored[f"{name}::scale"] if f"{name}::scale" in stored else None
                if scale is not None:
                    bound = bound + scale.reshape(-1, 1).expand(value.reshape(scale.shape[0], -1).shape
                                                                ).reshape(value.shape) * 2.0 ** -10
            assert bool((err <= bound + 1e-30).all()), (encoding, name, float((err - bound).max()))
        assert enc.full_bytes < sum(v.numel() * 4 for v in state.values())


# -- the learner pauses until the rollout side confirms --------------------------------------


def test_confirmation_retries_then_succeeds_and_past_the_bound_raises():
    sleeps: list[float] = []
    answers = iter([(False, "server at v3"), (False, "server at v3"), (True, "")])
    assert await_confirmation(lambda: next(answers), what="v4 on s1", retries=3, backoff_s=0.1,
                              sleep=sleeps.append) == 3
    assert sleeps == [0.1, 0.2]
    sleeps.clear()
    with pytest.raises(RoleError, match=r"v4 on s1 not confirmed after 3 tries: still at v3") as err:
        await_confirmation(lambda: (False, "still at v3"), what="v4 on s1", retries=2, backoff_s=0.1,
                           sleep=sleeps.append)
    assert "paused" in (err.value.hint or "") and sleeps == [0.1, 0.2]
    sleeps.clear()
    with pytest.raises(RoleError):  # a long outage: the doubling stops at the cap
        await_confirmation(lambda: (False, "down"), what="v4 on s1", retries=8, backoff_s=0.5, sleep=sleeps.append)
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


# -- torch.distributed (gloo) ----------------------------------------------------------------


_PEER = """
import json, sys, time
from rlctl.engine.transports.distributed import DistTransport
from rlctl.engine.weight_sync import Receiver
from rlctl.models.fingerprint import fingerprint
port, mode = int(sys.argv[1]), sys.argv[2]
t = DistTransport(rank=1, world_size=2, master_port=port, timeout_s=30, join_timeout_s=60, bind_addr="127.0.0.1")
t.connect()
print("JOINED", flush=True)
if mode == "hang":
    time.sleep(600)
u = Receiver(t).receive()
print(json.dumps({"version": u.version, "got": fingerprint(u.state_dict), "claimed": u.fingerprint}), flush=True)
"""


def _peer(port: int, mode: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, "-c", _PEER, str(port), mode], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_gloo_broadcast_delivers_a_verified_version_in_buckets():
    from rlctl.engine.transports.distributed import DistTransport

    port = free_port()
    peer = _peer(port, "ok")
    try:
        sender = DistTransport(rank=0, world_size=2, master_port=port, timeout_s=30, join_timeout_s=60,
                               bind_addr="127.0.0.1")
        state = _state(5)
        report = Broadcaster(sender, SyncOptions(bucket_bytes=8 << 10)).publish(_update(6, state))
        out, err = peer.communicate(timeout=60)
        result = json.loads(out.strip().splitlines()[-1])
        assert report.num_shards > 1 and report.transport == "distributed"
        assert result == {"version": 6, "got": fingerprint(state), "claimed": fingerprint(state)}, err
        sender.close()
    finally:
        _stop(peer)


def test_peer_that_never_joins_is_an_error_naming_it_within_the_timeout():
    from rlctl.engine.transports.distributed import DistTransport

    sender = DistTransport(rank=0, world_size=2, master_port=free_port(), timeout_s=1.0, bind_addr="127.0.0.1")
    started = time.monotonic()
    with pytest.raises(RoleError, match=r"rank\(s\) 1 never joined"):
        Broadcaster(sender).publish(_update(1, _state(0)))
    assert time.monotonic() - started < 1.0 + 2.0 + 2.0


def test_hung_peer_is_an_error_naming_it_within_the_timeout_never_a_hang():
    from rlctl.engine.transports.distributed import DistTransport

    port = free_port()
    peer = _peer(port, "hang")
    try:
        sender = DistTransport(rank=0, world_size=2, master_port=port, timeout_s=2.0, join_timeout_s=60,
                               bind_addr="127.0.0.1")
        sender.connect()
        started = time.monotonic()
        with pytest.raises(RoleError, match=r"rank\(s\) 1 at 127\.0\.0\.1:\d+ never started transfer 1"):
            Broadcaster(sender).publish(_update(1, _state(0)))
        assert time.monotonic() - started < 2.0 + 2.0 + 2.0
        with pytest.raises(RoleError, match="unusable"):
            Broadcaster(sender).publish(_update(2, _state(0)))
    finally:
        _stop(peer)


# -- a publisher killed mid-publish ------------------------------------------------------------


_KILLED = """
import json, sys, time
import torch
from rlctl.contracts.types import WeightUpdate
from rlctl.engine.transports.disk import DiskTransport
from rlctl.engine.weight_codec import manifest_to_dict
from rlctl.engine.weight_sync import Broadcaster, SyncOptions
from rlctl.models.fingerprint import fingerprint
root, stage = sys.argv[1], sys.argv[2]

class Stalling(DiskTransport):
    def _write_shard(self, path, shard, parts):
        out = super()._write_shard(path, shard, parts)
        if stage == "shards" and path.name.startswith("model-00002"):
            print("STALLED", flush=True); time.sleep(600)
        return out

    def _commit(self, target, manifest):
        if stage == "manifest":
            self._write_synced(target / "manifest.json.tmp", json.dumps(manifest_to_dict(manifest)).encode())
            print("STALLED", flush=True); time.sleep(600)
        super()._commit(target, manifest)

state = {f"w{i}": torch.full((64, 64), float(i)) for i in range(8)}
Broadcaster(Stalling(root), SyncOptions(bucket_bytes=16 << 10)).publish(
    WeightUpdate(version=2, state_dict=state, fingerprint=fingerprint(state)))
"""


@pytest.mark.parametrize("stage", ["shards", "manifest"])
def test_publisher_killed_mid_publish_leaves_receivers_on_the_previous_version(tmp_path, stage):
    transport = DiskTransport(tmp_path)
    first = {f"w{i}": torch.full((64, 64), -1.0) for i in range(8)}
    Broadcaster(transport).publish(_update(1, first))
    engine = ServingReceiver({k: torch.zeros(64, 64) for k in first})
    Receiver(transport).apply(engine)
    child = subprocess.Popen([sys.executable, "-c", _KILLED, str(tmp_path), stage], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "STALLED", child.stderr.read()
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(timeout=30)
        child.stdout.close()
        child.stderr.close()
    partial = tmp_path / "v00000002-full"
    assert partial.is_dir() and not (partial / "manifest.json").exists()
    assert transport.latest_dir().name == "v00000001-full"
    Receiver(transport).apply(engine)  # a receiver polling now still gets version 1
    assert engine.policy_version == 1 and engine.fingerprint == fingerprint(first)
    with pytest.raises(RoleError, match="no committed weight version"):
        Receiver(transport).apply(engine, directory=partial)

    second = {f"w{i}": torch.full((64, 64), float(i)) for i in range(8)}
    report = Broadcaster(transport, SyncOptions(bucket_bytes=16 << 10)).publish(_update(2, second))
    assert report.location == str(partial) and not (partial / "manifest.json.tmp").exists()
    Receiver(transport).apply(engine)
    assert engine.policy_version == 2 and engine.fingerprint == fingerprint(second)
