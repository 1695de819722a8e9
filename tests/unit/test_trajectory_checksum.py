"""A trajectory's checksum covers every field: changing any one of them breaks ``verify()``."""

from __future__ import annotations

from dataclasses import fields, replace

from hypothesis import given, settings, strategies as st

from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory, Turn, Writer

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
                      Turn(start=1, end=2, writer=Writer.ENV, tool="calc", tool_status="ok")))


def test_every_field_is_covered():
    t = Trajectory.create(**BASE)
    assert t.verify()
    assert set(CHANGED) == {f.name for f in fields(Trajectory)} - {"checksum"}
    for name, value in CHANGED.items():
        tampered = replace(t, **{name: value})  # bypasses updated(): the old checksum stays
        assert not tampered.verify(), name
        assert t.updated(**{name: value}).verify(), name


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**31), max_size=8), st.lists(st.integers(0, 2**31), max_size=8))
def test_moving_a_token_between_prompt_and_response_changes_the_checksum(prompt, response):
    a = Trajectory.create(**{**BASE, "prompt_tokens": tuple(prompt), "response_tokens": tuple(response)})
    if prompt:
        b = Trajectory.create(**{**BASE, "prompt_tokens": tuple(prompt[:-1]),
                                 "response_tokens": (prompt[-1], *response)})
        assert a.checksum != b.checksum
