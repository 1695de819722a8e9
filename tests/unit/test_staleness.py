"""The staleness simulator against regimes with a known answer."""

from __future__ import annotations

import pytest

from rlctl.planning.staleness import SimParams, pareto, predict


def params(mode: str, k: int, learn_s: float, token_s: float, **kw) -> SimParams:
    ahead = {"sync": 0, "one_step_off": 1}.get(mode, k)
    base = dict(mode=mode, max_staleness=k, prompts_per_step=8, group_size=4, workers=2, chunk=4,
                capacity=(ahead + 1) * 8, learn_s=learn_s, token_s=token_s, steps=120)
    base.update(kw)
    return SimParams(**base)


def fixed(n: int):
    return lambda rng: n


def test_sync_is_never_stale_and_both_sides_wait():
    p = predict(params("sync", 0, learn_s=1.0, token_s=0.05), fixed(10))
    assert p.staleness_mean == 0 and p.staleness_p95 == 0 and p.drop_rate == 0
    assert p.learner_wait_share > 0.2 and p.rollout_wait_share > 0.2


@pytest.mark.parametrize("k", [1, 2, 3])
def test_learner_bound_async_runs_exactly_k_ahead(k):
    """Instant rollout, slow learner: every batch is generated as soon as it is admitted, k versions early."""
    p = predict(params("async", k, learn_s=1.0, token_s=1e-6), fixed(8))
    assert p.staleness_mean == pytest.approx(k, abs=0.05) and p.staleness_p95 == k
    assert p.learner_wait_share < 0.02


def test_rollout_bound_async_stays_fresh():
    """Instant learner, slow rollout: the bound is never reached; only the batch in flight during a step lags.

    Workers start their next call with the weights they have while the learner
    steps, so with exactly one batch in flight every group is one version old.
    """
    p = predict(params("async", 2, learn_s=1e-4, token_s=0.1), fixed(8))
    assert p.staleness_mean == pytest.approx(1.0, abs=0.05) and p.staleness_p95 == 1
    assert p.rollout_wait_share < 0.01 and p.learner_wait_share > 0.95


def test_overlap_beats_sync_and_tail_raises_staleness():
    tail = pareto(1.2, 2, 64)
    sync = predict(params("sync", 0, learn_s=0.5, token_s=0.01), tail)
    one = predict(params("one_step_off", 1, learn_s=0.5, token_s=0.01), tail)
    two = predict(params("async", 2, learn_s=0.5, token_s=0.01), tail)
    assert one.steps_per_s > sync.steps_per_s and two.steps_per_s >= one.steps_per_s * 0.98
    assert one.staleness_p95 <= 1 and two.staleness_p95 <= 2 and two.staleness_mean >= one.staleness_mean - 0.05


def test_partial_rollout_waits_less_and_keeps_the_bound():
    """one_step_off with partial_fraction 0.5: the learner proceeds on half a batch; carried groups obey dv <= 1."""
    tail = pareto(1.2, 2, 64)
    full = predict(params("one_step_off", 1, learn_s=0.3, token_s=0.01, workers=4, chunk=2), tail)
    partial = predict(params("one_step_off", 1, learn_s=0.3, token_s=0.01, workers=4, chunk=2, min_groups=4), tail)
    assert partial.learner_wait_share < full.learner_wait_share
    assert partial.staleness_p95 <= 1 and full.staleness_p95 <= 1
    assert partial.groups_per_s <= partial.steps_per_s * 8 + 1e-9 and full.groups_per_s == pytest.approx(
        full.steps_per_s * 8)
