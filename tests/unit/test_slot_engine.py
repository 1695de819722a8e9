"""The local engine's slot scheduler (rollout.options.scheduler: slots): continuous batching with per-row streams.

Runs the real engine on the tiny policy (perturbed so that responses are more than one token long).
"""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
import torch

from rlctl import ConfigError
from rlctl.contracts.types import RolloutContext, RolloutRequest, TerminalReason
from tests.unit.test_colocate import _noisy


def _engine(session, **options):
    from rlctl_local_engine.engine import LocalEngine
    from rlctl_local_engine.options import LocalEngineOptions

    engine = LocalEngine(RolloutContext(model_dir=str(session.policy_dir), tokenizer_hash=session.tokenizer_hash,
                                        seed=0), LocalEngineOptions(device="cpu", **options))
    engine.update_weights(_noisy(engine, scale=0.5, seed=0))
    return engine


def _requests(session, num_prompts=4, group_size=4, **sampling):
    """32 new tokens: the perturbed policy ends some rows with EOS before that, so slots free at different steps."""
    config = dataclasses.replace(session.sampling, **{"max_tokens": 32, **sampling})
    return [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(session.tokenizer(p.text)["input_ids"]),
                           group_size=group_size, sampling=config, dataset_version=session.task.version)
            for p in session.task.train[:num_prompts]]


def _samples(trajectories):
    return [(t.prompt_id, t.group_index, t.response_tokens, t.behavior_logprobs, t.terminal_reason)
            for t in trajectories]


def test_samples_do_not_depend_on_the_slot_count(tiny_session):
    """Same seed, same requests: 2, 3, 7 and 64 slots draw identical tokens, and log-probs within the mismatch
    bound (bit-identical where the machine's matmul kernels are batch-invariant)."""
    requests = _requests(tiny_session)
    runs = {slots: _samples(_engine(tiny_session, scheduler="slots", max_batch_sequences=slots).generate(requests))
            for slots in (2, 3, 7, 64)}
    reference = runs[64]
    lengths = [len(s[2]) for s in reference]
    assert len(set(lengths)) > 1 and sum(lengths) > 2 * len(lengths)  # rows end at different steps: slots refill
    for slots, samples in runs.items():
        _assert_same_draws(samples, reference)


def test_the_g_samples_of_a_prompt_differ(tiny_session):
    """Each sample index has its own stream: the copies of a prompt are not the same sample."""
    out = _engine(tiny_session, scheduler="slots", max_batch_sequences=4).generate(_requests(tiny_session))
    groups: dict[str, set] = {}
    for t in out:
        groups.setdefault(t.prompt_id, set()).add(t.response_tokens)
    assert all(len(responses) > 1 for responses in groups.values())


def test_greedy_slots_equal_the_batch_scheduler(tiny_session):
    requests = _requests(tiny_session, temperature=0.0)
    a = _engine(tiny_session, scheduler="slots", max_batch_sequences=3).generate(requests)
    b = _engine(tiny_session).generate(requests)
    assert [(t.response_tokens, t.terminal_reason) for t in a] == [(t.response_tokens, t.terminal_reason) for t in b]
    for x, y in zip(a, b):  # other attention kernels (whole-capacity masked vs trimmed): the mismatch bound
        torch.testing.assert_close(torch.tensor(x.behavior_logprobs), torch.tensor(y.behavior_logprobs),
                                   rtol=0, atol=1e-4)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.7, "top_k": 8, "top_p": 0.9},
                                      {"temperature": 1.3, "top_p": 0.8}])
def test_behaviour_logprobs_match_a_full_forward(tiny_session, sampling):
    """The log-probs a slot row reports are those of the learner-style full-sequence forward (1e-4)."""
    engine = _engine(tiny_session, scheduler="slots", max_batch_sequences=5)
    worst = _worst_logprob_gap(engine, engine.generate(_requests(tiny_session, **sampling)))
    assert worst <= 1e-4, f"max |logpi - logmu| = {worst:.2e}"


def _worst_logprob_gap(engine, trajectories) -> float:
    """max |behaviour log-prob - the learner-style full forward's| over every token of ``trajectories``."""
    from rlctl.kit.algo import process_logits

    config, worst = trajectories[0].sampling_config, 0.0
    for t in trajectories:
        ids = torch.tensor([list(t.prompt_tokens) + list(t.response_tokens)])
        with torch.no_grad():
            logits = engine.model(input_ids=ids).logits[0, len(t.prompt_tokens) - 1: -1]
        processed = process_logits(logits, config.temperature, config.top_k, config.top_p)
        recomputed = torch.log_softmax(processed, -1).gather(-1, torch.tensor(t.response_tokens)[:, None])[:, 0]
        worst = max(worst, float((recomputed - torch.tensor(t.behavior_logprobs)).abs().max()))
    return worst


def test_resumed_state_draws_what_a_straight_run_draws(tiny_session):
    requests = _requests(tiny_session, num_prompts=3)
    straight = _engine(tiny_session, scheduler="slots", max_batch_sequences=4)
    straight.generate(requests)
    saved = straight.state()
    expected = _samples(straight.generate(requests))
    resumed = _engine(tiny_session, scheduler="slots", max_batch_sequences=4)
    resumed.load_state(saved)
    got = resumed.generate(requests)
    assert _samples(got) == expected
    assert [t.id for t in got] == [f"{r.prompt_id}/v1/c2/{g}" for r in requests for g in range(r.group_size)]


def test_cancel_acts_per_row_live_and_queued(tiny_session):
    """Request 1 cancelled after 40 decode steps on 3 slots: its admitted rows end aborted with a prefix of what
    they would have drawn, its queued rows end empty and aborted, and every other request's samples are those
    of an uncancelled run."""
    requests = _requests(tiny_session, num_prompts=3)
    plain = _samples(_engine(tiny_session, scheduler="slots", max_batch_sequences=3).generate(requests))
    polls = []

    def cancelled():
        polls.append(1)
        return [1] if len(polls) > 40 else []

    out = _engine(tiny_session, scheduler="slots", max_batch_sequences=3).generate(requests, cancelled=cancelled)
    hit = out[4:8]
    assert all(t.terminal_reason is TerminalReason.ABORT for t in hit)
    assert any(t.response_tokens == () for t in hit) and any(t.response_tokens for t in hit)
    for t, (_, _, tokens, logprobs, _) in zip(hit, plain[4:8]):
        assert t.response_tokens == tokens[: len(t.response_tokens)]
        assert t.behavior_logprobs == logprobs[: len(t.behavior_logprobs)]
    _assert_same_draws(_samples(out[:4]) + _samples(out[8:]), plain[:4] + plain[8:])


def _assert_same_draws(got, expected):
    """Same tokens and reasons; log-probs within the engine/learner mismatch bound (1e-4). How many rows share a
    forward changes with the slot count (or a cancelled request), and whether the matmul kernels give bit-equal
    rows across batch sizes depends on the machine: bit-equal on the Intel host the engine was built on, up to
    5.3e-5 apart on an AMD EPYC one (slots.py's docstring)."""
    assert [(p, g, tokens, reason) for p, g, tokens, _, reason in got] == \
        [(p, g, tokens, reason) for p, g, tokens, _, reason in expected]
    worst = max((abs(a - b) for x, y in zip(got, expected) for a, b in zip(x[3], y[3])), default=0.0)
    assert worst <= 1e-4, f"log-probs differ by {worst:.2e}"


def test_length_tail_keeps_responses(tiny_session):
    """The benchmark's long-tail option decodes past a response's end; the trajectories are unchanged."""
    requests = _requests(tiny_session, num_prompts=2)
    plain = _samples(_engine(tiny_session, scheduler="slots", max_batch_sequences=3).generate(requests))
    tailed = _engine(tiny_session, scheduler="slots", max_batch_sequences=3, length_tail_alpha=1.0)
    assert _samples(tailed.generate(requests)) == plain


def test_unknown_scheduler_is_refused_naming_the_choices():
    from rlctl_local_engine.options import LocalEngineOptions

    with pytest.raises(pydantic.ValidationError, match="'batch' or 'slots'"):
        LocalEngineOptions(scheduler="continuous")


def test_slots_on_a_model_off_the_fast_path_is_one_error_naming_the_fix(tmp_path):
    """A sliding-window Qwen2 runs only on the generic HF path, which has no slots."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlctl.models.tokenizer import build_char_tokenizer
    from rlctl_local_engine.engine import LocalEngine
    from rlctl_local_engine.options import LocalEngineOptions

    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=64, use_sliding_window=True, sliding_window=16,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    ctx = RolloutContext(model_dir=str(tmp_path), tokenizer_hash="t", seed=0)
    with pytest.raises(ConfigError, match="scheduler: batch") as err:
        LocalEngine(ctx, LocalEngineOptions(device="cpu", scheduler="slots"))
    assert "fast path" in str(err.value)
    LocalEngine(ctx, LocalEngineOptions(device="cpu"))  # the batch scheduler takes it
