"""A trajectory's checksum covers every field: changing any one of them breaks ``verify()``."""

from __future__ import annotations

from dataclasses import fields, replace

from hypothesis import given, settings, strategies as st

from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory, Turn, Writer

EARLIER_DIGEST = "862ca83d76b4dadfcd1c243d93b76d67cbb827773cab23da59843f193848e2d5"  # BASE, before episodes

BASE = dict(id="p1/0", prompt_id="p1", group_index=0, dataset_version="d", policy_version=0, tokenizer_hash="t",
            prompt_tokens=(1, 2), response_tokens=(3, 4), response_text="12", action_mask=(1, 1),
            behavior_logprobs=(-0.5, -0.25), sampling_config=SamplingConfig(max_tokens=4),
            terminal_reason=TerminalReason.EOS, rollout_started_at=1.0)
CHANGED = dict(id="p1/1", prompt_id="p2", group_index=1, dataset_version="e", policy_version=1, tokenizer_hash="u",
               prompt_tokens=(1, 2, 0), response_tokens=(3, 5), response_text="13", action_mask=(1, 0),
               behavior_logprobs=(-0.5, -0.25000000000000006), sampling_config=SamplingConfig(max_tokens=5),
               terminal_reason=TerminalReason.LENGTH, rollout_started_at=1.5, reward=1.0,
               reward_components={"math": 1.0}, reward_error="timeout", grader_version="math@1", scored_at=2.0,
               turns=(Turn(start=0, end=1, writer=Writer.POLICY, policy_version=0),
                      Turn(start=1, end=2, writer=Writer.ENV, tool="calc", tool_status="ok", tool_seconds=0.5)))


def test_every_field_is_covered():
    t = Trajectory.create(**BASE)
    assert t.verify()
    assert set(CHANGED) == {f.name for f in fields(Trajectory)} - {"checksum"}
    for name, value in CHANGED.items():
        tampered = replace(t, **{name: value})  # bypasses updated(): the old checksum stays
        assert not tampered.verify(), name
        assert t.updated(**{name: value}).verify(), name


def test_every_turn_field_is_covered():
    """An episode's digest changes with any field of any of its turns."""
    t = Trajectory.create(**{**BASE, **{k: CHANGED[k] for k in ("response_tokens", "action_mask",
                                                              "behavior_logprobs", "turns")}})
    policy, env = t.turns
    changed = dict(start=1, end=2, writer=Writer.ENV, policy_version=1, reward=0.5, tool="python",
                   tool_status="timeout", tool_seconds=0.25, tool_retries=2)
    assert set(changed) == {f.name for f in fields(Turn)}  # a new Turn field must be hashed (and listed here)
    for name, value in changed.items():
        tampered = replace(t, turns=(replace(policy, **{name: value}), env))
        assert not tampered.verify(), name


EARLIER_EPISODE_DIGEST = "c7600d449173a06e3ce21ba259fd20e338d01ad403965072266f5efa02a58e6f"  # before tool_retries


def test_episode_digests_without_retries_stay_what_they_were_before_tool_retries():
    """Episodes stored before Turn.tool_retries existed (all 0) still verify; a retry changes the digest."""
    t = Trajectory.create(**{**BASE, **{k: CHANGED[k] for k in ("response_tokens", "action_mask",
                                                              "behavior_logprobs", "turns")}})
    assert t.checksum == EARLIER_EPISODE_DIGEST
    policy, env = t.turns
    assert t.updated(turns=(policy, replace(env, tool_retries=1))).checksum != EARLIER_EPISODE_DIGEST


def test_single_turn_digests_do_not_change_with_the_episode_fields():
    """``turns == ()`` hashes as before episodes existed, so checkpoints and queue logs from earlier runs verify."""
    assert Trajectory.create(**BASE).checksum == EARLIER_DIGEST


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31), max_size=8), st.lists(st.integers(0, 2**31), max_size=8))
def test_moving_a_token_between_prompt_and_response_changes_the_checksum(prompt, response):
    a = Trajectory.create(**{**BASE, "prompt_tokens": tuple(prompt), "response_tokens": tuple(response)})
    if prompt:
        b = Trajectory.create(**{**BASE, "prompt_tokens": tuple(prompt[:-1]),
                                 "response_tokens": (prompt[-1], *response)})
        assert a.checksum != b.checksum
