"""One training step for every mode: sync, one_step_off and async behave alike, locally and on Ray.

The same short config runs through the public ``train`` in each mode: the
generated-token budget (``train.max_generated_tokens``, what ``rlctl ablate``
compares at) and the wall-clock one (``train.max_wall_seconds``) stop every
one of them at the step that spends it, every mode
writes the same metric names, and an option that cannot work in a mode is
refused before any role is built, with the reason.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES

MODES = ("sync", "one_step_off", "async")
BUDGET = 250  # generated response tokens: B=4 prompts x G=4 samples x at most 6 tokens = at most 96 per step


def _train_modes(home: Path, tmp_path: Path, *extra: str) -> dict[str, list]:
    """Train the tiny config to the token budget in each mode; its metric points by mode."""
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    out = {}
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        for mode in MODES:
            config = load_config(None, [*TINY_OVERRIDES, f"mode={mode}", "train.steps=40",
                                        f"train.max_generated_tokens={BUDGET}", "eval.at_end=false",
                                        "checkpoint.every_steps=0", "staleness.max_staleness=1", *extra])
            result = train(config, registry=reg, plugins=load_plugins(), home=home, run_dir=tmp_path / mode)
            assert result.run.status == "succeeded", mode
            out[mode] = reg.metrics(result.run.id)
    return out


def _by_step(points) -> dict[int, dict[str, float]]:
    steps: dict[int, dict[str, float]] = {}
    for p in points:
        steps.setdefault(p.step, {})[p.name] = p.value
    return steps


def _check_budget_and_names(runs: dict[str, list]) -> None:
    names = {}
    for mode, points in runs.items():
        steps = _by_step(points)
        last = max(steps)
        assert sorted(steps) == list(range(last + 1)), (mode, sorted(steps))  # log_every=1: every step logged
        totals = [steps[s]["generated_tokens_total"] for s in sorted(steps)]
        assert totals[-1] >= BUDGET > totals[-2], (mode, totals)  # stopped at the step that spent the budget
        assert last < 39, mode  # long before train.steps
        assert all(b > a for a, b in zip(totals, totals[1:])), (mode, totals)
        assert steps[0]["generated_tokens_total"] == steps[0]["generated_tokens"]
        names[mode] = {frozenset(m) for m in steps.values()}
        assert len(names[mode]) == 1, f"{mode}: steps wrote different metric names"
    assert names["sync"] == names["one_step_off"] == names["async"], {
        m: sorted(next(iter(n)) ^ next(iter(names["sync"]))) for m, n in names.items()}


def test_every_mode_stops_at_the_token_budget_and_writes_the_same_metrics(_rlctl_home, tmp_path, tiny_policy_dir):
    _check_budget_and_names(_train_modes(_rlctl_home, tmp_path))


def test_every_mode_stops_at_the_step_that_spends_the_wall_clock_budget(_rlctl_home, tmp_path, tiny_policy_dir):
    """train.max_wall_seconds, the seconds analogue of the token budget (rlctl ablate --budget wall-seconds):
    each mode stops after the first step whose rl_seconds_total reaches it, however fast the machine is."""
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    budget = 1.5  # with far more steps than any machine runs in that time (a tiny step here: 25 ms)
    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        for mode in MODES:
            config = load_config(None, [*TINY_OVERRIDES, f"mode={mode}", "train.steps=2000",
                                        f"train.max_wall_seconds={budget}", "eval.at_end=false",
                                        "checkpoint.every_steps=0", "staleness.max_staleness=1"])
            result = train(config, registry=reg, plugins=load_plugins(), home=_rlctl_home, run_dir=tmp_path / mode)
            assert result.run.status == "succeeded", mode
            steps = _by_step(reg.metrics(result.run.id))
            seconds = [steps[s]["rl_seconds_total"] for s in sorted(steps)]
            assert len(seconds) < 2000 and seconds[-1] >= budget, (mode, seconds)
            assert all(s < budget for s in seconds[:-1]), (mode, seconds)
            assert all(b > a for a, b in zip(seconds, seconds[1:])), (mode, seconds)


@pytest.mark.ray
@pytest.mark.slow
def test_every_mode_on_ray_stops_at_the_token_budget_and_writes_the_same_metrics(ray_cluster, _rlctl_home,
                                                                                 tmp_path, tiny_policy_dir):
    runs = _train_modes(_rlctl_home, tmp_path, "cluster.backend=ray", "cluster.rollout_num_cpus=0.5",
                        "cluster.learner_num_cpus=0.5")
    _check_budget_and_names(runs)
    local = _by_step(_train_modes(_rlctl_home, tmp_path / "local")["async"])
    assert set(_by_step(runs["async"])[0]) == set(local[0])  # the same names as a local run


@pytest.mark.parametrize("overrides,match", [
    (["algo.name=dapo", "mode=one_step_off"], "refills filtered groups"),
    (["algo.name=dapo", "mode=async"], "refills filtered groups"),
    (["algo.name=dapo", "cluster.backend=ray"], "refills filtered groups"),
    (["staleness.queue_ttl_s=5"], "queue_ttl_s"),
])
def test_an_option_a_mode_cannot_honour_is_refused_before_any_role_is_built(plugins, _rlctl_home, overrides,
                                                                              match):
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError
    from rlctl.placement import place

    if "cluster.backend=ray" in overrides:
        pytest.importorskip("ray", reason="needs ray: pip install -e '.[ray]'")
    config = load_config(None, [*TINY_OVERRIDES, *overrides])
    with pytest.raises(ConfigError, match=match) as err:
        place(config, plugins, cache_root=_rlctl_home / "cache")  # fails before Ray starts or a model loads
    assert err.value.hint


def test_an_option_a_mode_ignores_is_warned_about(plugins, _rlctl_home, tmp_path, tiny_policy_dir):
    from rlctl.config.load import load_config
    from rlctl.engine.spec import ignored_options

    sync = load_config(None, [*TINY_OVERRIDES, "cluster.num_rollout_workers=3"])
    assert any("num_rollout_workers=3 is ignored" in note for note in ignored_options(sync))
    assert ignored_options(load_config(None, [*TINY_OVERRIDES, "mode=async", "cluster.num_rollout_workers=3"])) == []
    assert ignored_options(load_config(None, TINY_OVERRIDES)) == []  # the default is not the user's choice


def test_roles_are_frozen_and_never_reassigned(tiny_session):
    """The roles a placement hands the loops cannot change under them: assigning a field fails, and no code
    under rlctl/ sidesteps that (object.__setattr__ on roles, or reassigning a role attribute)."""
    import re

    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_session.learner = None  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        tiny_session.rollout = None  # type: ignore[misc]
    repo = Path(__file__).resolve().parents[2]
    fields = "|".join(f.name for f in dataclasses.fields(tiny_session))
    pattern = re.compile(rf"\b(roles|session)\.({fields})\s*=[^=]|object\.__setattr__\(\s*(roles|session)")
    hits = [f"{path.relative_to(repo)}:{n}: {line.strip()}" for path in sorted((repo / "rlctl").rglob("*.py"))
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "\n".join(hits)


def test_a_resume_point_is_explicit(tiny_session, tmp_path):
    """A restore hands back where the loop continues (step and queue cursor) instead of setting a field."""
    from rlctl.engine.checkpoint import DiskCheckpointStore
    from rlctl.engine.roles import ResumePoint
    from rlctl.engine.snapshot import Provenance, capture, restore, shadow_batch

    store = DiskCheckpointStore(tmp_path / "ckpt", async_save=False)
    cursor = {"watermark": 7, "resolved": [9], "drops": {"stale": 1}}
    state = capture(tiny_session, 3, {}, Provenance(run_id="r", config_hash="h", code_version="c"),
                    shadow_batch(tiny_session), store, queue_cursor=cursor)
    store.save(state)
    loaded = store.load(store.list_committed()[-1][0])
    report = restore(tiny_session, loaded, shadow_tolerance=1e-5)
    assert report.resume == ResumePoint(3, cursor)
    assert json.loads(json.dumps(report.resume.queue_cursor)) == cursor


def test_the_ray_backend_without_ray_installed_is_refused_with_the_install_command(plugins, _rlctl_home,
                                                                                  monkeypatch):
    import importlib.util

    from rlctl.config.load import load_config
    from rlctl.contracts.errors import ConfigError
    from rlctl.placement import place

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    config = load_config(None, [*TINY_OVERRIDES, "cluster.backend=ray"])
    with pytest.raises(ConfigError, match="needs Ray") as err:
        place(config, plugins, cache_root=_rlctl_home / "cache")
    assert "pip install -e '.[ray]'" in err.value.hint
