"""Diagnosis by cause, on synthetic metric histories: onset, "follows ...", and the machine's load."""

from __future__ import annotations

from pathlib import Path

from rlctl.engine.metrics import MachineLoad
from rlctl.incidents.diagnose import diagnose
from rlctl.incidents.runbooks import load_runbooks
from rlctl.incidents.triggers import History

REPO = Path(__file__).resolve().parents[2]


def hist(**series: list[float]) -> History:
    return History(metrics={k: [(i, float(v)) for i, v in enumerate(vals)] for k, vals in series.items()})


def _length_hack_then_collapse() -> History:
    """The issue's textbook run: reward tracks length from step 2, length explodes and the reward spikes by
    step 5, the reward collapses at step 8."""
    n = 12
    length = [3, 3, 3.5, 4.5, 6, 8, 8, 8, 8, 8, 8, 8]
    reward = [0.3, 0.3, 0.35, 0.5, 0.7, 0.9, 0.9, 0.9, 0.2, 0.1, 0.1, 0.1]
    corr = [0.1, 0.2, 0.9, 0.95, 0.95, 0.9, 0.9, 0.9, 0.3, 0.2, 0.1, 0.1]
    return hist(response_length_mean=length, reward_mean=reward, reward_length_corr=corr,
                truncated_frac=[0.0] * n, nan_inf_skipped_steps=[0] * n)


def test_a_collapse_that_follows_length_hacking_ranks_after_it_and_says_so():
    d = diagnose("r", _length_hack_then_collapse(), load_runbooks(REPO / "runbooks"))
    branches = [f.branch for f in d.findings]
    assert branches.index("hacking") < branches.index("collapse")
    hacking, collapse = d.findings[branches.index("hacking")], d.findings[branches.index("collapse")]
    assert hacking.onset == 2 and collapse.onset > hacking.onset
    assert collapse.follows.startswith("follows hacking") and "follows hacking" in collapse.headline
    assert collapse.to_json()["follows"] and hacking.to_json()["follows"] is None
    assert d.top.branch == "hacking"


def test_a_collapse_with_no_earlier_cause_is_a_root():
    reward = [0.6] * 6 + [0.1] * 6
    d = diagnose("r", hist(reward_mean=reward, response_length_mean=[3.0] * 12), load_runbooks(REPO / "runbooks"))
    assert d.top.branch == "collapse" and d.top.follows == ""


def _falling_throughput(load: list[float] | None, cpu: list[float] | None = None) -> History:
    tput = [10000 - 700 * i for i in range(12)]
    series = dict(generated_tokens_per_s=tput, reward_mean=[0.1 + 0.02 * i for i in range(12)])
    if load is not None:
        series.update(host_load_per_cpu=load, process_cpu_frac=cpu or [1.0 - 0.01 * i for i in range(12)])
    return hist(**series)


def test_falling_throughput_on_a_busy_machine_names_the_load_not_the_engine():
    books = load_runbooks(REPO / "runbooks")
    plain = diagnose("r", _falling_throughput(None), books)
    assert plain.top.branch == "lag" and plain.top.severity == "warning"  # no load recorded: unchanged
    busy = diagnose("r", _falling_throughput([0.4] * 4 + [1.5 + 0.2 * i for i in range(8)]), books)
    assert busy.top.severity == "info" and "machine was busy" in busy.top.title
    assert "load average" in busy.top.headline and "not the engine" in busy.top.headline
    idle = diagnose("r", _falling_throughput([0.2] * 12), books)
    assert idle.top.severity == "warning" and "busy" not in idle.top.headline  # the engine it is
    # the 1-minute load average lags; a process getting half a CPU while the load is 0.86 per CPU is starved
    starved = diagnose("r", _falling_throughput([0.86] * 12, [1.0] * 4 + [0.5] * 8), books)
    assert starved.top.severity == "info" and "got 0.50 of a CPU by the end (vs 1.00)" in starved.top.headline


def test_machine_load_is_sampled_cheaply_per_step():
    load = MachineLoad()
    sum(i * i for i in range(20000))  # some CPU work between two samples
    sample = load.sample()
    assert 0.0 <= sample["process_cpu_frac"] <= 64 and sample.get("host_load_per_cpu", 0.0) >= 0.0


def test_a_live_throughput_alert_on_a_busy_machine_says_so():
    from types import SimpleNamespace

    from rlctl.incidents.recovery import _Alerts

    warnings = []
    registry = SimpleNamespace(add_event=lambda run_id, kind, message, data: None)
    alerts = _Alerts(registry, "r", warnings.append, start_step=0)
    alerts.books = [b for b in load_runbooks(REPO / "runbooks") if b.name == "queue-lag"]
    for step in range(12):
        alerts.observe(step, {"generated_tokens_per_s": 10000 - 700 * step, "process_cpu_frac": 1.0 if step < 4
                              else 0.5, "host_load_per_cpu": 0.9}, [])
    assert len(warnings) == 1 and "falls steadily" in warnings[0] and "the machine was busy" in warnings[0]
