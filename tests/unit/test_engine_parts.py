"""Engine building blocks: prompt cursor, batch assembly, group rewards, scoring, metrics, bootstrap."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Mapping

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.contracts.roles import RewardFunction
from rlctl.contracts.types import PromptRecord, RewardResult, SamplingConfig, Split, TerminalReason, Trajectory
from rlctl.engine.batching import CursorState, PromptCursor, build_batch, group_rewards
from rlctl.lifecycle.grading import paired_bootstrap, pooled_bootstrap
from rlctl.engine.metrics import step_metrics
from rlctl.engine.reward_mix import MixedReward
from rlctl.engine.scoring import score_all

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=8)


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(id=f"p{i}", text=f"{i}+0=", answer=str(i), split=Split.TRAIN) for i in range(n)]


def traj(prompt_id: str = "p1", index: int = 0, *, prompt: tuple[int, ...] = (1, 2),
         response: tuple[int, ...] = (3,), mask: tuple[int, ...] | None = None,
         logprobs: tuple[float, ...] | None = None, reason: TerminalReason = TerminalReason.EOS,
         text: str = "x", policy_version: int = 0, **scored) -> Trajectory:
    return Trajectory.create(
        id=f"{prompt_id}/{index}", prompt_id=prompt_id, group_index=index, dataset_version="d",
        policy_version=policy_version, tokenizer_hash="t", prompt_tokens=prompt, response_tokens=response,
        response_text=text, action_mask=(1,) * len(response) if mask is None else mask,
        behavior_logprobs=(-0.5,) * len(response) if logprobs is None else logprobs,
        sampling_config=SAMPLING, terminal_reason=reason, rollout_started_at=0.0, **scored,
    )


class FakeReward:
    """A RewardFunction returning a fixed result per response text (the far side of the contract)."""

    name = "fake"
    version = "fake@1"

    def __init__(self, results: Mapping[str, RewardResult]) -> None:
        self.results = results
        self.calls: list[tuple[str, str]] = []

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        self.calls.append((trajectory.id, reference))
        return self.results[trajectory.response_text]


def ok(total: float, **components: float) -> RewardResult:
    return RewardResult(total=total, components=components or {"fake": total}, grader_version="fake@1")


# -- PromptCursor ------------------------------------------------------------------------------


def test_cursor_yields_every_prompt_once_per_epoch() -> None:
    recs = records(10)
    cursor = PromptCursor(recs, seed=3)
    for epoch in range(3):
        seen = cursor.next(4) + cursor.next(4) + cursor.next(2)
        assert sorted(r.id for r in seen) == sorted(r.id for r in recs)
        assert cursor.state == CursorState(epoch=epoch + 1, position=0)


def test_cursor_order_depends_on_the_seed_and_the_epoch() -> None:
    recs = records(20)
    a, b = PromptCursor(recs, seed=0), PromptCursor(recs, seed=1)
    first_a, first_b = a.next(20), b.next(20)
    assert first_a != first_b
    assert first_a != recs  # shuffled, not file order
    assert a.next(20) != first_a  # each epoch is reshuffled
    assert PromptCursor(recs, seed=0).next(20) == first_a  # and reproducible


def test_cursor_crosses_the_epoch_boundary_inside_one_call() -> None:
    recs = records(5)
    whole = PromptCursor(recs, seed=9).next(15)
    assert all(sorted(r.id for r in whole[i:i + 5]) == [r.id for r in recs] for i in (0, 5, 10))
    cursor = PromptCursor(recs, seed=9)
    assert cursor.next(7) == whole[:7]
    assert cursor.state == CursorState(epoch=1, position=2)
    assert cursor.next(8) == whole[7:]
    assert cursor.state == CursorState(epoch=3, position=0)


def test_cursor_batch_larger_than_the_split() -> None:
    recs = records(3)
    out = PromptCursor(recs, seed=0).next(10)
    assert len(out) == 10
    assert {r.id for r in out} == {r.id for r in recs}


def test_cursor_zero_count() -> None:
    cursor = PromptCursor(records(3), seed=0)
    assert cursor.next(0) == []
    assert cursor.state == CursorState()


def test_cursor_refuses_an_empty_split() -> None:
    with pytest.raises(ValueError, match="empty"):
        PromptCursor([], seed=0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    seed=st.integers(0, 2**31),
    sizes=st.lists(st.integers(1, 17), min_size=2, max_size=10),
    data=st.data(),
)
def test_cursor_resumed_from_saved_state_continues_identically(n: int, seed: int, sizes: list[int], data) -> None:
    recs = records(n)
    split = data.draw(st.integers(1, len(sizes) - 1), label="split")
    uninterrupted = PromptCursor(recs, seed)
    expected = [[r.id for r in uninterrupted.next(k)] for k in sizes]

    first = PromptCursor(recs, seed)
    got = [[r.id for r in first.next(k)] for k in sizes[:split]]
    saved = json.dumps(dataclasses.asdict(first.state))  # what a checkpoint stores
    del first
    resumed = PromptCursor(recs, seed, state=CursorState(**json.loads(saved)))
    got += [[r.id for r in resumed.next(k)] for k in sizes[split:]]
    assert got == expected
    assert resumed.state == uninterrupted.state


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 15), seed=st.integers(0, 1000), sizes=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_cursor_every_epoch_is_a_permutation(n: int, seed: int, sizes: list[int]) -> None:
    cursor = PromptCursor(records(n), seed)
    stream = [r.id for k in sizes for r in cursor.next(k)]
    full_epochs = len(stream) // n
    for e in range(full_epochs):
        assert sorted(stream[e * n:(e + 1) * n]) == sorted(f"p{i}" for i in range(n))
    rest = stream[full_epochs * n:]
    assert len(set(rest)) == len(rest)  # a partial epoch never repeats a prompt


# -- build_batch ---------------------------------------------------------------------------------


def test_build_batch_aligns_tokens_masks_logprobs_and_advantages() -> None:
    a = traj("p1", 0, prompt=(5, 6, 7), response=(8, 9), logprobs=(-0.25, -1.5), policy_version=3)
    b = traj("p1", 1, prompt=(5, 6, 7), response=(10, 11, 12, 13), mask=(1, 1, 0, 1),
             logprobs=(-0.1, -0.2, -0.3, -0.4), policy_version=4)
    c = traj("p2", 0, prompt=(1,), response=(2,), logprobs=(-2.0,))
    batch = build_batch([a, b, c], [0.5, -1.0, 2.0], pad_id=0, sampling=SAMPLING)

    assert batch.input_ids.dtype == torch.long and batch.input_ids.shape == (3, 7)
    assert batch.input_ids[0].tolist() == [5, 6, 7, 8, 9, 0, 0]
    assert batch.input_ids[1].tolist() == [5, 6, 7, 10, 11, 12, 13]
    assert batch.input_ids[2].tolist() == [1, 2, 0, 0, 0, 0, 0]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert batch.attention_mask[2].tolist() == [1, 1, 0, 0, 0, 0, 0]

    assert batch.action_mask.dtype == torch.float32
    assert batch.action_mask[0].tolist() == [0, 0, 0, 1, 1, 0, 0]  # exactly the response positions 3 and 4
    assert batch.action_mask[1].tolist() == [0, 0, 0, 1, 1, 0, 1]  # the trajectory's own mask is kept
    assert batch.action_mask[2].tolist() == [0, 1, 0, 0, 0, 0, 0]

    assert batch.behavior_logprobs.dtype == torch.float32
    assert batch.behavior_logprobs[0].tolist() == [0, 0, 0, -0.25, -1.5, 0, 0]
    assert batch.behavior_logprobs[1].tolist() == pytest.approx([0, 0, 0, -0.1, -0.2, -0.3, -0.4])
    assert batch.behavior_logprobs[2].tolist() == [0, -2.0, 0, 0, 0, 0, 0]

    assert batch.advantages[0].tolist() == [0, 0, 0, 0.5, 0.5, 0, 0]  # response tokens only
    assert batch.advantages[1].tolist() == [0, 0, 0, -1, -1, -1, -1]
    assert batch.advantages[2].tolist() == [0, 2.0, 0, 0, 0, 0, 0]

    assert batch.trajectory_ids == ("p1/0", "p1/1", "p2/0")
    assert batch.policy_versions == (3, 4, 0)
    assert batch.sampling == SAMPLING
    assert batch.num_sequences == 3
    assert batch.ref_logprobs is None


def test_build_batch_pads_with_the_given_id() -> None:
    batch = build_batch([traj(prompt=(1,), response=(2,)), traj(prompt=(1, 2, 3), response=(4,))],
                        [0.0, 0.0], pad_id=99, sampling=SAMPLING)
    assert batch.input_ids[0].tolist() == [1, 2, 99, 99]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6), st.floats(-3, 3)), min_size=1, max_size=5))
def test_build_batch_masks_never_touch_prompt_or_padding(shapes: list[tuple[int, int, float]]) -> None:
    trajs = [traj(f"p{i}", prompt=tuple(range(1, p + 1)), response=tuple(range(50, 50 + r)))
             for i, (p, r, _) in enumerate(shapes)]
    batch = build_batch(trajs, [adv for _, _, adv in shapes], pad_id=0, sampling=SAMPLING)
    for row, (p, r, adv) in enumerate(shapes):
        response = slice(p, p + r)
        outside = torch.ones(batch.input_ids.shape[1], dtype=torch.bool)
        outside[response] = False
        assert batch.action_mask[row, outside].abs().sum() == 0
        assert batch.behavior_logprobs[row, outside].abs().sum() == 0
        assert batch.advantages[row, outside].abs().sum() == 0
        assert batch.action_mask[row, response].tolist() == [1.0] * r
        assert batch.advantages[row, response].tolist() == pytest.approx([adv] * r, abs=1e-6)
        assert int(batch.attention_mask[row].sum()) == p + r


# -- group_rewards -------------------------------------------------------------------------------


def test_group_rewards_shapes_values_and_validity() -> None:
    trajs = [traj("a", 0, reward=1.0), traj("a", 1, reward=0.0),
             traj("b", 0, reward=None, reward_error="timeout"), traj("b", 1, reward=0.5)]
    rewards, valid = group_rewards(trajs, group_size=2)
    assert rewards.shape == valid.shape == (2, 2)
    assert valid.tolist() == [[True, True], [False, True]]
    assert rewards[0].tolist() == [1.0, 0.0]
    assert math.isnan(rewards[1, 0].item())  # an error is never a silent zero
    assert rewards[1, 1].item() == 0.5


def test_group_rewards_error_with_a_stale_reward_is_still_invalid() -> None:
    trajs = [traj("a", 0, reward=1.0, reward_error="invalid_reward"), traj("a", 1, reward=0.0)]
    _, valid = group_rewards(trajs, group_size=2)
    assert valid.tolist() == [[False, True]]


def test_group_rewards_rejects_a_group_mixing_prompts() -> None:
    trajs = [traj("a", 0, reward=1.0), traj("b", 0, reward=0.0), traj("b", 1, reward=0.0), traj("a", 1, reward=1.0)]
    with pytest.raises(ValueError, match=r"group 0 mixes prompts \['a', 'b'\]"):
        group_rewards(trajs, group_size=2)


def test_group_rewards_rejects_a_partial_group() -> None:
    with pytest.raises(ValueError, match="groups of 2"):
        group_rewards([traj("a", 0, reward=1.0)] * 3, group_size=2)


# -- score_all -----------------------------------------------------------------------------------


def test_score_all_records_reward_components_and_grader() -> None:
    reward = FakeReward({"good": ok(1.0, math=1.0, format=1.0)})
    t = traj("p1", text="good")
    [scored], latencies = score_all([t], {"p1": "17"}, reward, truncation_penalty=-0.5)
    assert reward.calls == [("p1/0", "17")]
    assert scored.reward == 1.0
    assert dict(scored.reward_components) == {"math": 1.0, "format": 1.0}
    assert scored.reward_error is None
    assert scored.grader_version == "fake@1"
    assert scored.scored_at is not None
    assert scored.verify()  # the checksum follows the update
    assert t.reward is None  # the input is not modified
    assert len(latencies) == 1 and latencies[0] >= 0.0


def test_score_all_truncated_gets_the_penalty_but_keeps_components() -> None:
    reward = FakeReward({"cut": ok(1.0, math=1.0, format=0.0)})
    [scored], _ = score_all([traj(text="cut", reason=TerminalReason.LENGTH)], {"p1": "1"}, reward, -0.5)
    assert scored.reward == -0.5
    assert dict(scored.reward_components) == {"math": 1.0, "format": 0.0}
    assert scored.reward_error is None


def test_score_all_truncated_keeps_graded_reward_without_a_penalty() -> None:
    reward = FakeReward({"cut": ok(0.75)})
    [scored], _ = score_all([traj(text="cut", reason=TerminalReason.LENGTH)], {"p1": "1"}, reward, None)
    assert scored.reward == 0.75


@pytest.mark.parametrize("reason", [TerminalReason.EOS, TerminalReason.STOP])
def test_score_all_penalty_only_applies_to_truncation(reason: TerminalReason) -> None:
    reward = FakeReward({"done": ok(0.25)})
    [scored], _ = score_all([traj(text="done", reason=reason)], {"p1": "1"}, reward, -0.5)
    assert scored.reward == 0.25


@pytest.mark.parametrize("reason", [TerminalReason.EOS, TerminalReason.LENGTH])
def test_score_all_reward_error_is_never_a_silent_zero(reason: TerminalReason) -> None:
    failed = RewardResult(total=0.0, components={}, grader_version="fake@1", error_code="timeout")
    reward = FakeReward({"slow": failed})
    [scored], _ = score_all([traj(text="slow", reason=reason)], {"p1": "1"}, reward, -0.5)
    assert scored.reward is None
    assert scored.reward_error == "timeout"
    assert scored.grader_version == "fake@1"


def test_score_all_aborted_trajectories_are_not_graded() -> None:
    reward = FakeReward({})
    t = traj(text="half", reason=TerminalReason.ABORT)
    [scored], latencies = score_all([t], {}, reward, -0.5)
    assert reward.calls == []
    assert scored.reward is None
    assert scored.reward_error == "aborted"
    assert latencies == [0.0]
    assert scored.verify()


def test_score_all_keeps_order_and_handles_a_mixed_reward() -> None:
    class Raises:
        name, version = "boom", "boom@1"

        def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
            if trajectory.response_text == "bad":
                raise RuntimeError("grader crashed")
            return ok(1.0)

    fake = FakeReward({"good": ok(1.0), "bad": ok(0.0)})
    mix = MixedReward([("main", 1.0, fake), ("boom", 0.5, Raises())])
    assert isinstance(mix, RewardFunction)
    trajs = [traj("p1", 0, text="good"), traj("p1", 1, text="bad"), traj("p2", 0, text="x", reason=TerminalReason.ABORT)]
    scored, latencies = score_all(trajs, {"p1": "1", "p2": "2"}, mix, -0.5)
    assert [t.id for t in scored] == ["p1/0", "p1/1", "p2/0"]
    assert len(latencies) == 3
    assert scored[0].reward == 1.5 and dict(scored[0].reward_components) == {"main": 1.0, "boom": 1.0}
    assert scored[0].grader_version == mix.version
    assert scored[1].reward is None and scored[1].reward_error == "grader_error:boom"
    assert dict(scored[1].reward_components) == {"main": 0.0}  # the parts that did score stay recorded
    assert scored[2].reward_error == "aborted"


# -- step_metrics ----------------------------------------------------------------------------------


def _metrics_example() -> dict[str, float]:
    scored = [
        traj("a", 0, response=(1, 2, 3), policy_version=2, reward=1.0, reward_components={"math": 1.0, "format": 1.0}),
        traj("a", 1, response=(1, 2, 3, 4, 5), reason=TerminalReason.LENGTH, policy_version=2, reward=-0.5,
             reward_components={"math": 0.0, "format": 1.0}),
        traj("b", 0, response=(1, 2), policy_version=1, reward=0.0, reward_components={"math": 0.0, "format": 0.0}),
        traj("b", 1, response=(1, 2, 3, 4), policy_version=2, reward=None, reward_error="timeout"),
    ]
    return step_metrics(
        scored=scored,
        learner_stats={"loss": 0.25, "grad_norm": 1.5, "clip_fraction": 0.1},
        adv_stats={"frac_zero_std": 0.5},
        advantages=torch.tensor([[1.0, -1.0], [0.0, 0.0]]),
        verify_latencies=[0.5, 0.1, 0.4, 0.2, 0.3],
        learner_version=3,
        times={"T_r": 2.0, "T_v": 0.5, "T_l": 1.0, "T_s": 0.5},
    )


def test_step_metrics_hand_checked() -> None:
    m = _metrics_example()
    rewards = [1.0, -0.5, 0.0]  # the timed-out sample is excluded, not counted as 0
    assert m["reward_mean"] == pytest.approx(sum(rewards) / 3)
    assert m["reward_std"] == pytest.approx(math.sqrt(sum((r - 1 / 6) ** 2 for r in rewards) / 3))
    assert m["reward/math"] == pytest.approx(1 / 3)
    assert m["reward/format"] == pytest.approx(2 / 3)
    assert m["reward_error_count"] == 1
    assert m["response_length_mean"] == 3.5  # (3 + 5 + 2 + 4) / 4
    assert m["response_length_max"] == 5
    assert m["truncated_frac"] == 0.25
    assert m["generated_tokens_per_s"] == 7.0  # 14 tokens / T_r 2 s
    assert m["learned_tokens_per_s"] == 8.0  # 3 + 5 tokens with a non-zero advantage / T_l 1 s
    assert m["esr"] == 0.5  # 2 valid and informative of 4 generated
    assert m["effective_tokens_per_s"] == 3.5
    assert m["step_time_s"] == 4.0
    assert (m["T_r"], m["T_v"], m["T_l"], m["T_s"]) == (2.0, 0.5, 1.0, 0.5)
    assert m["verifier_latency_p50_s"] == 0.3
    assert m["verifier_latency_p95_s"] == 0.5
    assert m["verifier_latency_p99_s"] == 0.5
    assert m["policy_version"] == 3
    assert m["staleness_mean"] == 0.25  # versions 2, 2, 1, 2 against learner version 3 (trained once)
    assert m["staleness_max"] == 1
    assert m["frac_zero_std"] == 0.5  # passthrough from the advantage stats
    assert (m["loss"], m["grad_norm"], m["clip_fraction"]) == (0.25, 1.5, 0.1)  # passthrough from the learner


def test_step_metrics_values_are_plain_floats() -> None:
    m = _metrics_example()
    assert all(type(v) is float and math.isfinite(v) for v in m.values())
    assert all(isinstance(k, str) for k in m)


def test_step_metrics_documented_names_are_present() -> None:
    names = set(_metrics_example())
    documented = {
        "reward_mean", "reward_std", "response_length_mean", "response_length_max", "truncated_frac",
        "reward_error_count", "T_r", "T_v", "T_l", "T_s", "step_time_s", "generated_tokens_per_s",
        "learned_tokens_per_s", "esr", "effective_tokens_per_s", "verifier_latency_p50_s",
        "verifier_latency_p95_s", "verifier_latency_p99_s", "staleness_mean", "staleness_max",
        "frac_zero_std", "policy_version",
    }
    assert documented <= names


def test_step_metrics_zero_times_and_no_latencies_do_not_divide_by_zero() -> None:
    m = step_metrics(
        scored=[traj("a", 0, reward=1.0), traj("a", 1, reward=1.0)], learner_stats={}, adv_stats={},
        advantages=torch.zeros(1, 2), verify_latencies=[], learner_version=1,
        times={"T_r": 0.0, "T_v": 0.0, "T_l": 0.0, "T_s": 0.0},
    )
    assert m["generated_tokens_per_s"] == 0.0 and m["learned_tokens_per_s"] == 0.0
    assert m["esr"] == 0.0  # no informative sample: equal rewards give no signal
    assert m["verifier_latency_p95_s"] == 0.0
    assert m["reward_std"] == 0.0


# -- paired_bootstrap --------------------------------------------------------------------------------


def test_bootstrap_identical_scores() -> None:
    scores = [1, 0, 1, 1, 0, 0, 1, 0]
    cmp = paired_bootstrap(scores, list(scores), samples=500)
    assert (cmp.diff, cmp.ci_low, cmp.ci_high) == (0.0, 0.0, 0.0)
    assert cmp.num_prompts == 8


def test_bootstrap_candidate_better_everywhere_excludes_zero() -> None:
    cmp = paired_bootstrap([0] * 20, [1] * 20, samples=500)
    assert cmp.diff == 1.0
    assert 0.0 < cmp.ci_low <= cmp.diff <= cmp.ci_high


def test_bootstrap_candidate_better_on_most_items_excludes_zero() -> None:
    baseline = [0, 1] * 50
    candidate = [1, 1] * 50  # wins on half the items, ties on the rest
    cmp = paired_bootstrap(baseline, candidate, samples=1000, seed=1)
    assert cmp.diff == 0.5
    assert 0.0 < cmp.ci_low < 0.5 < cmp.ci_high


def test_bootstrap_is_seeded_and_brackets_the_difference() -> None:
    baseline = [1, 0, 0, 1, 0, 1, 1, 0, 0, 0]
    candidate = [1, 1, 0, 0, 1, 1, 1, 1, 0, 0]
    a = paired_bootstrap(baseline, candidate, samples=400, seed=5)
    assert a == paired_bootstrap(baseline, candidate, samples=400, seed=5)
    assert a.diff == pytest.approx(0.2)
    assert a.ci_low <= a.diff <= a.ci_high
    assert a.ci_low < 0.0 < a.ci_high  # a noisy ten-prompt gain is not significant


@pytest.mark.parametrize(("baseline", "candidate"), [([1, 0], [1]), ([], [])])
def test_bootstrap_rejects_unpaired_or_empty_lists(baseline: list[int], candidate: list[int]) -> None:
    with pytest.raises(ValueError, match="equally long"):
        paired_bootstrap(baseline, candidate)


# -- pooled_bootstrap (several RL seeds on the same prompts) ---------------------------------------



@settings(max_examples=40, deadline=None)
@given(st.integers(1, 4).flatmap(lambda s: st.integers(1, 30).flatmap(
    lambda n: st.lists(st.tuples(st.lists(st.integers(0, 1), min_size=n, max_size=n),
                                 st.lists(st.integers(0, 1), min_size=n, max_size=n)), min_size=s, max_size=s))))
def test_pooled_bootstrap_brackets_the_mean_of_the_seeds(pairs) -> None:
    cmp = pooled_bootstrap(pairs, samples=200, seed=3)
    per_seed = [sum(c - b for b, c in zip(base, cand)) / len(base) for base, cand in pairs]
    assert cmp.diff == pytest.approx(sum(per_seed) / len(per_seed))
    assert -1.0 <= cmp.ci_low <= cmp.ci_high <= 1.0
    # every resample is a mean of cells of the matrix, so it lies within the cells' range
    cells = [c - b for base, cand in pairs for b, c in zip(base, cand)]
    assert min(cells) <= cmp.ci_low and cmp.ci_high <= max(cells)
    assert cmp == pooled_bootstrap(pairs, samples=200, seed=3)  # seeded


def test_pooled_bootstrap_of_identical_seeds_matches_one_seed_width() -> None:
    baseline = [0, 1, 0, 0, 1, 0, 1, 0, 0, 1] * 10
    candidate = [1, 1, 0, 1, 1, 0, 1, 0, 1, 1] * 10
    one = pooled_bootstrap([(baseline, candidate)], samples=2000, seed=0)
    three = pooled_bootstrap([(baseline, candidate)] * 3, samples=2000, seed=0)
    assert one.diff == three.diff == pytest.approx(0.3)
    assert 0.0 < three.ci_low < 0.3 < three.ci_high
    # identical seeds add no seed variance: the interval is about as wide as with one seed
    assert abs((three.ci_high - three.ci_low) - (one.ci_high - one.ci_low)) < 0.04


def test_pooled_bootstrap_widens_when_seeds_disagree() -> None:
    base = [0] * 100
    agree = [([0] * 100, [1] * 10 + [0] * 90)] * 3
    disagree = [(base, [1] * 0 + [0] * 100), (base, [1] * 10 + [0] * 90), (base, [1] * 20 + [0] * 80)]
    a = pooled_bootstrap(agree, samples=2000, seed=0)
    d = pooled_bootstrap(disagree, samples=2000, seed=0)
    assert a.diff == pytest.approx(0.1) and d.diff == pytest.approx(0.1)
    assert d.ci_high - d.ci_low > a.ci_high - a.ci_low  # seed-to-seed variation is in the interval


@pytest.mark.parametrize("pairs", [[], [([1, 0], [1, 0]), ([1], [1])], [([], [])]])
def test_pooled_bootstrap_rejects_unpaired_or_empty_input(pairs) -> None:
    with pytest.raises(ValueError, match="pooled bootstrap needs"):
        pooled_bootstrap(pairs)
