"""The dry-run ledger of a colocated local engine: its KV budget caps the rollout's rows, and offloaded engine
weights are counted only while it rolls out."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rlctl.config.load import load_config
from rlctl.contracts.errors import ConfigError
from rlctl.planning.dryrun import DryrunOptions, dryrun, role_memory, strategy, workload
from rlctl.planning.memory import GiB, Placement, Strategy, kv_cache_bytes, ledger
from rlctl.planning.shapes import PRESETS
from tests.conftest import TINY_OVERRIDES

SHAPE = PRESETS["0.5b"]


def _config(*options):
    return load_config(None, TINY_OVERRIDES + ["algo.prompts_per_step=64", "algo.group_size=8",
                                               "rollout.max_tokens=1024"] + [f"rollout.options.{o}" for o in options])


def roles_of(cfg, plugins):
    return role_memory(cfg, plugins, gpu_plan=True)


def test_the_budget_becomes_rows_from_the_shape_and_lengths(plugins):
    row = kv_cache_bytes(SHAPE, 1, 100 + 1024, 2)
    cfg = _config(f"kv_cache_budget={40 * row + 7}")
    roles = roles_of(cfg, plugins)
    assert roles.rollout.kv_budget_bytes == 40 * row + 7
    work = workload(cfg, 100, roles, shape=SHAPE, kv_elem_bytes=2)
    assert work.rollout_rows == 40
    assert workload(_config(), 100, roles_of(_config(), plugins), shape=SHAPE).rollout_rows == 512
    small = _config(f"kv_cache_budget={row - 1}")
    with pytest.raises(ConfigError, match="too small for one row of 1124 tokens"):
        workload(small, 100, roles_of(small, plugins), shape=SHAPE, kv_elem_bytes=2)


def test_a_fraction_is_of_the_planned_device_and_ignored_without_one(plugins):
    cfg = _config("kv_cache_budget=0.3")
    roles = roles_of(cfg, plugins)
    rows = 0.3 * 80 * GiB // kv_cache_bytes(SHAPE, 1, 1124, 2)
    assert workload(cfg, 100, roles, shape=SHAPE, kv_elem_bytes=2, device_memory_bytes=80 * GiB).rollout_rows == \
        min(512, rows)
    assert workload(cfg, 100, roles, shape=SHAPE, kv_elem_bytes=2,
                    device_memory_bytes=8 * GiB).rollout_rows == 0.3 * 8 * GiB // kv_cache_bytes(SHAPE, 1, 1124, 2)
    assert workload(cfg, 100, roles, shape=SHAPE).rollout_rows == 512  # CPU plan: not applied (noted)


def test_offloaded_engine_weights_leave_the_train_phase_of_a_colocated_gpu(plugins):
    cfg = _config("offload_weights=true", "kv_cache_budget=2GiB")
    roles = roles_of(cfg, plugins)
    on_gpu, on_cpu = strategy(DryrunOptions(), roles, gpu=True), strategy(DryrunOptions(), roles, gpu=False)
    assert on_gpu.rollout_offload and not on_cpu.rollout_offload  # offload is a no-op on CPU
    work = workload(cfg, 100, roles, shape=SHAPE, kv_elem_bytes=on_gpu.rollout_bytes, device_memory_bytes=80 * GiB)
    place = Placement("colocate", 1, 1, 1)
    kept, offloaded = (ledger(SHAPE, work, s, place, 80 * GiB)[0] for s in (replace(on_gpu, rollout_offload=False),
                                                                           on_gpu))
    weights = next(t for t in offloaded.terms if t.role == "rollout" and t.name == "weights")
    assert weights.phase == "rollout" and "offloaded" in weights.formula
    assert kept.phase_bytes("train") - offloaded.phase_bytes("train") == weights.bytes
    assert kept.phase_bytes("rollout") == offloaded.phase_bytes("rollout")
    kv = next(t for t in offloaded.terms if t.name == "KV cache")
    assert kv.bytes == kv_cache_bytes(SHAPE, work.rollout_rows, work.seq_tokens, 2) <= 2 * GiB


def test_plain_strategy_keeps_engine_weights_persistent():
    dev = ledger(SHAPE, replace(_work(), rollout_rows=8), Strategy(gpu=True), Placement("colocate", 1, 1, 1),
                 80 * GiB)[0]
    assert next(t for t in dev.terms if t.name == "weights").phase == "persistent"


def _work():
    from rlctl.planning.memory import Workload

    return Workload(prompts_per_step=4, group_size=2, prompt_tokens=10, response_tokens=10, micro_batch_size=1,
                    rollout_rows=8)


def test_the_dry_run_reports_the_budget_rows_and_the_offload(plugins, _rlctl_home):
    cfg = load_config(None, TINY_OVERRIDES + ["rollout.options.kv_cache_budget=0.3",
                                              "rollout.options.offload_weights=true"])
    report = dryrun(cfg, plugins, _rlctl_home, DryrunOptions(device_memory_bytes=1 << 15, smoke=False))
    per_row = kv_cache_bytes(report.shape, 1, report.workload.seq_tokens, report.strategy.rollout_bytes)
    assert 1 <= report.workload.rollout_rows == int(0.3 * (1 << 15)) // per_row < 16  # the budget binds
    assert any(f"{report.workload.rollout_rows} rows per forward" in n for n in report.notes)
    assert any("rollout phase only" in n for n in report.notes)
    cpu = dryrun(cfg, plugins, _rlctl_home, DryrunOptions(smoke=False))
    assert cpu.workload.rollout_rows == 16 and any("not applied without --gpu-mem" in n for n in cpu.notes)
