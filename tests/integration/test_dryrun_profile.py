"""``rlctl dryrun`` and ``rlctl profile`` as a user runs them: JSON output, measured ledger error, stage coverage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import rlctl


@pytest.fixture()
def home(tmp_path: Path, _rlctl_home: Path) -> Path:
    cache = _rlctl_home / "cache"
    cache.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").symlink_to(cache, target_is_directory=True)
    return tmp_path


def test_dryrun_quickstart_ledger_matches_measured_peak_within_25_percent(home):
    out = json.loads(rlctl("dryrun", "configs/quickstart.yaml", "--json", home=home, check=True).stdout)
    assert all(c["ok"] for c in out["checks"])
    assert out["fits"] == {"colocate": True}
    smoke = out["smoke"]
    assert smoke["steps"] == 2 and smoke["within_tolerance"]
    assert abs(smoke["peak"]["error"]) <= 0.25, smoke["peak"]
    for phase in smoke["phases"]:
        assert abs(phase["error"]) <= 0.25, phase
    for term, pair in smoke["persistent"].items():  # parameters, grads, Adam states: exact
        assert pair["ledger_bytes"] == pair["measured_bytes"], term


@pytest.mark.parametrize("world", [1, 2])
def test_dryrun_smoke_meters_the_fsdp2_learner(home, world):
    """FSDP2's parameters are DTensors (wrappers without a storage of their own): the CPU meter counts their local
    shards, so the smoke step runs, persistent terms match exactly and the peak is within the tolerance. On 2
    ranks the meter sees rank 0, and the ledger it is held against is one device of 2 (its half of the sharded
    terms). This is the CPU half of tests/gpu/run.sh's ledger check (bench/fsdp_ledger.py, on CUDA)."""
    out = json.loads(rlctl("dryrun", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.learner=fsdp2",
                           f"train.learner_options.world_size={world}", "--json", home=home, check=True).stdout)
    smoke = out["smoke"]
    assert smoke["within_tolerance"] and abs(smoke["peak"]["error"]) <= 0.25, smoke["peak"]
    assert {p["phase"] for p in smoke["phases"]} == {"rollout", "train", "sync"}
    for term, pair in smoke["persistent"].items():
        if world == 1:
            assert pair["ledger_bytes"] == pair["measured_bytes"] > 0, term
        else:  # dim-0 shards are split unevenly (rank 0 holds the larger chunk of an odd row count)
            assert abs(pair["ledger_bytes"] - pair["measured_bytes"]) <= 0.01 * pair["measured_bytes"], (term, pair)


def test_dryrun_tiny_table_output(home):
    proc = rlctl("dryrun", "configs/quickstart.yaml", *TINY_OVERRIDES, home=home, check=True)
    for needle in ("checks", "KV cache", "activations", "FITS", "ledger vs measured peak", "within the stated"):
        assert needle in proc.stdout, needle


def test_dryrun_predicts_staleness_for_async_configs(home):
    out = json.loads(rlctl("dryrun", "configs/quickstart.yaml", *TINY_OVERRIDES, "mode=async",
                           "staleness.max_staleness=2", "--json", home=home, check=True).stdout)
    pred, inputs = out["staleness"]["prediction"], out["staleness"]["inputs"]
    assert inputs["mode"] == "async" and inputs["capacity"] == 3 * 4 and inputs["workers"] == 1  # the quickstart: one
    assert 0 <= pred["staleness_mean"] <= pred["staleness_p95"] <= 2
    assert 0 <= pred["learner_wait_share"] <= 1 and 0 <= pred["rollout_wait_share"] <= 1
    assert inputs["learn_s"] > 0 and inputs["token_s"] > 0


def test_dryrun_7b_shape_on_8x80_per_placement(home):
    recipe = ["rollout.max_tokens=1024", "algo.micro_batch_size=1", "train.learner_options.gradient_checkpointing=true",
              "--prompt-tokens", "512", "--shape", "7b", "--gpus", "8", "--gpu-mem", "80GiB", "--zero-stage", "3",
              "--placement", "colocate,split:4+4", "--no-smoke"]
    out = json.loads(rlctl("dryrun", "configs/quickstart.yaml", *recipe, "--json", home=home, check=True).stdout)
    assert out["num_params"] > 7e9 and out["smoke"] is None
    assert out["fits"] == {"colocate": True, "split:4+4": True}
    unsharded = [a if a != "3" else "0" for a in recipe]
    out0 = json.loads(rlctl("dryrun", "configs/quickstart.yaml", *unsharded, "--json", home=home, check=True).stdout)
    assert out0["fits"] == {"colocate": False, "split:4+4": False}
    assert [d["device"] for d in out["placements"]["split:4+4"]] == ["rollout", "learner"]
    terms = {t["name"] for t in out["placements"]["colocate"][0]["terms"]}
    assert {"parameters", "optimizer states", "KV cache", "activations", "communication buffers"} <= terms


def test_dryrun_72b_unsharded_does_not_fit_and_names_the_fix(home):
    proc = rlctl("dryrun", "configs/quickstart.yaml", "--shape", "72b", "--gpus", "8", "--gpu-mem", "80GiB",
                 "--zero-stage", "0", "--no-smoke", home=home, check=True)
    assert "DOES NOT FIT" in proc.stdout
    assert "ZeRO-3" in proc.stdout and "change:" in proc.stdout


def test_dryrun_plan_is_labelled_estimate(home):
    out = json.loads(rlctl("dryrun", "--plan", "--json", home=home, check=True).stdout)
    assert out["estimate"] is True
    modes = {(r["placement"], r["mode"]) for r in out["rows"]}
    assert modes == {("colocate", "sync"), ("split:4+4", "sync"), ("split:4+4", "one-step-off")}
    table = rlctl("dryrun", "--plan", home=home, check=True).stdout
    assert "ESTIMATES (not measured)" in table


def test_dryrun_bad_plugin_is_one_line_error(home):
    proc = rlctl("dryrun", "configs/quickstart.yaml", "rollout.backend=nope", home=home)
    assert proc.returncode == 1 and "nope" in proc.stderr and "Traceback" not in proc.stderr


# The quickstart's own model and batch (a step takes about half a second here), with a short warm start and a
# small task so the test stays quick. On the tiny test model a step is ~50 ms and the ~9 ms of metric logging
# between steps (reported as "other") is a larger share than 5%.
PROFILE_OVERRIDES = ["model.warm_start.steps=30", "task.options.num_train=400", "task.options.num_dev=40",
                     "task.options.num_hidden=40", "train.steps=3"]


def test_profile_config_then_run(home, tmp_path):
    chart = tmp_path / "chart.png"
    proc = rlctl("profile", "configs/quickstart.yaml", *PROFILE_OVERRIDES, "--compare", "colocate,split", "--out",
                 str(chart), "--json", home=home, check=True)
    out = json.loads(proc.stdout)
    assert len(out["steps"]) == 3
    # Stage times add up to (nearly all of) the measured wall time; the slack is for a loaded machine, where
    # untimed gaps between stages stretch (quiet: 97-98.5%).
    assert 0.85 <= out["coverage"] <= 1.05, out["coverage"]
    assert chart.is_file() and chart.stat().st_size > 1000 and out["chart"] == str(chart)
    kinds = {(p["placement"], p["mode"], p["measured"]) for p in out["placements"]}
    assert kinds == {("colocate", "sync", True), ("split:1+1", "sync", False), ("split:1+1", "one-step-off", False)}
    assert set(out["rollout_latency_s"]) == {"p50_s", "p95_s", "p99_s"}
    assert out["tokens_per_s"]["generated (per T_r)"] > 0
    roof = {r["stage"]: r for r in out["roofline"]}
    assert set(roof) == {"rollout", "learner"}
    for r in roof.values():  # the roofline is torch's own GEMM on this machine: a stage cannot beat it by much
        assert 0 < r["roofline_frac"] <= 1.5 and 0 <= r["padding_waste"] < 1, r
        assert 0 < r["real_tokens"] <= r["computed_tokens"], r
    assert roof["learner"]["padding_waste"] > 0  # padded micro-batches: the batch's longest sequence sets the width
    assert any("roofline:" in n and "cached in" in n for n in out["notes"])

    again = json.loads(rlctl("profile", out["run_id"], "--json", home=home, check=True).stdout)
    assert again["stage_totals_s"] == pytest.approx(out["stage_totals_s"])
    assert again["wall_s"] == pytest.approx(out["wall_s"])
    assert again["roofline"][1]["padding_waste"] == pytest.approx(roof["learner"]["padding_waste"])
    assert any("roofline:" in n and "read from" in n for n in again["notes"])  # the GEMM measurement is reused
    table = rlctl("profile", out["run_id"], "--compare", "split:2+1", home=home, check=True).stdout
    assert "ESTIMATE" in table and "stages cover" in table
    assert "% roofline" in table and "padding waste" in table


def test_profile_packed_learner_wastes_less_than_padded(home):
    """Packed micro-batches (train.micro_batch_tokens) forward no padding: the learner's waste is 0."""
    padded, packed = (json.loads(rlctl("profile", "configs/quickstart.yaml", *TINY_OVERRIDES, *extra, "--json",
                                       home=home, check=True).stdout)
                      for extra in ([], ["train.micro_batch_tokens=256"]))
    waste = lambda out: {r["stage"]: r["padding_waste"] for r in out["roofline"]}["learner"]  # noqa: E731
    assert waste(packed) == 0.0 < waste(padded) < 1


def test_profile_unknown_run_is_one_line_error(home):
    proc = rlctl("profile", "no-such-run", home=home)
    assert proc.returncode == 1 and "no-such-run" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.gpu
def test_ledger_matches_cuda_allocator_on_gpu():
    """On a GPU the same check reads torch.cuda.max_memory_allocated (tests/gpu is the usual place)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from rlctl.config.models import ModelConfig
    from rlctl.models.load import build_tiny
    from rlctl.planning.memory import Strategy, Workload, activation_bytes
    from rlctl.planning.shapes import builtin_shape

    cfg = ModelConfig(hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, intermediate_size=768)
    model = build_tiny(cfg, 99, 0, 1, 2, seed=0).cuda().train()
    ids = torch.randint(4, 99, (64, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[:32, -8:] = 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    logits = model(input_ids=ids, attention_mask=mask).logits
    saved = torch.cuda.memory_allocated() - base - logits.numel() * logits.element_size()
    work = Workload(prompts_per_step=1, group_size=64, prompt_tokens=64, response_tokens=0, micro_batch_size=64,
                    rollout_rows=64)
    predicted = activation_bytes(builtin_shape(cfg, 99), work, Strategy())
    assert abs(predicted - saved) / saved <= 0.25, (predicted, saved)
