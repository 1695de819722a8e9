"""The warm start's dev-accuracy stopping rule, its step cap, and its cache key."""

from __future__ import annotations

import json
import warnings

import pytest

from rlctl.config.load import load_config
from rlctl.models.warm_start import (WarmStartWarning, builtin_policy_dir, greedy_accuracy, sft, warm_start_info,
                                     warm_start_key)
from rlctl_tasks.arith import ArithOptions, ArithTask

SHAPE = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_size=64", "model.warm_start.batch_size=32", "model.warm_start.lr=1e-2"]
TASK = ArithOptions(num_terms=2, max_operand=9, ops="+", num_train=70, num_dev=15, num_hidden=15)


@pytest.fixture(scope="module")
def task():
    return ArithTask(TASK).load()


def fresh_model(seed: int = 0):
    from rlctl.models.load import build_tiny
    from rlctl.models.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    cfg = load_config(None, SHAPE).model
    return build_tiny(cfg, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, seed), tok


def run_sft(task, **kw):
    model, tok = fresh_model()
    checks: list[tuple[int, float]] = []
    result = sft(model, tok, task.train, batch_size=32, lr=1e-2, seed=0, dev=task.train[:40],
                 progress=lambda step, total, loss, *dev: checks.append((step, dev[0])) if dev else None, **kw)
    return result, checks, model, tok


def test_sft_stops_at_the_first_check_that_reaches_the_target(task) -> None:
    # First the whole trajectory with an unreachable target, then a target it reaches part-way.
    full, checks, _, _ = run_sft(task, steps=240, target=1.0, eval_every=40)
    assert [s for s, _ in checks] == [40, 80, 120, 160, 200, 240]
    assert full.steps == 240 and full.reached is False
    best = max(acc for _, acc in checks)
    assert best > 0.1, f"the tiny model learned nothing in 240 steps: {checks}"
    first_hit = next(step for step, acc in checks if acc >= best)
    assert first_hit < 240 or best == checks[-1][1]

    stopped, seen, model, tok = run_sft(task, steps=240, target=best, eval_every=40)
    assert stopped.reached is True and stopped.target == best
    assert stopped.steps == first_hit  # the first check at or above the target, not a later one
    assert seen == [c for c in checks if c[0] <= first_hit]  # same trajectory up to the stop (seeded)
    assert stopped.dev_accuracy == pytest.approx(best)
    assert greedy_accuracy(model, tok, task.train[:40]) == pytest.approx(best)  # the returned model is the stopped one
    assert len(stopped.losses) == first_hit


def test_sft_without_target_runs_every_step_and_never_evaluates(task) -> None:
    result, checks, _, _ = run_sft(task, steps=30)
    assert result.steps == 30 and checks == []
    assert result.reached is None and result.dev_accuracy is None


def test_builtin_warm_start_warns_at_the_cap_and_records_where_it_stopped(task, tmp_path) -> None:
    cfg = load_config(None, [*SHAPE, "model.warm_start.steps=20", "model.warm_start.target_dev_accuracy=1.0",
                             "model.warm_start.eval_every=10", "model.warm_start.eval_prompts=10"])
    with pytest.warns(WarmStartWarning, match=r"cap of 20 steps .* below its target 100%.*raise model\.warm_start\.steps"):
        path = builtin_policy_dir(cfg.model, task, 0, tmp_path)
    info = warm_start_info(path)
    assert info["steps"] == 20 and info["reached"] is False and info["target"] == 1.0
    assert 0.0 <= info["dev_accuracy"] < 1.0
    with pytest.warns(WarmStartWarning, match="cap of 20 steps"):  # the cached entry says so again
        assert builtin_policy_dir(cfg.model, task, 0, tmp_path) == path


def test_builtin_warm_start_that_reaches_its_target_is_silent(task, tmp_path) -> None:
    cfg = load_config(None, [*SHAPE, "model.warm_start.steps=200", "model.warm_start.target_dev_accuracy=0.01",
                             "model.warm_start.eval_every=20"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", WarmStartWarning)
        path = builtin_policy_dir(cfg.model, task, 0, tmp_path)
    info = json.loads((path / "warm_start.json").read_text())
    assert info["reached"] is True and info["dev_accuracy"] >= 0.01 and info["steps"] % 20 == 0


def test_cache_key_covers_the_stopping_rule_and_pins_the_warm_start_seed(task) -> None:
    def key(*overrides: str, seed: int = 0) -> str:
        return warm_start_key(load_config(None, [*SHAPE, *overrides]).model, task, seed)

    base = key("model.warm_start.target_dev_accuracy=0.4")
    assert key("model.warm_start.target_dev_accuracy=0.5") != base
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.eval_every=50") != base
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.eval_prompts=20") != base
    assert key() != base  # no target at all
    # warm_start.seed defaults to run.seed; pinned, the RL seed no longer changes the warm start
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.seed=0", seed=0) == base
    assert key("model.warm_start.target_dev_accuracy=0.4", "model.warm_start.seed=0", seed=5) == base
    assert key("model.warm_start.target_dev_accuracy=0.4", seed=5) != base
