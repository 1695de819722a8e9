"""Small pieces of the overlapped loop: draw order, importance weights, the long-tail decode option."""

from __future__ import annotations

import torch

from rlctl.algo.importance import lag_divergence, truncated_is_weights
from rlctl.contracts.types import PromptRecord, SamplingConfig, Split, TerminalReason
from rlctl.engine.batching import PromptCursor
from rlctl.engine.metrics import overlap_metrics
from rlctl.engine.spec import LoopSpec, QueueSpec


def test_record_at_matches_the_cursor_order_across_epochs():
    records = [PromptRecord(id=f"p{i}", text=str(i), answer=str(i), split=Split.TRAIN) for i in range(5)]
    cursor = PromptCursor(records, seed=3)
    walked = cursor.next(12)
    fresh = PromptCursor(records, seed=3)
    assert [fresh.record_at(i) for i in range(12)] == walked
    assert fresh.state.epoch == 0 and fresh.state.position == 0  # no state change


def test_truncated_is_weights_cap_and_mask():
    prox = torch.tensor([[0.0, -2.0, -1.0]])
    mu = torch.tensor([[-3.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    w = truncated_is_weights(prox, mu, mask, cap=2.0)
    assert w.tolist()[0][0] == 2.0 and abs(w[0, 1].item() - torch.exp(torch.tensor(-1.0)).item()) < 1e-6
    assert w[0, 2].item() == 0.0
    assert lag_divergence(prox, mu, mask).tolist() == [2.0]


def test_mode_bounds_and_default_capacity():
    spec = lambda mode, k=3: LoopSpec(mode=mode, steps=1, prompts_per_step=8, group_size=2,  # noqa: E731
                                      queue=QueueSpec(max_staleness=k))
    assert [spec(m).max_ahead for m in ("sync", "one_step_off", "async")] == [0, 1, 3]
    assert spec("sync").capacity == 8 and spec("async").capacity == 32


def test_overlap_metrics_count_violations():
    m = overlap_metrics(staleness=[0, 1, 1, 3], dlag=[0.1, 0.2, 0.3, 0.4], latencies=[1.0, 2.0], bound=1)
    assert m["staleness_violations"] == 1 and m["staleness_max"] == 3 and m["staleness_p50"] == 1
    assert m["rollout_latency_p50_s"] == 2.0


def test_long_tail_option_keeps_responses_and_cuts_padding(tiny_policy_dir):
    from rlctl.models.load import load_policy
    from rlctl_local_engine.sampler import sample

    model, tok = load_policy(str(tiny_policy_dir))
    prompts = [list(tok("12+5=")["input_ids"])] * 6
    sampling = SamplingConfig(temperature=1.0, max_tokens=10)
    out = sample(model, prompts, sampling, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                 generator=torch.Generator().manual_seed(0), min_lengths=[10] * 6)
    for tokens, logps, reason in zip(out.tokens, out.logprobs, out.reasons):
        assert len(tokens) == len(logps) <= 10
        if reason is TerminalReason.EOS:
            assert tokens[-1] == tok.eos_token_id and tok.eos_token_id not in tokens[:-1]
        else:
            assert len(tokens) == 10 and tok.eos_token_id not in tokens
