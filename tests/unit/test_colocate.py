"""Sharing a GPU with a colocated learner: the local engine's KV budget, memory release and weight offload.

Everything here runs on CPU (the offload round trip is driven through the same code the engine runs on CUDA
after each call); tests/unit/test_dryrun_colocate.py checks the ledger side.
"""

from __future__ import annotations

import dataclasses

import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl import ConfigError, RoleError
from rlctl.contracts.types import RolloutContext, RolloutRequest, WeightUpdate
from rlctl.models.fingerprint import fingerprint
from rlctl.planning.memory import GiB, kv_cache_bytes


def _engine(session, noisy=True, **options):
    """A CPU engine; ``noisy`` serves a perturbed policy (the tiny policy answers greedily with eos at once, which
    would make the greedy comparisons one token long)."""
    from rlctl_local_engine.engine import LocalEngine
    from rlctl_local_engine.options import LocalEngineOptions

    engine = LocalEngine(RolloutContext(model_dir=str(session.policy_dir), tokenizer_hash=session.tokenizer_hash,
                                        seed=0), LocalEngineOptions(device="cpu", **options))
    if noisy:
        engine.update_weights(_noisy(engine, scale=0.5, seed=0))
    return engine


def _noisy(engine, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    noised: dict[int, torch.Tensor] = {}  # tied tensors (embeddings and LM head) get the same noise
    state = {n: noised.setdefault(t.data_ptr(), t + scale * torch.randn(t.shape, generator=gen))
             if t.is_floating_point() else t for n, t in engine.state_dict().items()}
    return WeightUpdate(version=engine.policy_version + 1, state_dict=state, fingerprint=fingerprint(state))


def _requests(session, greedy=True, num_prompts=4, group_size=4):
    sampling = dataclasses.replace(session.sampling, temperature=0.0) if greedy else session.sampling
    return [RolloutRequest(prompt_id=p.id, prompt_tokens=tuple(session.tokenizer(p.text)["input_ids"]),
                           group_size=group_size, sampling=sampling, dataset_version=session.task.version)
            for p in session.task.train[:num_prompts]]


def _row_bytes(engine, requests):
    shape, elem = engine._kv_shape()
    tokens = max(len(r.prompt_tokens) for r in requests) + requests[0].sampling.max_tokens
    return kv_cache_bytes(shape, 1, tokens, elem)


def _content(trajectories):
    """Everything but the id (its per-forward counter) and the start time."""
    return [(t.prompt_id, t.group_index, t.response_tokens, t.terminal_reason) for t in trajectories]


@pytest.mark.parametrize("given_, expected", [("2GiB", 2 * GiB), ("512MiB", 512 << 20), (4096, 4096),
                                              ("4096", 4096), (0.3, 0.3), ("0.25", 0.25), (None, None)])
def test_budget_reads_sizes_and_fractions(given_, expected):
    from rlctl_local_engine.options import LocalEngineOptions

    assert LocalEngineOptions(kv_cache_budget=given_).kv_cache_budget == expected


@pytest.mark.parametrize("bad", [0, -5, 1.5, "lots", True, "0"])
def test_bad_budgets_are_one_error_naming_the_spelling(bad):
    from rlctl_local_engine.options import LocalEngineOptions

    with pytest.raises(pydantic.ValidationError, match="kv_cache_budget|as a size"):
        LocalEngineOptions(kv_cache_budget=bad)


def test_the_per_row_formula_is_what_the_sampler_allocates(tiny_session):
    """Sum the real K and V tensors of the sampler's static cache for rows of unequal prompts."""
    from rlctl_local_engine.sampler import _dedupe, _left_pad, _LlamaDecoder, fast_path_supported

    engine = _engine(tiny_session)
    assert fast_path_supported(engine.model)
    requests = _requests(tiny_session, num_prompts=3, group_size=2)
    requests[0] = dataclasses.replace(requests[0], prompt_tokens=requests[0].prompt_tokens[:3])  # padding counts
    prompts = [list(r.prompt_tokens) for r in requests for _ in range(r.group_size)]
    assert len({len(p) for p in prompts}) > 1
    unique, expand = _dedupe(prompts)
    ids, mask = _left_pad(unique, engine.tokenizer.pad_token_id)
    max_new = requests[0].sampling.max_tokens
    decoder = _LlamaDecoder(engine.model, ids, mask, expand, max_new)
    allocated = sum(t.untyped_storage().nbytes() for t in decoder.k + decoder.v)
    assert allocated == len(prompts) * _row_bytes(engine, requests)


def test_rows_per_forward_are_the_budget_over_the_row_bytes(tiny_session):
    requests = _requests(tiny_session)
    row = _row_bytes(_engine(tiny_session), requests)
    assert _engine(tiny_session, kv_cache_budget=3 * row).rows_per_forward(requests) == 3
    assert _engine(tiny_session, kv_cache_budget=3 * row - 1).rows_per_forward(requests) == 2
    assert _engine(tiny_session, kv_cache_budget=100 * row, max_batch_sequences=5).rows_per_forward(requests) == 5
    assert _engine(tiny_session).rows_per_forward(requests) == 512


def test_a_budget_below_one_row_is_one_error_with_the_numbers(tiny_session):
    requests = _requests(tiny_session)
    row = _row_bytes(_engine(tiny_session), requests)
    with pytest.raises(RoleError, match=rf"too small for one row.*raise kv_cache_budget to at least {row} bytes"):
        _engine(tiny_session, kv_cache_budget=row - 1).generate(requests)


def test_a_fraction_on_cpu_is_refused_naming_the_fix(tiny_session):
    with pytest.raises(ConfigError, match=r"fraction.*give the budget in bytes on CPU"):
        _engine(tiny_session, kv_cache_budget=0.3)


def test_budget_chunked_greedy_rollouts_equal_unchunked_ones(tiny_session):
    """A 3-row budget splits the 4-row groups across forwards; greedy content and order are unchanged."""
    requests = _requests(tiny_session)
    whole = _engine(tiny_session)
    row = _row_bytes(whole, requests)
    chunked = _engine(tiny_session, kv_cache_budget=3 * row)
    a, b = whole.generate(requests), chunked.generate(requests)
    assert whole._calls == 1 and chunked._calls == 6  # 16 rows in forwards of at most 3
    assert _content(a) == _content(b)
    assert sum(len(t.response_tokens) for t in a) > 2 * len(a)  # real decoding, not one-token answers
    for x, y in zip(a, b):
        torch.testing.assert_close(torch.tensor(x.behavior_logprobs), torch.tensor(y.behavior_logprobs),
                                   rtol=0, atol=1e-5)


def test_cancelling_a_split_group_aborts_all_its_rows(tiny_session):
    requests = _requests(tiny_session, num_prompts=2)
    engine = _engine(tiny_session, max_batch_sequences=3)
    out = engine.generate(requests, cancelled=lambda: [1])
    assert [t.terminal_reason.value for t in out[4:]] == ["abort"] * 4
    assert all(t.terminal_reason.value != "abort" for t in out[:4])


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(st.integers(1, 9), min_size=1, max_size=8), cap=st.integers(1, 10))
def test_chunks_keep_order_cover_every_row_once_and_respect_the_cap(groups, cap):
    from rlctl_local_engine.engine import _chunks

    requests = [RolloutRequest(prompt_id=str(i), prompt_tokens=(1,), group_size=g, sampling=None,
                               dataset_version="d") for i, g in enumerate(groups)]
    chunks = _chunks(requests, cap)
    assert all(1 <= sum(len(gs) for _, _, gs in c) <= cap for c in chunks)
    rows = [(k, g) for c in chunks for k, _, gs in c for g in gs]
    assert rows == [(k, g) for k, n in enumerate(groups) for g in range(n)]
    if max(groups) <= cap:  # groups that fit are never split
        assert len({k for c in chunks for k, _, _ in c}) == sum(len(c) for c in chunks)


def test_offload_round_trip_moves_the_weights_and_generates_the_same(tiny_session):
    """The CUDA path's offload and reload run here to host memory and back: fresh storages, same module tensors,
    same values, same greedy trajectories, and an update taken while offloaded is served after the reload."""
    requests = _requests(tiny_session, num_prompts=2)
    engine, reference = _engine(tiny_session), _engine(tiny_session)
    before = engine.generate(requests)
    params = dict(engine.model.named_parameters())
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    values = {n: p.detach().clone() for n, p in params.items()}
    engine._offload_weights()
    assert engine._offloaded
    assert all(p.device.type == "cpu" for p in engine.model.parameters())
    assert all(params[n] is p for n, p in engine.model.named_parameters())  # the module keeps its tensors
    assert all(params[n].data_ptr() != ptrs[n] for n in params)  # ...with new storage behind them
    assert all(torch.equal(params[n], values[n]) for n in params)
    assert engine.model.lm_head.weight is engine.model.model.embed_tokens.weight  # ties survive
    # a weight update while offloaded lands in host memory and is what the next call serves
    update = _noisy(reference, scale=0.1, seed=1)
    engine.update_weights(update)
    reference.update_weights(update)
    assert engine.fingerprint == reference.fingerprint
    after = engine.generate(requests)  # reloads first
    assert not engine._offloaded
    assert _content(after) == _content(reference.generate(requests))
    assert _content(after) != _content(before)


def test_release_and_offload_options_are_accepted_no_ops_on_cpu(tiny_session):
    requests = _requests(tiny_session, num_prompts=2)
    plain = _engine(tiny_session)
    engine = _engine(tiny_session, release_memory=True, offload_weights=True)
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    assert _content(engine.generate(requests)) == _content(plain.generate(requests))
    assert not engine._offloaded and [p.data_ptr() for p in engine.model.parameters()] == ptrs
