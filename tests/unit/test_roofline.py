"""``rlctl profile``'s roofline: FLOPs per token by hand, the GEMM cache, padding waste of rollout token counts."""

from __future__ import annotations

import json

import pytest

from rlctl.config.load import load_config
from rlctl.contracts.types import SamplingConfig, TerminalReason, Trajectory
from rlctl.engine.metrics import rollout_tokens
from rlctl.planning import roofline as rl
from rlctl.planning.shapes import builtin_shape


def test_flops_per_token_of_the_builtin_llama_by_hand():
    cfg = load_config("configs/quickstart.yaml", [])
    shape = builtin_shape(cfg.model, 99)  # the built-in char tokenizer's vocabulary
    h, layers, kv, inter, vocab = 128, 4, 2 * 32, 384, 99  # 4 heads of 32 dims, 2 KV heads
    q_proj, k_proj, v_proj, o_proj = h * h, h * kv, h * kv, h * h
    mlp = 3 * h * inter  # gate, up, down
    per_layer = q_proj + k_proj + v_proj + o_proj + mlp  # matmul weights; the norms add no matmul FLOPs
    weights = 2 * (layers * per_layer + vocab * h)  # lm_head (tied to the embedding) is a matmul too
    assert weights == 2 * (4 * (16384 + 8192 + 8192 + 16384 + 147456) + 12672) == 1_598_208
    context = 10  # each token: q.k over 10 keys (2 x 10 x 128) and the weighted sum of 10 values (same)
    attention = layers * (2 * context * h + 2 * context * h)
    norms = 2 * layers * 2 * h  # shapes.flops_per_token also counts the 2 RMSNorm weights of a layer (+0.13%)
    assert rl.forward_flops_per_token(shape, 0) == pytest.approx(weights + norms)
    assert rl.forward_flops_per_token(shape, context) - rl.forward_flops_per_token(shape, 0) == attention


def test_gemm_throughput_is_measured_once_and_reused(tmp_path):
    calls = []

    def measure(dtype, threads):
        calls.append((dtype, threads))
        return 1e9 * (len(calls))

    first = rl.peak_flops(tmp_path, "float32", 1, measure=measure)
    again = rl.peak_flops(tmp_path, "float32", 1, measure=measure)
    assert calls == [("float32", 1)] and not first.cached and again.cached
    assert again.flops_per_s == first.flops_per_s == 1e9
    other = rl.peak_flops(tmp_path, "float32", 2, measure=measure)  # another thread count: its own entry
    assert calls[-1] == ("float32", 2) and not other.cached and other.key != first.key
    stored = json.loads((tmp_path / rl.CACHE_FILE).read_text())
    assert set(stored) == {first.key, other.key} and "threads 1" in first.key and "torch" in first.key


def test_real_gemm_measurement_is_positive(tmp_path):
    assert rl.measure_gemm("float32", 1, size=64, seconds=0.02) > 1e6


def _traj(prompt_id: str, n_prompt: int, n_resp: int) -> Trajectory:
    return Trajectory.create(id=f"{prompt_id}/{n_resp}", prompt_id=prompt_id, group_index=0, dataset_version="d",
                             policy_version=0, tokenizer_hash="t", prompt_tokens=(1,) * n_prompt,
                             response_tokens=(2,) * n_resp, response_text="", action_mask=(1,) * n_resp,
                             behavior_logprobs=(0.0,) * n_resp, sampling_config=SamplingConfig(max_tokens=8),
                             terminal_reason=TerminalReason.EOS, rollout_started_at=0.0)


def test_rollout_padding_waste_is_rows_times_longest_response():
    out = rollout_tokens([_traj("a", 5, 2), _traj("a", 5, 4), _traj("b", 3, 4), _traj("b", 3, 2)])
    assert out["rollout_real_tokens"] == 12 and out["rollout_computed_tokens"] == 16
    assert out["rollout_padding_waste"] == pytest.approx(0.25)
    assert out["rollout_prefill_tokens"] == 8 and out["rollout_prompt_tokens"] == 16  # each prompt prefilled once
    assert rollout_tokens([_traj("a", 5, 3)] * 2)["rollout_padding_waste"] == 0.0
    assert rollout_tokens([])["rollout_padding_waste"] == 0.0


def test_roofline_rows_share_of_peak():
    shape = builtin_shape(load_config("configs/quickstart.yaml", []).model, 99)
    step = {"rollout_sequences": 4.0, "rollout_prompt_tokens": 16.0, "rollout_real_tokens": 12.0,
            "rollout_computed_tokens": 16.0, "rollout_prefill_tokens": 8.0, "rollout_padding_waste": 0.25,
            "learner_real_tokens": 28.0, "learner_computed_tokens": 40.0, "learner_flop_tokens": 84.0,
            "learner_padding_waste": 0.3, "T_r": 0.5, "T_l": 1.0}
    fpt = rl.forward_flops_per_token(shape, (16 + 12) / 4 / 2)
    rollout, learner = rl.roofline_rows(shape, [step, step], peak=1e9)
    assert rollout.useful_flops == pytest.approx(2 * fpt * 20) and rollout.roofline_frac == pytest.approx(
        2 * fpt * 20 / 1.0 / 1e9)
    assert learner.useful_flops == pytest.approx(2 * fpt * 84) and learner.padding_waste == pytest.approx(0.3)
    assert rollout.padding_waste == pytest.approx(0.25)
    assert rl.roofline_rows(shape, [{"T_r": 1.0}], peak=1e9) == []
