"""Learner -> Broadcaster -> transport -> Receiver -> local rollout engine, with the real tiny model.

After every publish the engine's weight fingerprint equals the learner's and the
behaviour logprobs it samples match the learner's recompute to <= 1e-4 (fp32),
through the in-process and the disk transports (the HTTP server path is in
test_serve_sglang.py). The bf16 path is checked for what it promises instead:
the fingerprint of the bf16-rounded weights, and a bounded logprob gap.
"""

from __future__ import annotations

import pytest

from rlctl.config.load import load_config
from tests.helpers import rollout_batch
from tests.conftest import TINY_OVERRIDES


def _session(plugins, home, extra=()):
    from tests.helpers import build_roles

    return build_roles(load_config(None, [*TINY_OVERRIDES, "train.optim.lr=1e-3", *extra]), plugins, home / "cache")


_batch = rollout_batch


def _mismatch(session, batch) -> float:
    mask = batch.action_mask > 0
    return float((session.learner.logprobs(batch) - batch.behavior_logprobs)[mask].abs().max())


def _transport(kind, tmp_path):
    from rlctl.engine.transports.disk import DiskTransport
    from rlctl.engine.transports.inprocess import InProcessTransport

    return InProcessTransport() if kind == "inprocess" else DiskTransport(tmp_path / "pub")


@pytest.mark.parametrize("kind", ["inprocess", "disk"])
@pytest.mark.parametrize("delta", [False, True])
def test_each_publish_leaves_rollout_and_learner_identical(plugins, _rlctl_home, tiny_policy_dir, tmp_path,
                                                           kind, delta):
    from rlctl.engine.weight_sync import Broadcaster, Receiver, SyncOptions

    session = _session(plugins, _rlctl_home)
    transport = _transport(kind, tmp_path)
    broadcaster, receiver = Broadcaster(transport, SyncOptions(delta=delta, bucket_bytes=32 << 10)), Receiver(transport)
    for version in (1, 2, 3):
        _, batch = _batch(session, advantages=[1.0, -1.0] * 8)
        session.learner.train_step(batch)
        exported = session.learner.export_weights()
        report = broadcaster.publish(exported)
        assert report.delta == (delta and version > 1)
        receiver.apply(session.rollout)
        health = session.rollout.health()
        assert health["fingerprint"] == exported.fingerprint and health["policy_version"] == version
        trajectories, batch = _batch(session)
        assert {t.policy_version for t in trajectories} == {version}
        assert _mismatch(session, batch) <= 1e-4


def test_bf16_transfer_serves_the_rounded_weights_it_announces(plugins, _rlctl_home, tiny_policy_dir, tmp_path):
    from rlctl.engine.weight_sync import Broadcaster, Receiver, SyncOptions

    session = _session(plugins, _rlctl_home)
    transport = _transport("disk", tmp_path)
    broadcaster = Broadcaster(transport, SyncOptions(encoding="bf16", delta=True))
    for _ in range(2):
        _, batch = _batch(session, advantages=[1.0, -1.0] * 8)
        session.learner.train_step(batch)
        report = broadcaster.publish(session.learner.export_weights())
        Receiver(transport).apply(session.rollout)
        assert session.rollout.health()["fingerprint"] == report.manifest.fingerprint
    _, batch = _batch(session)
    assert 0.0 < _mismatch(session, batch) < 0.05  # bf16 weights: a visible, small, bounded gap
