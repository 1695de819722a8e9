"""All-or-nothing weight updates on the local rollout engine, through every receiver path.

An update with any mismatched tensor (shape, dtype, a missing or extra name,
a tied pair that differs, a fingerprint that does not match) must leave every
served tensor bitwise unchanged and the reported fingerprint and version as
they were; a valid one is swapped in whole and served by the next generate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlctl.contracts.errors import RoleError
from rlctl.contracts.types import RolloutContext, RolloutRequest, SamplingConfig, WeightUpdate
from rlctl.engine.transports.disk import DiskTransport
from rlctl.engine.transports.inprocess import InProcessTransport
from rlctl.engine.weight_sync import Broadcaster, Receiver
from rlctl.models.fingerprint import fingerprint


@pytest.fixture()
def engine(plugins, tiny_policy_dir):
    from rlctl.models.tokenizer import tokenizer_hash

    ctx = RolloutContext(model_dir=str(tiny_policy_dir), tokenizer_hash=tokenizer_hash(tiny_policy_dir), seed=0)
    built = plugins.build("rollout_backend", "local", {}, "test", ctx=ctx)
    yield built
    built.close()


def _snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.state_dict().items()}


def _unchanged(engine, before: dict[str, torch.Tensor], fp: str, version: int) -> None:
    now = engine.state_dict()
    assert set(now) == set(before)
    assert all(torch.equal(now[k], before[k]) for k in before), "a served tensor changed"
    assert engine.health()["fingerprint"] == fp == fingerprint(now)
    assert engine.policy_version == version


def _moved(state: dict[str, torch.Tensor], seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()
           for k, v in state.items()}
    out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied in the tiny model
    return out


def _bad_updates(state: dict[str, torch.Tensor]):
    names = sorted(k for k in state if k.endswith("mlp.up_proj.weight"))
    wide = _moved(state)
    wide[names[-1]] = torch.zeros(state[names[-1]].shape[0] * 2, state[names[-1]].shape[1])  # the LAST one
    yield "shape", wide
    missing = _moved(state)
    missing.pop(names[0])
    yield "lacks", missing
    extra = _moved(state)
    extra["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    yield "does not", extra
    ints = _moved(state)
    ints[names[0]] = ints[names[0]].to(torch.int32)
    yield "dtype", ints
    untied = _moved(state)
    untied["lm_head.weight"] = untied["lm_head.weight"] + 1.0
    yield "tied", untied


def test_a_mismatched_update_leaves_every_served_tensor_unchanged(engine):
    before, fp = _snapshot(engine), engine.health()["fingerprint"]
    for needle, candidate in _bad_updates(before):
        with pytest.raises(RoleError, match=needle):
            engine.update_weights(WeightUpdate(version=5, state_dict=candidate, fingerprint=fingerprint(candidate)))
        _unchanged(engine, before, fp, 0)
    good = _moved(before)
    with pytest.raises(RoleError, match="fingerprint mismatch"):
        engine.update_weights(WeightUpdate(version=5, state_dict=good, fingerprint="0" * 24))
    _unchanged(engine, before, fp, 0)


def test_a_valid_update_is_swapped_in_whole_and_served(engine):
    before = _snapshot(engine)
    request = RolloutRequest(prompt_id="p", prompt_tokens=(1, 5, 6), group_size=1,
                             sampling=SamplingConfig(temperature=0.0, max_tokens=6), dataset_version="t")
    old_logprobs = engine.generate([request])[0].behavior_logprobs
    good = _moved(before)
    engine.update_weights(WeightUpdate(version=3, state_dict=good, fingerprint=fingerprint(good)))
    now = engine.state_dict()
    assert all(torch.equal(now[k], good[k]) for k in good)
    assert engine.health()["fingerprint"] == fingerprint(good) and engine.policy_version == 3
    assert now["lm_head.weight"].data_ptr() == now["model.embed_tokens.weight"].data_ptr()  # still tied
    good["model.norm.weight"].add_(1.0)  # the sender's tensors do not alias the served ones
    assert not torch.equal(engine.state_dict()["model.norm.weight"], good["model.norm.weight"])
    traj = engine.generate([request])[0]
    assert traj.policy_version == 3 and traj.behavior_logprobs != old_logprobs


def _transports(kind: str, tmp_path: Path):
    """(sending transport, receiving transport, cleanup) for one receiver path."""
    if kind == "inprocess":
        t = InProcessTransport()
        return t, t, lambda: None
    if kind == "disk":
        t = DiskTransport(tmp_path)
        return t, t, lambda: None
    import socket
    import threading

    from rlctl.engine.transports.distributed import DistTransport

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sender, receiver = (DistTransport(rank=r, world_size=2, master_port=port, timeout_s=30, join_timeout_s=30,
                                      bind_addr="127.0.0.1") for r in (0, 1))
    joined = threading.Thread(target=receiver.connect)
    joined.start()
    sender.connect()
    joined.join()
    return sender, receiver, lambda: (sender.close(), receiver.close())


def _deliver(broadcaster: Broadcaster, receiver: Receiver, engine, update: WeightUpdate) -> None:
    """Publish ``update`` and apply it on ``engine`` (concurrently for a broadcast, which needs both ends)."""
    import threading

    if broadcaster.transport.name != "distributed":
        broadcaster.publish(update)
        receiver.apply(engine)
        return

    sent: dict[str, BaseException] = {}

    def publish() -> None:
        try:
            broadcaster.publish(update)
        except BaseException as err:  # noqa: BLE001 - re-raised below
            sent["error"] = err

    thread = threading.Thread(target=publish)
    thread.start()
    try:
        receiver.apply(engine)
    finally:
        thread.join(timeout=60)
        if "error" in sent:
            raise sent["error"]


@pytest.mark.parametrize("kind", ["inprocess", "disk", "gloo"])
def test_every_receiver_refuses_a_mismatched_version_whole(engine, tmp_path: Path, kind):
    """In-process, disk and torch.distributed (gloo) receivers decode, then apply all or nothing."""
    before, fp = _snapshot(engine), engine.health()["fingerprint"]
    sending, receiving, cleanup = _transports(kind, tmp_path)
    try:
        broadcaster, receiver = Broadcaster(sending), Receiver(receiving)
        for version, (_, candidate) in enumerate(_bad_updates(before), start=1):
            with pytest.raises(RoleError):
                _deliver(broadcaster, receiver, engine,
                         WeightUpdate(version=version, state_dict=candidate, fingerprint=fingerprint(candidate)))
            _unchanged(engine, before, fp, 0)
        good = _moved(before)
        _deliver(broadcaster, receiver, engine, WeightUpdate(version=9, state_dict=good, fingerprint=fingerprint(good)))
        assert engine.policy_version == 9 and engine.health()["fingerprint"] == fingerprint(good)
    finally:
        cleanup()


def test_a_bf16_update_is_checked_as_sent_then_served_cast_to_the_engines_fp32(engine):
    """A bf16 learner publishes bf16 weights; the fp32 engine verifies the fingerprint of what was sent, then
    serves the fp32 cast (this failed the bf16 quickstart with a fingerprint mismatch before)."""
    sent = {k: (v.detach() * 1.01).to(torch.bfloat16) for k, v in engine.state_dict().items()}
    before, fp, version = _snapshot(engine), engine.health()["fingerprint"], engine.policy_version
    tampered = dict(sent)
    name = next(k for k in sorted(tampered) if ".layers." in k)
    tampered[name] = tampered[name] + 1
    with pytest.raises(RoleError, match="fingerprint mismatch"):
        engine.update_weights(WeightUpdate(version=1, state_dict=tampered, fingerprint=fingerprint(sent)))
    _unchanged(engine, before, fp, version)
    engine.update_weights(WeightUpdate(version=1, state_dict=sent, fingerprint=fingerprint(sent)))
    served = engine.state_dict()
    assert all(served[k].dtype == torch.float32 and torch.equal(served[k], v.float()) for k, v in sent.items())
    assert engine.policy_version == 1 and engine.health()["fingerprint"] == fingerprint(served)
