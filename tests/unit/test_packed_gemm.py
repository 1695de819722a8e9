"""The local engine's packed products (plugins/rlctl_local_engine/gemm.py): same function as torch's, by shape.

The tiny policy's weights are all below the packing threshold, so the engine tests run on the packed path here
by lowering the threshold to 0: every projection of both decoders is then a oneDNN packed product.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_slot_engine import _assert_same_draws, _engine, _requests, _samples, _worst_logprob_gap


def _gemm():
    from rlctl_local_engine import gemm

    if not gemm.packing_available():
        pytest.skip("this torch build has no oneDNN packed linear (torch.backends.mkldnn): the engine uses "
                    "torch.matmul there and nothing here is run")
    return gemm


@pytest.fixture
def all_packed(monkeypatch):
    gemm = _gemm()
    monkeypatch.setattr(gemm, "PACK_MIN", 0)
    return gemm


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 16, 24), (2, 5, 64, 48), (7, 40, 8)])
def test_packed_and_plain_products_agree_on_any_leading_shape(monkeypatch, transposed, shape):
    gemm = _gemm()
    gen = torch.Generator().manual_seed(len(shape))
    *lead, n_in, n_out = shape
    weight, bias = torch.randn(n_out, n_in, generator=gen), torch.randn(n_out, generator=gen)
    x = torch.randn(*lead, n_in * 2, generator=gen)[..., ::2]  # not contiguous
    expected = torch.nn.functional.linear(x, weight, bias)
    monkeypatch.setattr(gemm, "PACK_MIN", 0)
    packed = gemm.Linear(weight, bias, transposed=transposed)
    monkeypatch.setattr(gemm, "PACK_MIN", 1 << 60)
    plain = gemm.Linear(weight, bias, transposed=transposed)
    assert packed.packed and not plain.packed
    for layer in (packed, plain):
        got = layer(x)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_the_choice_is_by_shape_and_dtype_only():
    gemm = _gemm()
    assert gemm.Linear(torch.zeros(768, 256), None).packed  # 256 x 768: the threshold
    assert not gemm.Linear(torch.zeros(767, 256), None).packed
    assert not gemm.Linear(torch.zeros(768, 256, dtype=torch.float64), None).packed
    assert not gemm.Linear(torch.zeros(768, 256, device="meta"), None).packed  # not a CPU tensor (a GPU's)
    weight = torch.randn(768, 256)
    layer = gemm.Linear(weight, None)
    weight.zero_()  # the product keeps the weights it was built with
    assert layer(torch.ones(2, 256)).abs().sum() > 0


def test_packed_batch_and_slot_engines_keep_the_learners_logprobs(tiny_session, all_packed):
    """Every projection packed: both schedulers' behaviour log-probs are the full forward's within 2e-4.

    Twice the unpacked bound: oneDNN's fp32 sums carry about twice MKL's rounding error against float64 on the
    AMD EPYC host (max 1.2e-4 vs 4.5e-5 at K=1408; equal at K=128), and on these draws the slot scheduler's worst
    row moved from 5.6e-5 to 1.2e-4 (the batch scheduler's stayed at 3.1e-5)."""
    for options in ({}, {"scheduler": "slots", "max_batch_sequences": 5}):
        engine = _engine(tiny_session, **options)
        worst = _worst_logprob_gap(engine, engine.generate(_requests(tiny_session, temperature=0.7, top_k=8)))
        assert worst <= 2e-4, f"{options}: max |logpi - logmu| = {worst:.2e}"


def test_packed_slot_samples_do_not_depend_on_the_slot_count(tiny_session, all_packed):
    requests = _requests(tiny_session)
    runs = {slots: _samples(_engine(tiny_session, scheduler="slots", max_batch_sequences=slots).generate(requests))
            for slots in (2, 7, 64)}
    for samples in runs.values():
        _assert_same_draws(samples, runs[64])
    again = _samples(_engine(tiny_session, scheduler="slots", max_batch_sequences=7).generate(requests))
    assert again == runs[7]  # the same call twice: bit-equal
