"""Episodes (multi-turn Trajectories) travel like single-turn samples: queue log, queue recovery, pickling.

The queue's write-ahead log is where the overlapped and Ray modes keep groups
between rollout and learner, and a checkpoint of the overlapped queue is a
cursor into that log: so an episode's turns (writers, spans, versions, tool
statuses and seconds, per-turn rewards) must come back from it bit-exactly
and with a valid checksum, and the staleness bound must judge an episode by
its OLDEST policy turn. Ray hands Trajectories between actors by pickling
them. (``rlctl serve rollout`` speaks the SGLang API, one generation per row:
it returns token ids, never Trajectories, so an episode crosses it one
policy turn at a time and is assembled on the client's side.)
"""

from __future__ import annotations

import json
import pickle
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory, Turn, Writer
from rlctl.engine.queue import Group, TrajectoryQueue, trajectory_from_dict, trajectory_to_dict

STATUSES = st.sampled_from([None, "ok", "timeout", "error", "garbage"])
FLOATS = st.floats(allow_nan=False, allow_infinity=False, width=64)


@st.composite
def turn_specs(draw) -> list[tuple[Writer, int, dict]]:
    """Alternating policy / environment spans (policy first, either last) with versions that never go back."""
    n = draw(st.integers(1, 7))
    version = draw(st.integers(0, 50))
    out = []
    for i in range(n):
        length = draw(st.integers(1 if i % 2 == 0 else 0, 5))  # an env turn may append nothing (a failed tool)
        if i % 2 == 0:
            version += draw(st.integers(0, 3))
            out.append((Writer.POLICY, length, {"policy_version": version,
                                                "reward": draw(st.none() | FLOATS)}))
        else:
            out.append((Writer.ENV, length, {"tool": draw(st.none() | st.text(max_size=8)),
                                             "tool_status": draw(STATUSES),
                                             "tool_seconds": draw(st.floats(0, 1e4, allow_nan=False)),
                                             "reward": draw(st.none() | FLOATS)}))
    return out


def episode(spec: list[tuple[Writer, int, dict]], *, gid: str = "g", index: int = 0, logprob: float = -0.5,
            reward: float | None = 1.0) -> Trajectory:
    """An episode laid out from ``(writer, length, turn fields)`` spans; env tokens have mask 0 and log-prob 0.0."""
    turns, tokens, mask, logprobs = [], [], [], []
    for writer, length, fields in spec:
        start = len(tokens)
        policy = writer is Writer.POLICY
        tokens += [(7 if policy else 11) + (start + k) % 5 for k in range(length)]
        mask += [int(policy)] * length
        logprobs += [logprob if policy else 0.0] * length
        turns.append(Turn(start=start, end=len(tokens), writer=writer, **fields))
    versions = [t.policy_version for t in turns if t.writer is Writer.POLICY]
    return Trajectory.create(
        id=f"{gid}/{index}", prompt_id=gid, group_index=index, dataset_version="ds", policy_version=min(versions),
        tokenizer_hash="tok", prompt_tokens=(1, 2, 3), response_tokens=tuple(tokens), response_text="<calc>..",
        action_mask=tuple(mask), behavior_logprobs=tuple(logprobs), sampling_config=SamplingConfig(max_tokens=4),
        terminal_reason=TerminalReason.EOS, rollout_started_at=0.0, reward=reward, reward_components={"math": 1.0},
        turns=tuple(turns))


@settings(max_examples=60, deadline=None)
@given(spec=turn_specs(), logprob=st.floats(-30.0, 0.0))
def test_an_episode_round_trips_through_the_queue_log_bit_exactly(spec, logprob):
    t = episode(spec, logprob=logprob)
    assert t.is_episode and t.verify()
    back = trajectory_from_dict(json.loads(json.dumps(trajectory_to_dict(t))))  # what a log record holds
    assert back == t and back.turns == t.turns and back.checksum == t.checksum
    assert all(type(x.writer) is Writer for x in back.turns)
    group = Group(group_id="g", key=0, trajectories=(t,), put_at=0.0)
    assert Group.from_payload(group.to_payload(), seq=0).trajectories == (t,)


@settings(max_examples=30, deadline=None)
@given(spec=turn_specs())
def test_an_episode_survives_pickling_as_ray_hands_it_between_actors(spec):
    # what Ray serialises task arguments and results with
    cloudpickle = pytest.importorskip("ray.cloudpickle", reason="needs ray: pip install -e '.[ray]'")

    t = episode(spec)
    for back in (pickle.loads(pickle.dumps(t)), cloudpickle.loads(cloudpickle.dumps(t))):
        assert back == t and back.verify() and back.turns == t.turns


def test_a_changed_turn_fails_the_checksum_when_read_back():
    t = episode([(Writer.POLICY, 2, {"policy_version": 3}), (Writer.ENV, 2, {"tool": "calc", "tool_status": "ok"}),
                 (Writer.POLICY, 1, {"policy_version": 5})])
    body = trajectory_to_dict(t)
    body["turns"][1]["tool_status"] = "timeout"  # a flipped tool outcome must not pass as the sampled one
    try:
        trajectory_from_dict(body)
    except ValueError as err:
        assert "checksum" in str(err)
    else:
        raise AssertionError("a changed turn was accepted")


def two_versions(gid: str, key: int, base: int = 3) -> Group:
    """A group of two episodes whose policy turns were sampled at versions (base, base + 2), (base + 1, base + 3)."""
    a = episode([(Writer.POLICY, 2, {"policy_version": base}), (Writer.ENV, 3, {"tool": "calc", "tool_status": "ok"}),
                 (Writer.POLICY, 2, {"policy_version": base + 2})], gid=gid, index=0)
    b = episode([(Writer.POLICY, 1, {"policy_version": base + 1}),
                 (Writer.ENV, 1, {"tool": "calc", "tool_status": "timeout"}),
                 (Writer.POLICY, 3, {"policy_version": base + 3})], gid=gid, index=1, reward=0.0)
    return Group(group_id=gid, key=key, trajectories=(a, b), put_at=time.time())


def test_an_episode_counts_as_its_oldest_policy_turn_for_the_staleness_bound(tmp_path):
    group = two_versions("e0", 0)  # turns at versions (3, 5) and (4, 6)
    assert group.trajectories[0].policy_versions == (3, 5) and group.policy_version == 3
    q = TrajectoryQueue(tmp_path)
    q.put_many([group, two_versions("e1", 1, base=4)])  # turns at (4, 6) and (5, 7)
    # learner at 6, bound 2: e0's newer turns (5, 6) are within it, its oldest (3) is not: dropped as stale;
    # e1's oldest turn (4) is 2 behind: taken, and counted as dv 2
    r = q.take(1, current_version=6, max_staleness=2)
    assert r.drops["stale"] == 1 and r.dropped_ids == ["e0"]
    assert [g.group_id for g in r.groups] == ["e1"] and r.staleness == [2]
    q.close()


def test_a_group_is_never_judged_by_a_newer_turn_than_its_oldest():
    """Even an episode whose ``policy_version`` field was filled in with a newer turn's version is judged by the
    oldest version among its turns."""
    good = two_versions("e", 0).trajectories[0]
    newer = good.updated(policy_version=5)
    assert Group(group_id="e", key=0, trajectories=(newer,), put_at=0.0).policy_version == 3


def test_episodes_survive_queue_recovery_and_a_restored_cursor(tmp_path):
    """What a checkpoint of the overlapped queue holds is a cursor into the log: reopening the log from disk
    and restoring the cursor gives the episode groups back with their turns and valid checksums."""
    q = TrajectoryQueue(tmp_path, capacity=10)
    q.put_many([two_versions(f"e{k}", k) for k in range(3)])
    assert [g.group_id for g in q.take(1, current_version=5).groups] == ["e0"]
    saved = q.cursor()
    q.close()
    q2 = TrajectoryQueue(tmp_path, capacity=10)
    q2.restore_cursor(saved)
    r = q2.take(2, current_version=5)
    assert [g.group_id for g in r.groups] == ["e1", "e2"]
    for got in r.groups:
        want = two_versions(got.group_id, got.key)
        for a, b in zip(got.trajectories, want.trajectories):
            assert a.turns == b.turns and a.verify() and a.action_mask == b.action_mask
    q2.close()


def test_the_run_keeps_each_logged_steps_samples_with_their_turns(tmp_path, tiny_config):
    """``StepEnd.log`` hands the step's samples to the run's SampleLog (samples.jsonl) at the steps the sinks get;
    a re-run step replaces its line, and the episodes read back with their turns and checksums."""
    from rlctl.engine.heartbeat import NO_HEARTBEAT
    from rlctl.engine.loop import StepEnd
    from rlctl.engine.samples import SampleLog, read_samples
    from rlctl.engine.spec import LoopSpec

    log = SampleLog(tmp_path, per_step=3)
    end = StepEnd(LoopSpec.from_config(tiny_config), [log], None, None, NO_HEARTBEAT)
    groups = [two_versions(f"e{k}", k) for k in range(3)]
    for step, group in enumerate(groups):
        end.log(step, {"generated_tokens_total": 1.0}, group.trajectories + groups[0].trajectories)
    end.log(1, {"generated_tokens_total": 1.0}, groups[2].trajectories)  # step 1 again (a resume): replaced
    log.close()
    got = list(read_samples(tmp_path))
    assert [step for step, _ in got] == [0, 1]
    assert got[0][1] == [*groups[0].trajectories, groups[0].trajectories[0]]  # at most per_step samples
    assert got[1][1] == list(groups[2].trajectories)
    assert got[1][1][1].turns[1].tool_status == "timeout" and got[1][1][0].policy_versions == (3, 5)
