"""Every built-in estimator through the real loop on the tiny model: sampling, advantages, the update.

DAPO's dynamic sampling is checked on real rollouts: no trained group has
all-equal rewards, and the refill count is a logged metric.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlctl.config.load import load_config
from tests.conftest import TINY_OVERRIDES


class ListSink:
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def write(self, step, metrics) -> None:
        self.rows[step] = dict(metrics)

    def close(self) -> None:
        pass


def _session(plugins, home: Path, *extra: str):
    from tests.helpers import build_roles

    cfg = load_config(None, [*TINY_OVERRIDES, "train.steps=2", "train.optim.lr=1e-3", *extra])
    return build_roles(cfg, plugins, home / "cache")


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo"])
def test_estimator_trains_through_the_loop(name, plugins, _rlctl_home, tiny_policy_dir):
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    extra = ("algo.kl.coef=0.05", "algo.kl.placement=reward") if name == "reinforce_pp" else ()
    session = _session(plugins, _rlctl_home, f"algo.name={name}", "algo.tis_cap=2.0", *extra)
    before = {k: v.clone() for k, v in session.learner.model.state_dict().items()}
    sink = ListSink()
    run_sync(session, LoopSpec.from_config(session.config), [sink])
    assert sorted(sink.rows) == [0, 1]
    last = sink.rows[1]
    for key in ("loss", "grad_norm", "clip_fraction", "tis_weight_mean", "tis_truncated_frac", "generated_tokens"):
        assert math.isfinite(last[key]), (key, last[key])
    # synchronous: the sampler and the learner hold the same weights, so the weights sit at 1 within numerics
    assert abs(last["tis_weight_mean"] - 1.0) < 1e-3
    assert session.learner.policy_version == 2
    after = session.learner.model.state_dict()
    changed = any(not torch.equal(before[k], after[k]) for k in before)
    # a step whose groups all have equal rewards legitimately leaves the weights alone
    assert changed or all(row["frac_zero_std"] == 1.0 for row in sink.rows.values())
    if name == "reinforce_pp":
        assert last["kl_ref_reward"] >= 0.0


def test_dapo_dynamic_sampling_keeps_only_informative_groups(plugins, _rlctl_home, tiny_policy_dir):
    from rlctl.engine.groups import Sampler, request_encoder, sample_groups

    session = _session(plugins, _rlctl_home, "algo.name=dapo", "algo.options.max_sample_rounds=6",
                       "rollout.temperature=1.0")
    cfg = session.config
    g = cfg.algo.group_size
    sampler = Sampler(prompts=session.cursor.next, make_request=request_encoder(session, g), rollout=session.rollout,
                      reward=session.reward, answers={r.id: r.answer for r in session.task.train},
                      estimator=session.estimator, group_size=g, max_tokens=cfg.rollout.max_tokens,
                      truncation_penalty=cfg.rollout.truncation_penalty)
    seen_refill = 0.0
    for _ in range(3):
        out = sample_groups(sampler, cfg.algo.prompts_per_step)
        kept = out.selection
        groups = kept.rewards.shape[0]
        assert len(kept.kept) == groups * g
        if out.metrics["ds_short_groups"] == 0:
            assert groups == cfg.algo.prompts_per_step
        for i in range(groups):
            r = kept.rewards[i][kept.valid[i]]
            assert r.numel() >= 2 and float(r.max()) > float(r.min()), kept.rewards
        # every dropped group was replaced by a refill prompt, unless the round limit was hit
        assert out.metrics["ds_dropped_groups"] == out.metrics["ds_refill_prompts"] + out.metrics["ds_short_groups"]
        assert out.generated_tokens >= sum(t.num_response_tokens for t in kept.kept + kept.no_signal)
        seen_refill += out.metrics["ds_refill_prompts"]
        ids = [t.prompt_id for t in kept.kept]
        assert all(len(set(ids[i:i + g])) == 1 for i in range(0, len(ids), g))
    assert seen_refill > 0, "the tiny policy should produce some all-equal groups at G=4"


def test_dapo_through_the_loop_trains_only_groups_with_signal_and_logs_the_refills(plugins, _rlctl_home,
                                                                                  tiny_policy_dir):
    """What the learner sees, not just what sample_groups returns: every group of every trained batch has
    unequal rewards, and the refill count is in every logged step's metrics."""
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    session = _session(plugins, _rlctl_home, "algo.name=dapo", "algo.options.max_sample_rounds=6", "train.steps=4")
    trained: list[torch.Tensor] = []
    advantages = session.estimator.advantages

    def recording(inputs):  # the estimator is handed exactly the rewards of the batch the learner trains on
        trained.append(inputs.rewards.clone())
        return advantages(inputs)

    session.estimator.advantages = recording
    sink = ListSink()
    run_sync(session, LoopSpec.from_config(session.config), [sink])
    assert sorted(sink.rows) == [0, 1, 2, 3] and trained
    for rewards in trained:
        assert rewards.shape[0] >= 1
        assert bool((rewards.max(dim=1).values > rewards.min(dim=1).values).all()), rewards
    for row in sink.rows.values():
        for key in ("ds_refill_prompts", "ds_dropped_groups", "ds_sample_rounds", "ds_short_groups"):
            assert key in row and math.isfinite(row[key])
    assert sum(row["ds_refill_prompts"] for row in sink.rows.values()) > 0


def test_dapo_step_without_any_informative_group_skips_the_update(plugins, _rlctl_home, tiny_policy_dir):
    """Greedy sampling makes every group's G samples identical, so no group has signal in any round: the step
    trains on nothing (no all-equal batch), and weights and optimizer stay as they were."""
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    session = _session(plugins, _rlctl_home, "algo.name=dapo", "algo.options.max_sample_rounds=2",
                       "rollout.temperature=0.0")
    before = {k: v.detach().clone() for k, v in session.learner.model.state_dict().items()}
    session.estimator.advantages = lambda inputs: pytest.fail("an all-equal batch reached the estimator")
    sink = ListSink()
    last = run_sync(session, LoopSpec.from_config(session.config), [sink])
    assert session.learner.policy_version == 0
    assert all(torch.equal(before[k], v) for k, v in session.learner.model.state_dict().items())
    cfg = session.config.algo
    assert last["ds_short_groups"] == cfg.prompts_per_step
    assert last["ds_dropped_groups"] == 2 * cfg.prompts_per_step and last["ds_sample_rounds"] == 2
    assert last["esr"] == 0.0 and last["generated_tokens_total"] > 0 and "loss" not in last


def test_generated_token_budget_stops_the_run_within_one_batch(plugins, _rlctl_home, tiny_policy_dir):
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    session = _session(plugins, _rlctl_home, "train.steps=50", "train.max_generated_tokens=100",
                       "train.log_every=10")
    sink = ListSink()
    last = run_sync(session, LoopSpec.from_config(session.config), [sink])
    steps = sorted(sink.rows)
    assert steps[-1] < 49  # stopped by the budget, and the stopping step is logged
    assert last["generated_tokens_total"] >= 100
    assert last["generated_tokens_total"] - last["generated_tokens"] < 100  # the step before was still under it
    assert session.learner.policy_version == steps[-1] + 1


def test_token_budget_stops_dapo_refills_within_the_step(plugins, _rlctl_home, tiny_policy_dir):
    """Refill rounds stop once the budget is spent, so DAPO overshoots an ablation's budget by less than one
    round of tokens, not by up to max_sample_rounds rounds. Greedy sampling makes every group all-equal, so
    without the budget all 6 rounds would run."""
    from rlctl.engine.loop import run_sync
    from rlctl.engine.spec import LoopSpec

    session = _session(plugins, _rlctl_home, "algo.name=dapo", "algo.options.max_sample_rounds=6",
                       "rollout.temperature=0.0", "train.steps=20", "train.max_generated_tokens=1")
    sink = ListSink()
    last = run_sync(session, LoopSpec.from_config(session.config), [sink])
    assert sorted(sink.rows) == [0]  # the first round spends the budget: no refill round, no second step
    assert last["ds_sample_rounds"] == 1 and last["ds_refill_prompts"] == 0
    assert last["ds_dropped_groups"] == session.config.algo.prompts_per_step
    cfg = session.config
    assert last["generated_tokens_total"] <= cfg.algo.prompts_per_step * cfg.algo.group_size * cfg.rollout.max_tokens
