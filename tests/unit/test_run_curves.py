"""``rlctl runs plot``: a run's curves from the registry in a PNG; the dev eval's points at their steps."""

from __future__ import annotations

import json

import pytest

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture()
def registry(tmp_path):
    from rlctl.registry.store import Registry

    reg = Registry.open(f"sqlite:///{tmp_path / 'reg.db'}")
    yield reg
    reg.close()


def _run(registry, run_dir=""):
    run = registry.create_run(name="curves", config={}, config_hash="h", code_version="c", dataset_version="d",
                              tokenizer_hash="t", seed=0, run_dir=run_dir)
    for step in range(6):
        metrics = {"reward_mean": 0.1 * step, "kl_ref": 0.01 * step}
        if step % 2 == 1:  # eval.every_steps=2 with eval.grader: the dev metrics at the eval's steps only
            metrics.update(eval_dev_pass_at_1=0.2, eval_dev_score=0.3, eval_dev_train_reward=0.6)
        registry.log_metrics(run.id, step, metrics)
    return run


def test_the_default_panels_draw_reward_kl_and_the_dev_points(registry, tmp_path):
    from rlctl.lifecycle.curves import plot_run

    run = _run(registry, run_dir=str(tmp_path / "run"))
    path, points = plot_run(registry, run.id[:6])
    assert path == tmp_path / "run" / "curves.png" and path.read_bytes()[:8] == PNG
    assert points == {"reward_mean": 6, "kl_ref": 6, "eval_dev_pass_at_1": 3, "eval_dev_score": 3,
                      "eval_dev_train_reward": 3}


def test_a_metric_the_run_never_recorded_is_named_with_the_ones_it_did(registry, tmp_path):
    from rlctl.contracts.errors import ConfigError
    from rlctl.lifecycle.curves import plot_run

    run = _run(registry)
    with pytest.raises(ConfigError) as err:
        plot_run(registry, run.id, tmp_path / "x.png", ["entropy"])
    assert "no metric entropy" in err.value.message and "reward_mean" in err.value.hint
    with pytest.raises(ConfigError, match="no run directory"):
        plot_run(registry, run.id)  # no run dir and no -o


def test_runs_plot_command_writes_the_png_and_refuses_an_unknown_metric_in_one_line(tmp_path):
    from rlctl.registry.store import Registry
    from tests.integration.test_cli import rlctl

    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        run = _run(reg)
    out = tmp_path / "sub" / "c.png"
    proc = rlctl("runs", "plot", run.id, "-o", str(out), "--metric", "kl_ref", "--json", home=tmp_path, check=True)
    assert json.loads(proc.stdout) == {"plot": str(out), "points": {"kl_ref": 6}}
    assert out.read_bytes()[:8] == PNG
    proc = rlctl("runs", "plot", run.id, "-o", str(out), "--metric", "entropy", home=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert [line for line in proc.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: run {run.id} recorded no metric entropy"]
