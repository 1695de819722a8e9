"""Triggers, runbooks and the diagnosis ranking over synthetic histories (no training, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from rlctl.contracts.errors import RunbookError
from rlctl.ops.diagnose import diagnose, render_html
from rlctl.ops.runbooks import find_runbook, load_runbooks, parse_runbook, runbook_dirs
from rlctl.ops.triggers import History, Trigger, evaluate

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Ev:
    kind: str
    message: str = ""
    data: dict = field(default_factory=dict)
    created_at: float = 0.0


def hist(**series: list[float]) -> History:
    return History(metrics={k: [(i, float(v)) for i, v in enumerate(vals)] for k, vals in series.items()})


def test_above_needs_a_run_of_window_steps_and_reports_the_worst() -> None:
    t = Trigger(id="x", when="above", metric="clip_fraction", threshold=0.5, window=2, summary="s")
    assert evaluate(t, hist(clip_fraction=[0.1, 0.6, 0.2, 0.7])) is None  # never 2 in a row
    f = evaluate(t, hist(clip_fraction=[0.1, 0.6, 0.9, 0.2, 0.7, 0.8, 0.55]))
    assert f is not None and f.windows == ((1, 2), (4, 6))
    assert "worst 0.9 at step 2" in f.detail


def test_increases_counts_counter_growth_and_nonfinite_reads_events() -> None:
    inc = Trigger(id="n", when="increases", metric="nan_inf_skipped_steps", window=2, summary="s")
    assert evaluate(inc, hist(nan_inf_skipped_steps=[0, 0, 1, 1, 2])) is None  # never 2 in a row
    assert evaluate(inc, hist(nan_inf_skipped_steps=[0, 1, 2, 2])).windows == ((1, 2),)
    nf = Trigger(id="l", when="nonfinite", metric="loss", summary="s")
    h = History(metrics={"loss": [(0, 1.0), (1, math.inf)]},
                events=[Ev("metric_nonfinite", data={"name": "loss", "step": 2})])
    assert evaluate(nf, h).windows == ((1, 2),)


def test_drops_compares_adjacent_window_means() -> None:
    t = Trigger(id="d", when="drops", metric="reward_mean", by=0.25, window=3, summary="s")
    assert evaluate(t, hist(reward_mean=[0.5, 0.5, 0.5, 0.45, 0.4, 0.4])) is None
    f = evaluate(t, hist(reward_mean=[0.6, 0.6, 0.6, 0.2, 0.2, 0.2]))
    assert f is not None and "0.6 -> 0.2" in f.detail


def test_falls_steadily_and_occurs() -> None:
    t = Trigger(id="f", when="falls_steadily", metric="tps", by_ratio=0.4, window=5, summary="s")
    assert evaluate(t, hist(tps=[100, 90, 80, 70, 50])) is not None
    assert evaluate(t, hist(tps=[100, 110, 90, 120, 95])) is None
    o = Trigger(id="o", when="occurs", event="oom_recovered", summary="s")
    h = History(metrics={}, events=[Ev("oom_recovered", "m", {"step": 3})])
    assert evaluate(o, h).windows == ((3, 3),)


@pytest.mark.parametrize("raw, problem", [
    ({"id": "a", "when": "above", "metric": "m", "summary": "s"}, "needs `threshold`"),
    ({"id": "a", "when": "occurs", "summary": "s"}, "needs `event"),
    ({"id": "a", "when": "drops", "metric": "m", "summary": "s"}, "needs `by`"),
    ({"id": "a", "when": "sometimes", "metric": "m", "summary": "s"}, "when"),
])
def test_bad_triggers_are_refused_with_the_rule(raw: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        Trigger(**raw)


@given(st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=30), st.floats(-1e3, 1e3))
def test_above_flags_exactly_the_steps_over_the_bound(values: list[float], bound: float) -> None:
    t = Trigger(id="p", when="above", metric="m", threshold=bound, summary="s")
    f = evaluate(t, hist(m=values))
    flagged = {s for s, _ in f.values} if f else set()
    assert flagged == {i for i, v in enumerate(values) if v > bound}


def test_shipped_runbooks_cover_every_incident_and_validate() -> None:
    books = {b.name: b for b in load_runbooks(REPO / "runbooks")}
    assert {"reward-drop-or-nan", "oom", "verifier-timeouts", "queue-lag", "length-collapse-or-reward-hacking",
            "weight-sync-failure", "hang", "instability", "network-partition", "worker-crash"} <= set(books)
    for book in books.values():
        assert book.checks and all(c.startswith("rlctl ") for c in book.checks)
    assert runbook_dirs()[0] == REPO / "runbooks"
    with pytest.raises(RunbookError, match="did you mean 'oom'"):
        find_runbook("oomm", list(books.values()))


def test_a_malformed_runbook_names_file_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "x.md"
    bad.write_text("---\nname: x\ntitle: X\nbranch: b\ntriggers: []\nactions: [a]\n---\nbody\n")
    with pytest.raises(RunbookError, match=r"x.md: triggers"):
        parse_runbook(bad)
    bad.write_text("no front matter")
    with pytest.raises(RunbookError, match="no YAML front matter"):
        parse_runbook(bad)
    bad.write_text("---\nname: y\ntitle: X\nbranch: b\ntriggers: [{id: a, when: occurs, event: e, summary: s}]\n"
                   "checks: [ls /]\nactions: [a]\n---\n")
    with pytest.raises(RunbookError, match="not an rlctl command"):
        parse_runbook(bad)


def test_diagnose_ranks_critical_numerics_over_a_grader_warning_and_renders_html() -> None:
    books = load_runbooks(REPO / "runbooks")
    h = History(metrics={
        "nan_inf_skipped_steps": [(i, float(max(0, i - 3))) for i in range(8)],
        "verifier_retries": [(i, 2.0) for i in range(8)],
        "reward_mean": [(i, 0.5) for i in range(8)],
    }, events=[Ev("metric_nonfinite", data={"name": "loss", "step": 4})])
    d = diagnose("r1", h, books)
    assert [f.branch for f in d.findings][:2] == ["numerics", "grader"]
    assert d.top.runbook == "reward-drop-or-nan" and d.top.severity == "critical"
    page = render_html(d, h)
    assert page.count("data:image/png;base64,") == len(d.findings) and "reward-drop-or-nan" in page


def test_a_healthy_history_has_no_findings() -> None:
    h = hist(reward_mean=[0.1 + 0.01 * i for i in range(10)], clip_fraction=[0.1] * 10,
             response_length_mean=[4.0] * 10, nan_inf_skipped_steps=[0] * 10)
    assert diagnose("r", h, load_runbooks(REPO / "runbooks")).findings == ()
