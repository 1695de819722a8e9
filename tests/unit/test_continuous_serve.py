"""Continuous batching: the local engine's session (rows join between decode steps) and the serve worker on it.

Runs the real engine on the tiny policy (perturbed so that responses are more than one token long) and the real
ContinuousWorker of `rlctl serve rollout` in-process (its HTTP side is tests/integration/test_serve_sglang.py).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from rlctl.contracts.types import SamplingConfig, TerminalReason
from rlctl.serve.continuous import ContinuousWorker
from rlctl.serve.http_common import Cancelled
from rlctl.serve.sglang_api import Row
from tests.unit.test_colocate import _noisy
from tests.unit.test_slot_engine import _assert_same_draws, _engine, _requests, _samples


def _drain(session, *, add_at=None, requests=()):
    """Step ``session`` until idle; ``add_at[step]`` = requests added before that step. Trajectories by row id."""
    out, step = {}, 0
    add_at = add_at or {}
    while True:
        for req in add_at.pop(step, ()):
            session.add(req)
        if session.idle and not add_at:
            return [out[r] for r in sorted(out)]
        out.update(session.step())
        step += 1


def test_a_session_drained_at_once_equals_the_slot_scheduler(tiny_session):
    """All requests added up front: the same schedule as generate() with scheduler: slots, so bit-equal samples."""
    requests = _requests(tiny_session)
    expected = _samples(_engine(tiny_session, scheduler="slots", max_batch_sequences=5).generate(requests))
    session = _engine(tiny_session).open_session(5)
    for req in requests:
        session.add(req)
    assert _samples(_drain(session)) == expected


def test_a_prompt_that_joins_mid_flight_is_prefilled_inside_a_decode_step(tiny_session, monkeypatch):
    """Only the first prompt (nothing decoding yet) gets a prefill forward of its own; the later ones ride in the
    decode step's forward, and rows that differ only in max tokens share one draw per step."""
    from rlctl_local_engine import slot_decoder, slots, streams

    counts = {"prefill": 0, "fused": 0, "draws": 0, "steps": 0}
    prefill, step, draw = slot_decoder._SlotDecoder.prefill, slot_decoder._SlotDecoder.step, streams._draw

    def counted_prefill(self, prompts):
        counts["prefill"] += 1
        return prefill(self, prompts)

    def counted_step(self, tok, active, prompts=()):
        counts["fused"] += bool(prompts) and tok is not None
        counts["steps"] += tok is not None
        return step(self, tok, active, prompts)

    def counted_draw(*args):
        counts["draws"] += 1
        return draw(*args)

    monkeypatch.setattr(slot_decoder._SlotDecoder, "prefill", counted_prefill)
    monkeypatch.setattr(slot_decoder._SlotDecoder, "step", counted_step)
    monkeypatch.setattr(slots, "_draw", counted_draw)
    requests = [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_tokens=32 - 4 * i))
                for i, r in enumerate(_requests(tiny_session, num_prompts=3))]
    session = _engine(tiny_session).open_session(8)
    out = _drain(session, add_at={0: requests[:1], 2: requests[1:2], 4: requests[2:]})
    assert len(out) == 12 and {t.prompt_id for t in out} == {r.prompt_id for r in requests}
    assert counts["prefill"] == 1 and counts["fused"] == 2
    # one draw per step, not one per max_tokens (3 here); a step whose draw ends every live row decodes nothing
    assert counts["steps"] <= counts["draws"] <= counts["steps"] + len(requests)


def test_rows_that_join_mid_flight_draw_what_they_would_have_drawn_alone(tiny_session):
    """Requests added at steps 0, 3 and 11 (while others decode, on 3 slots that refill): each row's sample is the one
    it draws when everything is added at once (own stream; log-probs within the kernel bound)."""
    requests = _requests(tiny_session, num_prompts=3)
    upfront = _engine(tiny_session).open_session(3)
    for req in requests:
        upfront.add(req)
    expected = _samples(_drain(upfront))
    late = _engine(tiny_session).open_session(3)
    got = _samples(_drain(late, add_at={0: requests[:1], 3: requests[1:2], 11: requests[2:]}))
    lengths = [len(s[2]) for s in expected]
    assert len(set(lengths)) > 1  # rows end at different steps: slots are refilled
    _assert_same_draws(got, expected)


def test_a_session_grows_its_slots_and_capacity_for_what_arrives(tiny_session):
    """A session opened for 8 slots starts as small as its first request and grows; a later, longer request
    (longer prompt, more new tokens) gets the capacity it needs and runs to its limit with ignore_eos."""
    engine = _engine(tiny_session)
    session = engine.open_session(8)
    small = _requests(tiny_session, num_prompts=1, group_size=2, max_tokens=4)[0]
    session.add(small)
    first = session.step()
    assert session._session._dec.slots == 2
    big = dataclasses.replace(small, prompt_tokens=small.prompt_tokens * 3, group_size=6,
                              sampling=dataclasses.replace(small.sampling, max_tokens=48))
    session.add(big, ignore_eos=True)
    out, widest, deepest = dict(first), 0, 0
    while not session.idle:
        out.update(session.step())
        widest = max(widest, session._session._dec.slots)  # compaction shrinks it again as rows end
        deepest = max(deepest, session._session._dec.capacity)
    assert widest == 8 and deepest >= len(big.prompt_tokens) + 48
    assert session._session._dec.capacity == 0 and session._session._dec.slots == 0  # idle: back to nothing
    long_rows = [t for t in out.values() if t.prompt_tokens == big.prompt_tokens]
    assert len(long_rows) == 6 and all(t.num_response_tokens == 48 for t in long_rows)
    assert all(t.terminal_reason is TerminalReason.LENGTH for t in long_rows)


def test_a_session_keeps_the_weights_it_opened_on_after_an_update(tiny_session):
    """Rows in flight when the engine loads new weights finish on the old ones, labelled with the old version,
    exactly as if no update had come; a session opened after the update samples the new weights."""
    requests = _requests(tiny_session, num_prompts=2)
    reference = _engine(tiny_session)
    old_version = reference.policy_version
    update = _noisy(reference, scale=0.3, seed=3)
    untouched = reference.open_session(4)
    for req in requests:
        untouched.add(req)
    expected = _samples(_drain(untouched))
    engine = _engine(tiny_session)
    session = engine.open_session(4)
    for req in requests:
        session.add(req)
    got = dict(session.step())
    engine.update_weights(update)  # mid-flight: the session's rows go on with the weights it opened on
    while not session.idle:
        got.update(session.step())
    old = [got[row] for row in sorted(got)]
    assert _samples(old) == expected and {t.policy_version for t in old} == {old_version}
    fresh = engine.open_session(4)
    fresh.add(requests[0])
    new = _drain(fresh)
    assert {t.policy_version for t in new} == {update.version}
    assert [t.behavior_logprobs for t in new] != [t.behavior_logprobs for t in old[:4]]


# -- the serve worker ----------------------------------------------------------------


def _rows(session, n, max_tokens, ignore_eos=False, rid="r"):
    prompt = tuple(session.tokenizer(session.task.train[0].text)["input_ids"])
    sampling = SamplingConfig(temperature=1.0, max_tokens=max_tokens)
    return [Row(input_ids=prompt, sampling=sampling, rid=f"{rid}{i}", return_logprob=True, no_stop_trim=False,
                ignore_eos=ignore_eos) for i in range(n)]


@pytest.fixture
def worker(tiny_session):
    w = ContinuousWorker(_engine(tiny_session), weight_version="v0", max_batch_rows=8)
    yield w
    w.close()


def test_a_short_request_is_answered_while_a_long_one_decodes(worker, tiny_session):
    """The point of continuous batching: a 2-token request that arrives while a 400-token one decodes joins its
    steps and is answered long before the long one ends (a batch scheduler would make it wait)."""
    long_job = worker.submit(_rows(tiny_session, 2, 400, ignore_eos=True, rid="long"))
    while worker.stats.batches < 5:  # the long rows are decoding
        time.sleep(0.001)
    trajectories, versions = worker.generate(_rows(tiny_session, 3, 2, rid="short"), timeout_s=60)
    assert not long_job.future.done()
    assert len(trajectories) == 3 and versions == ["v0"] * 3
    assert all(t.num_response_tokens <= 2 for t in trajectories)
    done, _ = long_job.future.result(timeout=120)
    assert [t.num_response_tokens for t in done] == [400, 400]  # ignore_eos: to the limit
    assert worker.stats.largest_batch_requests == 2 and worker.stats.largest_batch_rows == 5


def test_a_request_of_many_rows_does_not_hold_a_small_one_back(worker, tiny_session):
    """40 rows of 300 tokens on 8 slots, then a 1-row request: free slots are shared among the requests with rows
    left, so the small one starts at the next free slot, not after the 32 rows queued before it."""
    big = worker.submit(_rows(tiny_session, 40, 300, ignore_eos=True, rid="big"))
    while worker.stats.batches < 5:
        time.sleep(0.001)
    small = worker.submit(_rows(tiny_session, 1, 3, ignore_eos=True, rid="small"))
    trajectories, _ = small.future.result(timeout=120)
    assert trajectories[0].num_response_tokens == 3
    assert not big.future.done() and worker.stats.batches < 2 * 300  # a FIFO queue would make it wait ~1,200 steps
    done, _ = big.future.result(timeout=300)
    assert [t.num_response_tokens for t in done] == [300] * 40


def test_a_weight_update_waits_for_the_rows_in_flight_and_later_rows_use_it(worker, tiny_session):
    """Rows decoding when an update is asked for finish under the old weights (and say so); the update runs
    between steps; requests queued meanwhile start on the new weights."""
    engine = worker.engine
    before = engine.policy_version
    update = _noisy(engine, scale=0.1, seed=5)
    running = worker.submit(_rows(tiny_session, 2, 200, ignore_eos=True, rid="old"))
    while worker.stats.batches < 3:
        time.sleep(0.001)

    def apply(w):
        w.engine.update_weights(update)
        w.weight_version = "v1"
        return "applied"

    result = {}
    caller = threading.Thread(target=lambda: result.setdefault("call", worker.call(apply, timeout_s=120)))
    caller.start()
    time.sleep(0.05)
    later = worker.submit(_rows(tiny_session, 2, 3, rid="new"))
    old, old_versions = running.future.result(timeout=120)
    caller.join(timeout=120)
    new, new_versions = later.future.result(timeout=120)
    assert result["call"] == "applied"
    assert old_versions == ["v0", "v0"] and [t.num_response_tokens for t in old] == [200, 200]
    assert all(t.policy_version == before for t in old)
    assert new_versions == ["v1", "v1"] and all(t.policy_version == before + 1 for t in new)


def test_a_cancelled_request_stops_decoding_and_the_others_go_on(worker, tiny_session):
    doomed = worker.submit(_rows(tiny_session, 2, 1000, ignore_eos=True, rid="doomed"))
    other = worker.submit(_rows(tiny_session, 2, 30, ignore_eos=True, rid="other"))
    while worker.stats.batches < 3:
        time.sleep(0.001)
    doomed.cancelled.set()
    with pytest.raises(Cancelled):
        doomed.future.result(timeout=60)
    trajectories, _ = other.future.result(timeout=60)
    assert [t.num_response_tokens for t in trajectories] == [30, 30]
    deadline = time.monotonic() + 10
    while not worker.idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker.idle and worker.stats.batches < 200  # the 1000-token rows did not run on
    assert worker.stats.cancelled == 1


def test_an_engine_failure_fails_the_requests_in_flight_and_the_next_one_is_served(worker, tiny_session,
                                                                                    monkeypatch):
    from rlctl_local_engine.engine import EngineSession

    real = EngineSession.step
    calls = {"n": 0}

    def flaky(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("engine fault")
        return real(self)

    monkeypatch.setattr(EngineSession, "step", flaky)
    job = worker.submit(_rows(tiny_session, 2, 50, ignore_eos=True))
    with pytest.raises(RuntimeError, match="engine fault"):
        job.future.result(timeout=60)
    trajectories, _ = worker.generate(_rows(tiny_session, 1, 4, ignore_eos=True), timeout_s=60)
    assert trajectories[0].num_response_tokens == 4


def test_scheduler_choice_is_checked_before_serving(tiny_session, tmp_path):
    """auto picks continuous on a fast-path model and batch off it; asking for continuous where it cannot run,
    or for an unknown scheduler, is one error naming the fix."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlctl import RoleError
    from rlctl.models.tokenizer import build_char_tokenizer
    from rlctl.serve.server import build_service

    service = build_service(tiny_session.policy_dir)
    try:
        assert service.scheduler == "continuous" and service.limits.ignore_eos
    finally:
        service.close()
    tok = build_char_tokenizer()  # a sliding-window Qwen2 runs only on the generic HF path: no sessions
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, use_sliding_window=True, sliding_window=16,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    service = build_service(tmp_path)
    try:
        assert service.scheduler == "batch"
    finally:
        service.close()
    with pytest.raises(RoleError, match="--scheduler continuous needs") as err:
        build_service(tmp_path, scheduler="continuous")
    assert "--scheduler batch" in err.value.hint
    with pytest.raises(RoleError, match="'sometimes' is not one of auto, continuous, batch"):
        build_service(tiny_session.policy_dir, scheduler="sometimes")
