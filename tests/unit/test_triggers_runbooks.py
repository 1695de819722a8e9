"""Triggers, runbooks and the diagnosis ranking over synthetic histories (no training, no torch)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from rlctl.contracts.errors import RunbookError
from rlctl.incidents.diagnose import diagnose, render_html
from rlctl.incidents.runbooks import find_runbook, load_runbooks, parse_runbook, runbook_dirs
from rlctl.incidents.triggers import History, Trigger, evaluate

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


def test_a_longer_baseline_is_the_reference_mean_before_the_window() -> None:
    t = Trigger(id="d", when="drops", metric="m", by_ratio=0.3, window=2, baseline=4, summary="s")
    assert "mean of 2 steps vs the 4 before" in t.describe()
    assert evaluate(t, hist(m=[1.0, 1.0, 1.0, 0.6, 0.6])) is None  # only 3 steps before the window: not evaluated
    f = evaluate(t, hist(m=[1.0, 1.2, 0.8, 1.0, 0.6, 0.6]))  # mean 1.0 of steps 0-3 -> 0.6: -40%
    assert f is not None and f.windows == ((4, 5),) and "1 -> 0.6" in f.detail and "steps 0-5" in f.detail
    assert evaluate(t, hist(m=[1.0, 1.2, 0.8, 1.0, 0.8, 0.8])) is None  # -20%


# Entropy per step of the quickstart (configs/quickstart.yaml, seed 0, 100 GRPO steps, lr 2e-5): a healthy run.
# The old entropy-jump rule (2 steps vs the 2 before, +15%) fired on it at step 27 (0.468 -> 0.545): noise.
QUICKSTART_SEED0_ENTROPY = [
    0.501, 0.536, 0.516, 0.554, 0.516, 0.480, 0.486, 0.545, 0.481, 0.547, 0.500, 0.536, 0.526, 0.456, 0.516, 0.561,
    0.548, 0.518, 0.513, 0.565, 0.605, 0.545, 0.532, 0.487, 0.475, 0.462, 0.533, 0.556, 0.488, 0.547, 0.495, 0.518,
    0.482, 0.577, 0.539, 0.526, 0.506, 0.509, 0.488, 0.522, 0.513, 0.505, 0.539, 0.540, 0.526, 0.545, 0.468, 0.517,
    0.503, 0.509, 0.460, 0.507, 0.502, 0.456, 0.510, 0.519, 0.531, 0.501, 0.538, 0.511, 0.505, 0.529, 0.487, 0.534,
    0.483, 0.474, 0.484, 0.522, 0.485, 0.524, 0.525, 0.492, 0.511, 0.469, 0.455, 0.503, 0.490, 0.571, 0.532, 0.558,
    0.532, 0.548, 0.429, 0.512, 0.448, 0.535, 0.513, 0.536, 0.534, 0.521, 0.501, 0.564, 0.523, 0.472, 0.482, 0.479,
    0.487, 0.516, 0.488, 0.518]
# Seed 3 (`run.seed=3`: its own warm start, entropy 0.65 with a 9.8% step-to-step spread): healthy, noisier.
QUICKSTART_SEED3_ENTROPY = [
    0.666, 0.613, 0.619, 0.718, 0.566, 0.780, 0.633, 0.698, 0.750, 0.687, 0.680, 0.591, 0.680, 0.637, 0.569, 0.625,
    0.617, 0.568, 0.598, 0.673, 0.796, 0.583, 0.638, 0.738, 0.650, 0.538, 0.673, 0.699, 0.604, 0.722, 0.711, 0.655,
    0.774, 0.653, 0.567, 0.596, 0.607, 0.675, 0.586, 0.634, 0.506, 0.646, 0.661, 0.735, 0.591, 0.685, 0.607, 0.621,
    0.604, 0.663, 0.643, 0.673, 0.776, 0.603, 0.679, 0.644, 0.721, 0.554, 0.670, 0.557, 0.494, 0.643, 0.581, 0.633,
    0.661, 0.660, 0.621, 0.575, 0.670, 0.832, 0.680, 0.700, 0.649, 0.521, 0.602, 0.607, 0.560, 0.562, 0.604, 0.657,
    0.644, 0.594, 0.623, 0.648, 0.670, 0.699, 0.765, 0.663, 0.682, 0.691, 0.686, 0.663, 0.597, 0.602, 0.691, 0.687,
    0.736, 0.637, 0.607, 0.718]
# Seed 0's warm start at lr 2e-3 (100x): a real collapse (reward 0.31 -> 0.10, every group's rewards equal by step 12).
COLLAPSE_LR_2E3_ENTROPY = [
    0.501, 0.501, 0.487, 0.525, 0.455, 0.352, 0.425, 0.434, 0.342, 0.302, 0.295, 0.277, 0.243, 0.207, 0.182, 0.177,
    0.121, 0.242, 0.185, 0.195]


def _entropy_firings(values: list[float]) -> dict[str, object]:
    book = {b.name: b for b in load_runbooks(REPO / "runbooks")}["instability"]
    triggers = [t for t in book.triggers if t.metric == "entropy"]
    assert {t.id for t in triggers} == {"entropy-jump", "entropy-collapse"}
    return {t.id: f for t in triggers if (f := evaluate(t, hist(entropy=values))) is not None}


def test_entropy_triggers_stay_silent_on_the_quickstarts_noise() -> None:
    old = Trigger(id="old", when="rises", metric="entropy", by_ratio=0.15, window=2, summary="s")
    for healthy in (QUICKSTART_SEED0_ENTROPY, QUICKSTART_SEED3_ENTROPY):
        assert evaluate(old, hist(entropy=healthy)) is not None  # the false positive this replaces
        assert _entropy_firings(healthy) == {}


def test_entropy_triggers_fire_on_a_real_collapse_and_a_real_jump() -> None:
    collapse = _entropy_firings(COLLAPSE_LR_2E3_ENTROPY)
    assert set(collapse) == {"entropy-collapse"} and collapse["entropy-collapse"].windows[0][0] <= 12
    healthy = QUICKSTART_SEED0_ENTROPY[:30]
    jump = _entropy_firings(healthy + [1.4 * v for v in healthy[:5]])  # randomised: +40% from step 30 on
    assert set(jump) == {"entropy-jump"} and jump["entropy-jump"].windows[0][0] == 30
    # a slow, steady 30% drift over 30 steps is a trend for the reward curves, not a live collapse alert
    assert _entropy_firings([0.5 * (1 - 0.01 * i) for i in range(30)]) == {}


def test_the_live_alerts_keep_enough_history_for_every_shipped_trigger() -> None:
    from rlctl.incidents.recovery import ALERT_WINDOW

    for book in load_runbooks(REPO / "runbooks"):
        for t in book.triggers:
            need = t.window + (t.baseline or t.window) if t.when in ("rises", "drops") else t.window
            assert need <= ALERT_WINDOW, f"{book.name}/{t.id} needs {need} steps; live alerts keep {ALERT_WINDOW}"


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
    ({"id": "a", "when": "above", "metric": "m", "threshold": 1, "baseline": 5, "summary": "s"}, "rises/drops only"),
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


def test_a_live_alert_flickering_at_its_bound_is_one_report_until_it_has_been_quiet():
    """A trigger that fires, falls silent for a step or two and fires again is the same episode (one warning, one
    alert event); after REALERT_AFTER quiet steps, or when the run went back to an earlier step, it is new."""
    from types import SimpleNamespace

    from rlctl.incidents.recovery import REALERT_AFTER, _Alerts

    events, warnings = [], []
    registry = SimpleNamespace(add_event=lambda run_id, kind, message, data: events.append(data["step"]))
    alerts = _Alerts(registry, "r", warnings.append, start_step=0)
    trigger = Trigger(id="hot", when="above", metric="x", threshold=1.0, window=1, summary="x is high")
    alerts.books = [SimpleNamespace(name="book", triggers=[trigger], branch_of=lambda t: "other")]
    hot = {2, 3, 5, 7, 8, 8 + REALERT_AFTER + 1}
    for step in range(8 + REALERT_AFTER + 2):
        alerts.observe(step, {"x": 2.0 if step in hot else 0.0}, [])
    assert events == [2, 8 + REALERT_AFTER + 1] and len(warnings) == 2
    alerts.observe(3, {"x": 2.0}, [])  # rolled back to step 3: a new episode
    assert events[-1] == 3
