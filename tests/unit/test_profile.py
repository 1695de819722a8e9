"""Profile maths on hand-made stage times: coverage, critical path, U_pipe, split estimates, latency, chart."""

from __future__ import annotations

import pytest

from rlctl.planning.profile import WALL_METRIC, StepTimes, latency, measured_placement, profile_run, split_estimates


def _step(step, r, v, l, s, wall=None, gen=100.0):
    return StepTimes(step=step, stages={"T_r": r, "T_v": v, "T_l": l, "T_s": s}, wall_s=wall, generated_tokens=gen,
                     learned_tokens=gen / 2, effective_tokens=gen / 4)


@pytest.fixture()
def registry(tmp_path):
    from rlctl.registry.store import Registry

    reg = Registry.open(f"sqlite:///{tmp_path / 'reg.db'}")
    yield reg
    reg.close()


def _run(registry, steps, with_wall=True):
    run = registry.create_run(name="p", config={}, config_hash="h", code_version="c", dataset_version="d",
                              tokenizer_hash="t", seed=0, run_dir="")
    for s in steps:
        metrics = dict(s.stages, generated_tokens_per_s=s.generated_tokens / s.stages["T_r"],
                       learned_tokens_per_s=s.learned_tokens / s.stages["T_l"],
                       effective_tokens_per_s=s.effective_tokens / s.stages["T_r"], reward_mean=0.5)
        if with_wall:
            metrics[WALL_METRIC] = s.wall_s
        registry.log_metrics(run.id, s.step, metrics)
    return run


def test_measured_placement_is_serial_and_names_the_bottleneck():
    steps = [_step(0, 1.0, 0.2, 2.0, 0.3, wall=3.6), _step(1, 1.0, 0.2, 2.0, 0.3, wall=3.6)]
    p = measured_placement(steps)
    assert p.measured and p.step_s == pytest.approx(3.6)
    assert p.u_pipe == pytest.approx(3.0 / 3.6)
    assert "bottleneck T_l" in p.critical_path and "other 0.1s" in p.critical_path
    assert p.generated_tokens_per_s == pytest.approx(100 / 3.6)


def test_split_estimates_overlap_one_step_off():
    steps = [_step(0, 1.0, 0.2, 2.0, 0.3)]
    sync, off = split_estimates(steps, "split")
    assert not sync.measured and not off.measured and "ESTIMATE" in off.note
    # each pool has half the hardware: stages take twice as long
    assert sync.step_s == pytest.approx(2.0 + 0.2 + 4.0 + 0.3)
    assert off.step_s == pytest.approx(max(2.0 + 0.2, 4.0) + 0.3)
    assert off.u_pipe == pytest.approx((2.0 * 0.5 + 4.0 * 0.5) / off.step_s)
    (_, off31) = split_estimates(steps, "split:3+1")
    assert off31.stages["T_r"] == pytest.approx(1.0 / 0.75) and off31.stages["T_l"] == pytest.approx(8.0)


def test_split_spec_is_checked():
    from rlctl.contracts.errors import ConfigError

    with pytest.raises(ConfigError, match="split:R\\+L"):
        split_estimates([_step(0, 1, 1, 1, 1)], "split:x")


def test_latency_percentiles_over_steps():
    steps = [_step(i, float(i + 1), 0, 1, 0) for i in range(100)]
    lat = latency(steps)
    assert lat == {"p50_s": 51.0, "p95_s": 96.0, "p99_s": 100.0}


def test_profile_run_reads_registry_and_draws_a_chart(registry, tmp_path):
    steps = [_step(0, 0.5, 0.1, 1.0, 0.1, wall=1.75), _step(1, 0.4, 0.1, 1.1, 0.1, wall=1.72)]
    run = _run(registry, steps)
    report = profile_run(run.id, registry=registry, compare=["colocate", "split:1+1"], out=tmp_path / "c.png")
    assert [s.step for s in report.steps] == [0, 1]
    assert report.wall_s == pytest.approx(3.47)
    assert report.coverage == pytest.approx(3.4 / 3.47)
    assert report.tokens_per_s["generated (per T_r)"] == pytest.approx(200 / 0.9)
    assert len(report.placements) == 3 and report.placements[0].measured
    assert (tmp_path / "c.png").stat().st_size > 1000 and report.chart == str(tmp_path / "c.png")


def test_profile_run_without_wall_times_says_so(registry):
    run = _run(registry, [_step(0, 0.5, 0.1, 1.0, 0.1, wall=None)], with_wall=False)
    report = profile_run(run.id, registry=registry)
    assert report.wall_s is None and report.coverage is None
    assert any("not recorded" in n for n in report.notes)


def test_profile_run_needs_stage_metrics(registry):
    from rlctl.contracts.errors import RegistryError

    run = registry.create_run(name="p", config={}, config_hash="h", code_version="c", dataset_version="d",
                              tokenizer_hash="t", seed=0, run_dir="")
    registry.log_metrics(run.id, 0, {"reward_mean": 1.0})
    with pytest.raises(RegistryError, match="stage times"):
        profile_run(run.id, registry=registry)


def test_bad_compare_name(registry):
    from rlctl.contracts.errors import ConfigError

    run = _run(registry, [_step(0, 0.5, 0.1, 1.0, 0.1, wall=1.8)])
    with pytest.raises(ConfigError, match="--compare"):
        profile_run(run.id, registry=registry, compare=["ring"])


def test_an_overlapped_run_is_labelled_and_its_waits_explained(registry):
    """T_r of an overlapped step is the learner's wait: the report says so and shows both sides' waits."""
    from rlctl.planning.profile import build_report

    run = registry.create_run(name="o", config={"mode": "async"}, config_hash="h", code_version="c",
                              dataset_version="d", tokenizer_hash="t", seed=0, run_dir="")
    for step in range(3):
        registry.log_metrics(run.id, step, {"T_r": 0.1, "T_v": 0.0, "T_l": 0.9, "T_s": 0.02,
                                            "generated_tokens_per_s": 100.0, "learner_wait_s": 0.1,
                                            "rollout_wait_s": 0.05, "rollout_latency_p50_s": 0.8,
                                            "staleness_mean": 0.9})
    report = build_report(run.id, "test", registry, (), None)
    assert report.placements[0].mode == "overlapped" and "learner wait" in report.placements[0].critical_path
    [note] = report.notes[-1:]
    assert "learner's wait for a batch (mean 0.1s/step)" in note and "waited 0.05s/step" in note
    assert report.steps[0].generated_tokens == pytest.approx(100.0 * 1.02)  # per step, not per T_r


def test_tool_time_is_its_own_stage_inside_the_rollout(registry, tmp_path):
    from rlctl.cli.profile import report_json
    from rlctl.planning.profile import _lanes

    run = _run(registry, [_step(0, 0.5, 0.1, 1.0, 0.1, wall=1.75), _step(1, 0.4, 0.1, 1.1, 0.1, wall=1.72)])
    registry.log_metrics(run.id, 0, {"time_tool_s": 0.2})
    registry.log_metrics(run.id, 1, {"time_tool_s": 0.9})  # concurrent calls: more tool seconds than T_r
    report = profile_run(run.id, registry=registry, out=tmp_path / "c.png")
    assert [s.tool_s for s in report.steps] == [0.2, 0.9] and report.tool_total_s == pytest.approx(1.1)
    assert report.stage_totals["T_r"] == pytest.approx(0.9)  # the stage sum is unchanged: tools run inside T_r
    assert "T_r (T_tool 0.55s of it)" in report.placements[0].critical_path
    bars = [(round(w, 6), k) for _, w, k in _lanes(report)[0][1] if k in ("T_r", "T_tool")]
    assert bars == [(0.3, "T_r"), (0.2, "T_tool"), (0.0, "T_r"), (0.4, "T_tool")]
    assert report_json(report)["tool_total_s"] == pytest.approx(1.1)
