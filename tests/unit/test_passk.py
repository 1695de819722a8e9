"""pass@k: the unbiased estimator against the closed form, its edge cases, and the bootstrap summary."""

from __future__ import annotations

from math import comb

import pytest
from hypothesis import given, settings, strategies as st

from rlctl.contracts.errors import ConfigError
from rlctl.lifecycle.passk import parse_ks, pass_at_k, samples_for, summarize


def closed_form(n: int, c: int, k: int) -> float:
    return 1.0 - comb(n - c, k) / comb(n, k)


@pytest.mark.parametrize("n,c,k,expected", [
    (10, 0, 1, 0.0), (10, 10, 1, 1.0), (10, 3, 1, 0.3), (10, 1, 10, 1.0), (10, 0, 10, 0.0),
    (5, 2, 2, 1 - 3 / 10),  # C(3,2)/C(5,2) = 3/10
    (4, 1, 2, 0.5),  # C(3,2)/C(4,2) = 3/6
    (20, 5, 10, 1 - comb(15, 10) / comb(20, 10)),
    (200, 1, 100, 0.5),
])
def test_hand_made_counts(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_matches_the_closed_form(args):
    n, c, k = args
    value = pass_at_k(n, c, k)
    assert value == pytest.approx(closed_form(n, c, k), abs=1e-9)
    assert 0.0 <= value <= 1.0
    if c < n:  # more correct samples never lower pass@k; a larger k never lowers it either
        assert pass_at_k(n, c + 1, k) >= value - 1e-12
    if k < n:
        assert pass_at_k(n, c, k + 1) >= value - 1e-12


def test_stable_where_the_binomials_overflow_floats():
    # C(2000, 1000) is far beyond a double; the product form still gives a number in [0, 1]
    value = pass_at_k(2000, 3, 1000)
    assert value == pytest.approx(1 - (1000 * 999 * 998) / (2000 * 1999 * 1998))


def test_rejects_bad_arguments():
    for n, c, k in [(5, 6, 1), (5, 1, 6), (5, 1, 0), (5, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_parse_ks_and_samples():
    assert parse_ks("10, 1,1") == [1, 10]
    for bad in ("", "0", "a", "1,-2"):
        with pytest.raises(ConfigError):
            parse_ks(bad)
    assert samples_for([1, 10], None, 0.8) == 10
    assert samples_for([1], None, 0.0) == 1
    with pytest.raises(ConfigError, match="fewer than the largest k"):
        samples_for([1, 10], 5, 0.8)
    with pytest.raises(ConfigError, match="temperature"):
        samples_for([1, 10], None, 0.0)


def test_summary_means_cis_and_per_prompt_records():
    counts, n = [0, 1, 4, 4, 2], 4
    out = summarize(counts, n, [1, 2], [f"p{i}" for i in range(5)], bootstrap_samples=500, seed=1)
    mean1 = sum(c / n for c in counts) / len(counts)
    assert out["pass_at_k"]["1"]["value"] == pytest.approx(mean1)
    mean2 = sum(closed_form(n, c, 2) for c in counts) / len(counts)
    assert out["pass_at_k"]["2"]["value"] == pytest.approx(mean2)
    for row in out["pass_at_k"].values():
        assert row["ci_low"] <= row["value"] <= row["ci_high"]
    assert out["prompts"][2] == {"id": "p2", "correct": 4, "pass_at_k": {"1": 1.0, "2": 1.0}}
    assert summarize(counts, n, [1], list("abcde"), 500, 1) == summarize(counts, n, [1], list("abcde"), 500, 1)
