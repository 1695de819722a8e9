"""Diagnose puts the injected cause first on recorded runs (table: injected cause -> top finding).

Each row trains a tiny real run (in-process, deterministic CPU mode) with one
cause injected, then diagnoses it from the registry's metrics and events only.
The rows are the issue's acceptance table: NaN -> numerics, 30% verifier
timeouts -> grader, a reward that pays for length -> hacking/length, a
learning rate 30x too high -> instability, a slow learner in async mode -> lag.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES

pytestmark = pytest.mark.slow

BASE = [*TINY_OVERRIDES, "train.deterministic=true", "eval.at_end=false", "train.metric_sinks=[]",
        "checkpoint.every_steps=0", "train.optim.lr=1e-3", "train.steps=8", "algo.num_mini_batches=4"]

CASES = {
    "nan injection": (["faults.inject=[{kind: nan, at_step: 3, count: 2}]", "faults.nan_rollback_after=5"],
                      "numerics", "reward-drop-or-nan"),
    "30% verifier timeouts": (["faults.inject=[{kind: verifier-timeout, rate: 0.3}]"],
                              "grader", "verifier-timeouts"),
    "reward pays for length": (["reward.components=[{name: length, weight: -2.0, options: {target_tokens: 0}}]",
                                "rollout.truncation_penalty=null", "rollout.max_tokens=16"],
                               "hacking", "length-collapse-or-reward-hacking"),
    "learning rate 30x too high": (["train.optim.lr=3e-2"], "instability", "instability"),
    # async: rollout runs ahead while a learner doing 8x the work per step falls behind (staleness at its bound).
    # A small lr: at 1e-3, 4-version-old samples drift past approx KL 0.1 and the instability trigger (critical)
    # outranks lag (2 of 3 runs with 8 epochs, 1 of 5 with 4); the lag branch does not claim that drift yet.
    "slow learner, async": (["mode=async", "staleness.max_staleness=4", "algo.ppo_epochs=8", "train.optim.lr=1e-4"],
                            "lag", "queue-lag"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_diagnose_ranks_the_injected_cause_first(case: str, _rlctl_home: Path, tmp_path: Path) -> None:
    from rlctl.config.load import load_config
    from rlctl.hooks.manager import load_plugins
    from rlctl.incidents.diagnose import diagnose_run
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    overrides, branch, runbook = CASES[case]
    registry = Registry.open(f"sqlite:///{tmp_path / 'registry.db'}")
    result = train(load_config(None, [*BASE, *overrides]), registry=registry, plugins=load_plugins(),
                   home=_rlctl_home, run_dir=tmp_path / "run")
    diagnosis = diagnose_run(registry, result.run.id)
    assert diagnosis.top is not None, f"{case}: no finding"
    ranked = [(f.branch, f.severity, f.headline) for f in diagnosis.findings]
    assert (diagnosis.top.branch, diagnosis.top.runbook) == (branch, runbook), ranked
    assert diagnosis.top.firings and all(f.values or f.events for f in diagnosis.top.firings)
