"""The memory ledger: shapes, formulas, fits / advice, placement parsing, and the live-tensor meter."""

from __future__ import annotations

import json

import pytest

from rlctl.planning.memory import (
    GiB,
    Placement,
    Strategy,
    Workload,
    activation_bytes,
    kv_cache_bytes,
    ledger,
    parse_bytes,
)
from rlctl.planning.shapes import PRESETS, ModelShape, from_hf_config, resolve_shape

GPU = Strategy(param_bytes=2, master_weights=True, optim_state_bytes=8, zero_stage=3, checkpointing=True,
               rollout_bytes=2, engine="serving", gpu=True)
RECIPE = Workload(prompts_per_step=64, group_size=8, prompt_tokens=512, response_tokens=1024, micro_batch_size=1,
                  rollout_rows=512)


@pytest.mark.parametrize("name, billions", [("0.5b", 0.494), ("1.5b", 1.544), ("7b", 7.616), ("32b", 32.76),
                                            ("72b", 72.71)])
def test_presets_have_the_published_parameter_counts(name, billions):
    assert PRESETS[name].num_params / 1e9 == pytest.approx(billions, rel=2e-3)


def test_shape_from_config_json_matches_the_built_model(tmp_path):
    from rlctl.config.models import ModelConfig
    from rlctl.models.load import build_tiny

    model = build_tiny(ModelConfig(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, intermediate_size=96),
                       99, 0, 1, 2, seed=0)
    model.config.to_json_file(tmp_path / "config.json")
    shape = resolve_shape(str(tmp_path))
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (3, 2, 16)


def test_unknown_shape_names_presets(tmp_path):
    from rlctl.contracts.errors import ConfigError, ModelError

    with pytest.raises(ConfigError, match="unknown model shape"):
        resolve_shape("13b")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ModelError, match="lacks"):
        resolve_shape(str(tmp_path / "config.json"))
    assert from_hf_config({"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2,
                           "intermediate_size": 128, "vocab_size": 10}, "x", "s").num_kv_heads == 4


def test_kv_cache_formula_is_2_B_L_Hkv_d_T_bytes():
    s = PRESETS["7b"]
    assert kv_cache_bytes(s, 8, 1536, 2) == 2 * 8 * 28 * 4 * 128 * 1536 * 2


def test_checkpointing_shrinks_activations_by_about_the_layer_count():
    s = PRESETS["7b"]
    full = activation_bytes(s, RECIPE, GPU.__class__(**{**_fields(GPU), "checkpointing": False}))
    ckpt = activation_bytes(s, RECIPE, GPU)
    assert 5 < full / ckpt < s.num_layers


def _fields(obj):
    return {k: getattr(obj, k) for k in obj.__slots__}


def test_activation_formula_matches_measured_saved_tensors():
    """The per-layer coefficient is checked against what HF Llama really keeps for backward (tiny, CPU)."""
    import torch

    from rlctl.config.models import ModelConfig
    from rlctl.models.load import build_tiny
    from rlctl.planning.meter import DispatchMeter as _DispatchMeter, live_mode as _live_mode
    from rlctl.planning.shapes import builtin_shape

    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    model = build_tiny(cfg, 99, 0, 1, 2, seed=0).train()
    n, t = 16, 12
    ids = torch.randint(4, 99, (n, t))
    mask = torch.ones_like(ids)
    mask[: n // 2, -3:] = 0  # right padding, as the learner's batches have
    meter = _DispatchMeter(roles=None)
    mode = _live_mode(meter)
    with mode:
        logits = model(input_ids=ids, attention_mask=mask).logits
        saved = meter.live - logits.untyped_storage().nbytes()
    work = Workload(prompts_per_step=1, group_size=n, prompt_tokens=t, response_tokens=0, micro_batch_size=n,
                    rollout_rows=n)
    predicted = activation_bytes(builtin_shape(cfg, 99), work, Strategy())
    assert abs(predicted - saved) / saved < 0.05, (predicted, saved)


def test_meter_counts_allocations_and_frees():
    import torch

    from rlctl.planning.meter import DispatchMeter as _DispatchMeter, live_mode as _live_mode

    meter = _DispatchMeter(roles=None)
    with _live_mode(meter):
        a = torch.zeros(1000)  # 4000 bytes
        b = a.view(10, 100)  # a view allocates nothing
        a.add_(1)  # in place allocates nothing
        c = a * 2
        assert meter.live == 8000
        del a, b, c
    assert meter.live == 0 and meter.peak == 8000


def test_7b_recipe_fits_on_8x80_colocated_and_split():
    for text in ("colocate", "split:4+4"):
        devices = ledger(PRESETS["7b"], RECIPE, GPU, Placement.parse(text, 8), 80 * GiB)
        assert all(d.fits for d in devices), [(d.device, d.required_bytes / GiB) for d in devices]
        for d in devices:
            assert d.required_bytes == d.peak_bytes + d.headroom_bytes
            assert d.largest.bytes == max(t.bytes for t in d.terms if t.phase in ("persistent", d.peak_phase))


def test_72b_without_sharding_does_not_fit_and_advice_names_the_fix():
    plain = Strategy(param_bytes=2, master_weights=True, rollout_bytes=2, engine="serving", gpu=True)
    (dev,) = ledger(PRESETS["72b"], RECIPE, plain, Placement.parse("colocate", 8), 80 * GiB)
    assert not dev.fits
    assert dev.largest.name == "optimizer states"
    assert any("ZeRO-3" in tip and "(fits)" in tip for tip in dev.advice), dev.advice


def test_terms_cover_every_role_and_phase():
    (dev,) = ledger(PRESETS["1.5b"], RECIPE, GPU, Placement.parse("colocate", 8), 80 * GiB)
    roles = {t.role for t in dev.terms}
    assert {"policy", "rollout", "critic", "reward", "runtime"} <= roles
    names = {t.name for t in dev.terms}
    assert {"parameters", "gradients", "optimizer states", "master weights", "activations", "KV cache",
            "communication buffers", "CUDA graphs"} <= names


def test_zero3_divides_states_by_the_learner_world():
    shape = PRESETS["7b"]
    one = {t.name: t.bytes for t in ledger(shape, RECIPE, GPU, Placement.parse("split:4+4", 8), 80 * GiB)[1].terms}
    assert one["parameters"] == -(-shape.num_params * 2 // 4)
    assert one["optimizer states"] == -(-shape.num_params * 8 // 4)


@pytest.mark.parametrize("text, expected", [("colocate", (8, 8)), ("split:4+4", (4, 4)), ("split:2+6", (2, 6)),
                                            ("split", (4, 4))])
def test_placement_parse(text, expected):
    p = Placement.parse(text, 8)
    assert (p.rollout_devices, p.learner_devices) == expected


def test_placement_parse_rejects_garbage():
    with pytest.raises(ValueError, match="split:R\\+L"):
        Placement.parse("split:4", 8)
    with pytest.raises(ValueError):
        Placement.parse("ring", 8)


@pytest.mark.parametrize("text, value", [("80GiB", 80 * GiB), ("80G", 80 * GiB), ("512MiB", 512 << 20),
                                         ("1.5TB", 1_500_000_000_000), ("1024", 1024)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == value


def test_plan_is_labelled_estimate_and_split_overlaps():
    from rlctl.planning.plan import plan

    rows = plan()
    assert {r.placement for r in rows} == {"colocate", "split:4+4"}
    for r in rows:
        assert r.fits
        assert r.t_r > 0 and r.t_l > 0 and abs(sum(r.shares.values()) - 1) < 1e-9
    sync = next(r for r in rows if r.mode == "sync" and r.placement != "colocate" and r.prompts_per_step == 32)
    off = next(r for r in rows if r.mode == "one-step-off" and r.prompts_per_step == 32)
    assert off.step_s < sync.step_s


def test_shape_docstring_example():
    shape = ModelShape(name="t", num_layers=2, hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1,
                       head_dim=16, vocab_size=99, tie_embeddings=True)
    assert shape.num_params == 21760


def test_critic_terms_hold_a_backbone_sized_model_with_its_own_optimizer():
    from dataclasses import replace

    shape = PRESETS["7b"]
    place = Placement.parse("colocate", 8)
    without = ledger(shape, RECIPE, GPU, place, 80 * GiB)[0]
    with_critic = ledger(shape, replace(RECIPE, critic=True), GPU, place, 80 * GiB)[0]
    critic = {t.name: t.bytes for t in with_critic.terms if t.role == "critic"}
    assert [t.name for t in without.terms if t.role == "critic"] == ["none (GRPO)"]
    lm_head = 0 if shape.tie_embeddings else shape.vocab_size * shape.hidden_size
    backbone = shape.num_params - lm_head + shape.hidden_size + 1
    assert critic["parameters"] == -(-backbone * 2 // 8)  # bf16, ZeRO-3 over 8 devices
    assert critic["optimizer states"] == -(-backbone * 8 // 8)
    assert critic["activations"] > 0
    assert with_critic.peak_bytes - without.peak_bytes >= sum(critic.values()) - critic["activations"]
