"""The checkpoint store: commit protocol, verification, fallback, retention, crash points, state codec.

Fast and in-process: states are small fake tensors, and crashes are real
SIGKILLs of a forked child (rlctl.engine.faults), so the parent sees exactly
what a restarted process would see on disk.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from rlctl.contracts.errors import CheckpointError
from rlctl.contracts.types import SamplingConfig
from rlctl.contracts.checkpoints import CheckpointFile, CheckpointManifest, CheckpointState, LearnerState, ShadowBatch
from rlctl.engine import checkpoint as ckpt
from rlctl.engine import state_codec
from rlctl.engine.checkpoint import COMMITTED, DiskCheckpointStore, load_checkpoint, read_manifest, verify
from rlctl.engine.snapshot import capture_rng, compatibility_problems, restore_rng


@pytest.fixture()
def tok_dir(tmp_path: Path) -> Path:
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_text('{"version": "1.0"}')
    (d / "tokenizer_config.json").write_text("{}")
    return d


def make_state(step: int, tok_dir: Path, metrics: dict[str, float] | None = None) -> CheckpointState:
    g = torch.Generator().manual_seed(step)
    weights = {"model.embed_tokens.weight": torch.randn(8, 4, generator=g), "model.norm.weight": torch.ones(4)}
    optimizer = {
        "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.randn(8, 4, generator=g)},
                  1: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(4)}},
        "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.99), "params": [0, 1], "foreach": None, "eps": 1e-8}],
    }
    learner = LearnerState(
        policy_version=step, weights=weights, model_files={"config.json": '{"model_type": "llama"}'},
        optimizer=optimizer, scheduler={"last_epoch": step, "base_lrs": [1e-3], "_last_lr": [1e-3]},
        rng={"minibatch_order": torch.Generator().manual_seed(step).get_state()}, counters={"nan_skips": 1},
    )
    shadow = ShadowBatch(input_ids=torch.arange(6).view(2, 3), attention_mask=torch.ones(2, 3, dtype=torch.long),
                         action_mask=torch.tensor([[0.0, 1.0, 1.0], [0.0, 0.0, 1.0]]),
                         logprobs=torch.randn(2, 3, generator=g), sampling=SamplingConfig(max_tokens=4, stop=("x",)))
    return CheckpointState(
        step=step, learner=learner, rollout={"generator": torch.Generator().manual_seed(7).get_state(), "calls": step},
        cursor={"epoch": 1, "position": step}, rng=capture_rng(), shadow=shadow, run_id="run-1",
        config={"train": {"steps": 10}, "algo": {"group_size": 4}}, config_hash="cfg", code_version="test",
        dataset_version="data-1", tokenizer_hash="tok-1", tokenizer_dir=str(tok_dir),
        metrics=metrics if metrics is not None else {"reward_mean": float(step)},
    )


def committed_steps(store: DiskCheckpointStore) -> list[int]:
    return [m.step for _, m in store.list_committed()]


def step_dirs(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) if root.exists() else []


# -- commit protocol and round trip -------------------------------------------------


@pytest.mark.parametrize("async_save", [True, False])
def test_save_commits_every_file_with_checksums_and_loads_back_exactly(tmp_path, tok_dir, async_save):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=async_save)
    state = make_state(4, tok_dir)
    path = Path(store.save(state))
    store.wait()
    assert path.name == "step-000004" and (path / COMMITTED).is_file()
    assert not (path / "COMMITTED.tmp").exists()
    manifest = verify(path)
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != COMMITTED)
    assert sorted(f.path for f in manifest.files) == on_disk
    assert {"model/model.safetensors", "model/config.json", "model/tokenizer.json", "optimizer.safetensors",
            "state.safetensors", "state.json", "shadow.safetensors"} <= set(on_disk)
    assert (manifest.step, manifest.policy_version, manifest.dataset_version) == (4, 4, "data-1")

    back = load_checkpoint(path)
    assert back.step == 4 and back.cursor == {"epoch": 1, "position": 4}
    for k, v in state.learner.weights.items():
        assert torch.equal(back.learner.weights[k], v)
    opt = back.learner.optimizer
    assert set(opt["state"]) == {0, 1}, "int keys of an optimizer state survive"
    assert torch.equal(opt["state"][0]["exp_avg"], state.learner.optimizer["state"][0]["exp_avg"])
    assert opt["param_groups"][0]["betas"] == (0.9, 0.99) and opt["param_groups"][0]["foreach"] is None
    assert back.learner.scheduler == state.learner.scheduler and back.learner.counters == {"nan_skips": 1}
    assert torch.equal(back.learner.rng["minibatch_order"], state.learner.rng["minibatch_order"])
    assert back.rollout["calls"] == 4 and torch.equal(back.rollout["generator"], state.rollout["generator"])
    assert back.shadow.sampling == state.shadow.sampling
    assert torch.equal(back.shadow.logprobs, state.shadow.logprobs)
    assert back.config == state.config and back.metrics == {"reward_mean": 4.0}
    assert (Path(back.tokenizer_dir) / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_loading_never_unpickles(tmp_path, tok_dir, monkeypatch):
    import pickle

    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    path = Path(store.save(make_state(2, tok_dir)))
    assert not [p for p in path.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".pkl")]

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load must not unpickle")

    for target, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(target, name, refuse)
    assert load_checkpoint(path).step == 2


def test_model_directory_is_loadable_safetensors_with_format_metadata(tmp_path, tok_dir):
    from safetensors import safe_open

    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    path = Path(store.save(make_state(2, tok_dir)))
    with safe_open(path / "model" / "model.safetensors", "pt") as fh:
        assert fh.metadata() == {"format": "pt"}
        assert set(fh.keys()) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_rng_states_round_trip_through_a_checkpoint(tmp_path, tok_dir):
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    path = store.save(make_state(2, tok_dir))
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    for _ in range(3):
        random.random(), np.random.rand(), torch.rand(1)
    restore_rng(load_checkpoint(path).rng)
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == expected


def test_state_codec_round_trip_and_refuses_arbitrary_objects():
    tree = {"a": (1, 2.5, None, "s"), 3: [torch.ones(2)], "nan": math.inf, "arr": np.arange(3, dtype=np.uint32),
            "py": random.Random(3).getstate()}
    tensors: dict = {}
    data = json.loads(json.dumps(state_codec.encode(tree, "t", tensors)))
    back = state_codec.decode(data, tensors)
    assert back["a"] == (1, 2.5, None, "s") and torch.equal(back[3][0], torch.ones(2)) and back["nan"] == math.inf
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [0, 1, 2]
    assert back["py"] == tree["py"]
    with pytest.raises(TypeError, match="'t/obj'"):
        state_codec.encode({"obj": object()}, "t", {})


def test_clone_makes_private_copies():
    live = {"state": {0: {"m": torch.zeros(2)}}, "groups": [{"betas": (0.9, 0.99)}]}
    copy = state_codec.clone(live)
    live["state"][0]["m"].add_(1)
    live["groups"][0]["lr"] = 5
    assert torch.equal(copy["state"][0]["m"], torch.zeros(2)) and "lr" not in copy["groups"][0]


def test_manifest_detects_every_single_byte_flip(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    text = (Path(store.save(make_state(2, tok_dir))) / COMMITTED).read_text()
    CheckpointManifest.from_json(text)
    raw = bytearray(text.encode())
    for i in range(len(raw)):
        flipped = bytearray(raw)
        flipped[i] ^= 0x01
        with pytest.raises(ValueError):
            CheckpointManifest.from_json(flipped.decode("latin-1"))


def test_manifest_paths_must_stay_inside_the_checkpoint(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    path = Path(store.save(make_state(2, tok_dir)))
    m = read_manifest(path)
    evil = CheckpointManifest(**{**{f: getattr(m, f) for f in m.__dataclass_fields__},
                                 "files": m.files + (CheckpointFile(path="../x", sha256="0", num_bytes=1),)})
    (path / COMMITTED).write_text(evil.to_json())
    with pytest.raises(CheckpointError, match="leaves the checkpoint directory"):
        read_manifest(path)


def test_committed_checkpoints_are_immutable(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    store.save(make_state(2, tok_dir))
    with pytest.raises(CheckpointError, match="already committed"):
        store.save(make_state(2, tok_dir))


# -- what readers see -------------------------------------------------------------------


def test_directory_without_manifest_does_not_exist_and_is_cleaned_up(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    store.save(make_state(2, tok_dir))
    partial = Path(store.save(make_state(4, tok_dir)))
    (partial / COMMITTED).rename(partial / "COMMITTED.tmp")  # as if killed before the rename
    assert committed_steps(store) == [2]
    path, state, warnings = store.load_latest()
    assert state.step == 2 and warnings == []
    assert store.cleanup_partial() == ["step-000004"]
    assert step_dirs(store.root) == ["step-000002"]
    store.save(make_state(4, tok_dir))  # the step can be saved again
    assert committed_steps(store) == [2, 4]


def _corrupt(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    else:
        data = data[: len(data) // 2]
    path.write_bytes(bytes(data))


def _files_of_newest(tmp_path: Path, tok_dir: Path) -> list[str]:
    store = DiskCheckpointStore(tmp_path / "probe", async_save=False)
    path = Path(store.save(make_state(2, tok_dir)))
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_corrupting_any_file_falls_back_to_the_previous_checkpoint_naming_the_file(tmp_path, tok_dir, how):
    for name in _files_of_newest(tmp_path, tok_dir):
        store = DiskCheckpointStore(tmp_path / f"ck-{how}-{name.replace('/', '_')}", async_save=False)
        store.save(make_state(2, tok_dir))
        newest = Path(store.save(make_state(4, tok_dir)))
        _corrupt(newest / name, how)
        path, state, warnings = store.load_latest()
        assert state.step == 2, name
        assert len(warnings) == 1 and "step-000004" in warnings[0] and name in warnings[0], (name, warnings)
        assert committed_steps(store) == [2], "the bad checkpoint is moved out of the way"
        assert (store.root / "corrupt").is_dir()


def test_missing_file_is_refused(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    store.save(make_state(2, tok_dir))
    newest = Path(store.save(make_state(4, tok_dir)))
    (newest / "optimizer.safetensors").unlink()
    _, state, warnings = store.load_latest()
    assert state.step == 2 and "optimizer.safetensors: missing" in warnings[0]


def test_checkpoints_exist_but_none_verifies_is_a_hard_error(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", async_save=False)
    for step in (2, 4):
        _corrupt(Path(store.save(make_state(step, tok_dir))) / "state.json", "flip")
    with pytest.raises(CheckpointError, match="exist but none verifies") as err:
        store.load_latest()
    assert "step 0" in err.value.hint
    assert committed_steps(store) == [2, 4], "nothing is moved when there is nothing to fall back to"


def test_no_checkpoint_at_all_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        DiskCheckpointStore(tmp_path / "ck").load_latest()


# -- retention ------------------------------------------------------------------------------


def test_keep_last_one_never_leaves_zero_committed(tmp_path, tok_dir):
    deleted = []
    store = DiskCheckpointStore(tmp_path / "ck", keep_last=1, async_save=False,
                                on_delete=lambda path, m: deleted.append((m.step, (Path(path) / COMMITTED).exists())))
    for step in (2, 4, 6):
        store.save(make_state(step, tok_dir))
        assert committed_steps(store) == [step]
    assert deleted == [(2, False), (4, False)], "the manifest is gone before the registry row is removed"
    assert step_dirs(store.root) == ["step-000006"]


def test_keep_best_metric_keeps_the_best_and_the_last(tmp_path, tok_dir):
    store = DiskCheckpointStore(tmp_path / "ck", keep_last=2, keep_best_metric="reward_mean", async_save=False)
    for step, reward in ((2, 0.1), (4, 0.9), (6, 0.2), (8, float("nan")), (10, 0.3)):
        store.save(make_state(step, tok_dir, {"reward_mean": reward}))
    assert committed_steps(store) == [4, 8, 10]
    low = DiskCheckpointStore(tmp_path / "ck2", keep_last=1, keep_best_metric="reward_mean", keep_best_mode="min",
                              async_save=False)
    for step, reward in ((2, 0.5), (4, 0.1), (6, 0.7)):
        low.save(make_state(step, tok_dir, {"reward_mean": reward}))
    assert committed_steps(low) == [4, 6]


def test_keep_last_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        DiskCheckpointStore(tmp_path, keep_last=0)


# -- background saves -------------------------------------------------------------------------


def test_at_most_one_save_in_flight(tmp_path, tok_dir, monkeypatch):
    active, peak = [0], [0]
    real = ckpt.write_file

    def slow(root, rel, data):
        active[0] += 1
        peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        try:
            return real(root, rel, data)
        finally:
            active[0] -= 1

    monkeypatch.setattr(ckpt, "write_file", slow)
    store = DiskCheckpointStore(tmp_path / "ck", keep_last=5)
    store.save(make_state(2, tok_dir))
    assert store.in_flight
    store.save(make_state(4, tok_dir))  # waits for step 2 first
    assert committed_steps(store)[0] == 2
    store.close()
    assert committed_steps(store) == [2, 4] and peak[0] == 1


def test_close_abort_abandons_the_save_cleanly(tmp_path, tok_dir, monkeypatch):
    started, release = threading.Event(), threading.Event()
    real = ckpt.write_file

    def gated(root, rel, data):
        if rel == "optimizer.safetensors":
            started.set()
            release.wait(5)
        return real(root, rel, data)

    warnings: list[str] = []
    store = DiskCheckpointStore(tmp_path / "ck", keep_last=1, warn=warnings.append)
    store.save(make_state(2, tok_dir))
    store.wait()
    monkeypatch.setattr(ckpt, "write_file", gated)
    store.save(make_state(4, tok_dir))
    assert started.wait(5)
    threading.Timer(0.05, release.set).start()
    store.close(abort=True)
    assert committed_steps(store) == [2] and step_dirs(store.root) == ["step-000002"]
    assert "abandoned" in warnings[0]


def test_disk_full_fails_loudly_and_keeps_the_previous_checkpoint(tmp_path, tok_dir, monkeypatch):
    store = DiskCheckpointStore(tmp_path / "ck", keep_last=1)
    store.save(make_state(2, tok_dir))
    store.wait()
    real = ckpt.write_file

    def full(root, rel, data):
        if rel == "state.json":
            raise OSError(28, "No space left on device")
        return real(root, rel, data)

    monkeypatch.setattr(ckpt, "write_file", full)
    store.save(make_state(4, tok_dir))
    with pytest.raises(CheckpointError, match="step-000004 failed.*No space left") as err:
        store.wait()
    assert "previous committed checkpoint is intact" in err.value.hint
    assert committed_steps(store) == [2] and step_dirs(store.root) == ["step-000002"]
    store.wait()  # the error is reported once


# -- crashes at every write boundary (real SIGKILL of a forked child) ---------------------------------


def _run_child(fn, crash_at: str) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.environ["RLCTL_CRASH_AT"] = crash_at
            fn()
        except BaseException:  # noqa: BLE001
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


BOUNDARIES = (
    [f"ckpt.file_partial:{f}" for f in ("model/model.safetensors", "state.json", "shadow.safetensors")]
    + [f"ckpt.file_written:{f}" for f in ("model/model.safetensors", "model/config.json", "model/tokenizer.json",
                                          "optimizer.safetensors", "state.safetensors", "state.json",
                                          "shadow.safetensors")]
    + ["ckpt.manifest_tmp", "ckpt.renamed", "ckpt.dir_synced", "ckpt.registry_row",
       "ckpt.retention_unlinked:step-000002", "ckpt.retention_partial:step-000002"]
)
COMMITTED_BY = {"ckpt.renamed", "ckpt.dir_synced", "ckpt.registry_row", "ckpt.retention_unlinked:step-000002",
                "ckpt.retention_partial:step-000002"}


def test_sigkill_at_every_write_boundary_leaves_a_loadable_committed_checkpoint(tmp_path, tok_dir):
    from rlctl.lifecycle.resume import reconcile
    from rlctl.registry.store import Registry

    for i, boundary in enumerate(BOUNDARIES):
        url = f"sqlite:///{tmp_path / f'reg{i}.db'}"
        with Registry.open(url) as reg:
            run = reg.create_run(name="r", config={}, config_hash="h", code_version="c", dataset_version="d",
                                 tokenizer_hash="t", seed=0, run_dir=str(tmp_path))

        def store_for(registry):
            return DiskCheckpointStore(
                tmp_path / f"ck{i}", keep_last=1,
                on_commit=lambda p, m: registry.add_checkpoint(run.id, m.step, p, ckpt.manifest_sha256(m)),
                on_delete=lambda p, m: registry.delete_checkpoint(run.id, m.step))

        with Registry.open(url) as reg:
            first = store_for(reg)
            first.save(make_state(2, tok_dir))
            first.close()

        def child() -> None:
            with Registry.open(url) as child_reg:
                store = store_for(child_reg)
                store.save(make_state(4, tok_dir))
                store.close()

        assert _run_child(child, boundary) == -signal.SIGKILL, boundary
        with Registry.open(url) as reg:
            store = store_for(reg)
            newest = 4 if boundary in COMMITTED_BY else 2
            assert committed_steps(store)[-1] == newest, boundary
            store.cleanup_partial()
            assert all((p / COMMITTED).is_file() for p in store.root.glob("step-*")), boundary
            _, state, warnings = store.load_latest()
            assert state.step == newest and not warnings, boundary
            reconcile(reg, run.id, store)
            assert [c.step for c in reg.checkpoints(run.id)] == committed_steps(store), boundary
            if newest == 2:  # the restarted process saves the step again
                store.save(make_state(4, tok_dir))
                store.close()
                assert committed_steps(store) == [4], boundary


def test_crash_point_matches_point_detail_and_occurrence(tmp_path):
    from rlctl.engine.faults import crash_point

    marks = tmp_path / "marks"

    def child() -> None:
        for i in range(3):
            crash_point("p", "other")
            crash_point("p", "x")
            with marks.open("a") as fh:
                fh.write(f"{i}\n")

    assert _run_child(child, "p:x@2") == -signal.SIGKILL
    assert marks.read_text() == "0\n"
    marks.unlink()
    assert _run_child(child, "q") == 0 and marks.read_text() == "0\n1\n2\n"


# -- compatibility --------------------------------------------------------------------------------


def test_compatibility_names_what_changed(tok_dir):
    state = make_state(4, tok_dir)
    allowed = {"train": {"steps": 99}, "algo": {"group_size": 4}, "eval": {"num_prompts": 3}}
    assert compatibility_problems(state, config=allowed, dataset_version="data-1", tokenizer_hash="tok-1") == []
    changed = {"train": {"steps": 10}, "algo": {"group_size": 8}}
    problems = compatibility_problems(state, config=changed, dataset_version="data-2", tokenizer_hash="tok-2")
    assert len(problems) == 3
    assert "algo.group_size: 4 -> 8" in problems[0]
    assert "dataset changed" in problems[1] and "data-1" in problems[1] and "data-2" in problems[1]
    assert "tokenizer changed" in problems[2]


# -- the run's store: registry index and the on_checkpoint_saved hook -------------------------------


def test_run_store_indexes_after_commit_and_calls_on_checkpoint_saved(tmp_path, tok_dir):
    from rlctl import hookimpl
    from rlctl.config.load import load_config
    from rlctl.contracts.roles import CheckpointStore
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.train import checkpoint_store
    from rlctl.registry.store import Registry

    seen = []

    class Observer:
        @hookimpl
        def on_checkpoint_saved(self, run_id, step, path, manifest):
            seen.append((run_id, step, (Path(path) / COMMITTED).is_file(), manifest.step))

    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        run = reg.create_run(name="r", config={}, config_hash="h", code_version="c", dataset_version="d",
                             tokenizer_hash="t", seed=0, run_dir=str(tmp_path))
        config = load_config(None, ["checkpoint.keep_last=1"])
        store = checkpoint_store(tmp_path, config, reg, run.id, print, load_plugins(extra={"obs": Observer()}))
        assert isinstance(store, CheckpointStore)
        for step in (2, 4):
            store.save(make_state(step, tok_dir))
        store.close()
        assert seen == [(run.id, 2, True, 2), (run.id, 4, True, 4)]
        rows = reg.checkpoints(run.id)
        assert [(r.step, r.metrics) for r in rows] == [(4, {"reward_mean": 4.0})]
        assert rows[0].manifest_sha256 == ckpt.manifest_sha256(read_manifest(rows[0].path))


def test_a_new_run_refuses_a_run_dir_holding_another_runs_checkpoints(tmp_path, tok_dir):
    from rlctl.config.load import load_config
    from rlctl.lifecycle.train import train
    from rlctl.registry.store import Registry

    DiskCheckpointStore(tmp_path / "run" / "checkpoints", async_save=False).save(make_state(2, tok_dir))
    with Registry.open(f"sqlite:///{tmp_path / 'r.db'}") as reg:
        with pytest.raises(CheckpointError, match="already holds checkpoints of run run-1") as err:
            train(load_config(None), registry=reg, plugins=None, home=tmp_path, run_dir=tmp_path / "run")
        assert "rlctl resume run-1" in err.value.hint and reg.list_runs() == []
