"""The shipped recipes load, and the 7B GRPO recipe passes `rlctl dryrun` (without a smoke step) against a
7B-shaped model directory (config.json of the 7B shape, an empty weight file: the dry run reads no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlctl.config.load import load_config
from tests.conftest import TINY_OVERRIDES
from tests.integration.test_cli import REPO, rlctl

SEVEN_B = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 3584,
           "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
           "vocab_size": 152064, "tie_word_embeddings": False, "max_position_embeddings": 32768}


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_recipe_validates(path: Path, plugins):
    from rlctl.placement.build import build_estimator

    config = load_config(path)
    build_estimator(config, plugins)  # the estimator's own checks too (options, group size, clip keys it ignores)


def test_7b_recipe_passes_the_dry_run(tmp_path, _rlctl_home):
    from rlctl.models.tokenizer import build_char_tokenizer

    model = tmp_path / "qwen-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(SEVEN_B))
    (model / "model.safetensors").write_bytes(b"")
    build_char_tokenizer().save_pretrained(model)
    for k, split in enumerate(("train", "dev", "hidden")):
        rows = [json.dumps({"prompt": f"What is {i} + {k}?", "answer": str(i + k)}) for i in range(8)]
        (tmp_path / f"{split}.jsonl").write_text("\n".join(rows) + "\n")
    proc = rlctl("dryrun", "configs/grpo-7b-8gpu.yaml", f"model.path={model}",
                 *(f"task.options.{s}={tmp_path / f'{s}.jsonl'}" for s in ("train", "dev", "hidden")),
                 "--gpus", "8", "--gpu-mem", "80GiB", "--placement", "split:4+4,colocate", "--zero-stage", "3", "--no-smoke",
                 "--json", home=tmp_path, check=True)
    report = json.loads(proc.stdout)
    assert all(c["ok"] for c in report["checks"]), report["checks"]
    assert report["shape"]["num_layers"] == 28
    # the recipe names the sharded learner the ledger assumes: fsdp2 on all 8 GPUs, bf16 + fp32 master, ZeRO-3
    # (full shard) with activation checkpointing, and that learner can run here (no "cannot run" note)
    config = load_config(REPO / "configs" / "grpo-7b-8gpu.yaml")
    assert config.train.learner == "fsdp2"
    assert config.train.learner_options["world_size"] == 8
    assert "learner: 'fsdp2' (ZeRO-3 / FSDP full shard)" in report["notes"], report["notes"]
    assert not [n for n in report["notes"] if "cannot run" in n or "does not do" in n], report["notes"]
    assert report["strategy"] == "bf16 params + fp32 master, ZeRO-3, activation checkpointing"
    # world_size 8 fits colocate (8 learner GPUs); the split layout's 4 learner GPUs get a note naming the fix
    mismatch = [n for n in report["notes"] if "train.learner_options.world_size is 8" in n]
    assert len(mismatch) == 1 and mismatch[0].startswith("placement split:4+4 gives the learner 4 devices"), mismatch
    assert "train.learner_options.world_size=4" in mismatch[0]


def test_quickstart_recipes_share_its_warm_start():
    """Each quickstart-<algo>.yaml starts RL from the quickstart's cached warm start (same model section, so the
    same cache key): the algorithm table compares estimators from one policy, and no recipe rebuilds the SFT stage."""
    base = load_config(REPO / "configs" / "quickstart.yaml").model
    recipes = [p for p in sorted((REPO / "configs").glob("quickstart-*.yaml")) if "sloppy" not in p.name
               and "mixed" not in p.name  # quickstart-ppo-mixed: another task, its own warm start (own test)
               and "tools" not in p.name]  # quickstart-tools: multiplication with a calculator (own test)
    assert recipes
    for path in recipes:
        assert load_config(path).model == base, path.name


# the estimator recipes; quickstart-vllm.yaml (the same GRPO run on vLLM) is checked live in tests/integration/test_vllm.py
QUICKSTART_RECIPES = sorted(p for p in (REPO / "configs").glob("quickstart-*.yaml") if "sloppy" not in p.name
                            and p.name != "quickstart-vllm.yaml"
                            and "credit" not in p.name  # quickstart-ppo-credit: another reward (own test)
                            and "mixed" not in p.name  # quickstart-ppo-mixed: another task (own test)
                            and "tools" not in p.name)  # quickstart-tools: episodes with a calculator (own test)


def test_quickstart_recipes_are_the_quickstart_with_one_estimator():
    """configs/quickstart-<name>.yaml names estimator <name>, and everything the algorithm table holds fixed is the
    quickstart's: task, rollout, reward, eval, step count, batch shape (16 prompts x 8). Only the estimator's settings
    and the lr (swept on dev, docs/algorithms.md) may differ, so the recipes cannot drift from the quickstart again."""
    base = load_config(REPO / "configs" / "quickstart.yaml")
    names = {p.name.removeprefix("quickstart-").removesuffix(".yaml") for p in QUICKSTART_RECIPES}
    assert names == {"dapo", "dr_grpo", "gspo", "ppo", "reinforce_pp", "rloo"}
    for path in QUICKSTART_RECIPES:
        config = load_config(path)
        assert config.algo.name == path.name.removeprefix("quickstart-").removesuffix(".yaml"), path.name
        assert config.run.name == path.stem, path.name
        for section in ("task", "rollout", "reward", "eval", "checkpoint"):
            assert getattr(config, section) == getattr(base, section), (path.name, section)
        assert (config.train.steps, config.train.seeds) == (base.train.steps, base.train.seeds), path.name
        assert (config.algo.group_size, config.algo.prompts_per_step) == (base.algo.group_size,
                                                                         base.algo.prompts_per_step), path.name
        assert config.train.optim.lr in (1e-5, 2e-5, 4e-5), path.name  # a value of the dev sweep's grid


@pytest.mark.parametrize("path", QUICKSTART_RECIPES, ids=lambda p: p.name)
def test_quickstart_recipe_dry_runs(path: Path, plugins, tmp_path):
    """Each recipe passes the dry run with its measured smoke step: two real steps of its estimator and its
    algo settings (the critic's too for ppo), on the tiny model shape so the default suite stays fast."""
    from rlctl.planning.dryrun import DryrunOptions, dryrun

    report = dryrun(load_config(path, TINY_OVERRIDES), plugins, tmp_path, DryrunOptions())
    assert all(c.ok for c in report.checks), report.checks
    assert report.smoke is not None and report.smoke.steps == 2
    assert report.workload.critic == (path.name == "quickstart-ppo.yaml")  # the critic is in the memory ledger


def test_credit_recipe_is_quickstart_ppo_on_partial_credit():
    """configs/quickstart-ppo-credit.yaml is quickstart-ppo.yaml with the digit_credit reward in place of math, so
    its critic's explained variance and hidden gain compare with quickstart-ppo's from the same warm start."""
    credit = load_config(REPO / "configs" / "quickstart-ppo-credit.yaml")
    ppo = load_config(REPO / "configs" / "quickstart-ppo.yaml")
    assert [c.name for c in credit.reward.components] == ["digit_credit", "format"]
    same = ("model", "task", "rollout", "algo", "train", "eval", "checkpoint")
    assert {s: getattr(credit, s) for s in same} == {s: getattr(ppo, s) for s in same}


def test_mixed_recipe_is_quickstart_ppo_on_mixed_difficulty():
    """configs/quickstart-ppo-mixed.yaml is quickstart-ppo.yaml on arith with operand_mix (easy and hard prompts
    together): the same model, reward, estimator and critic block, only the task (and so the warm start) differs."""
    mixed = load_config(REPO / "configs" / "quickstart-ppo-mixed.yaml")
    ppo = load_config(REPO / "configs" / "quickstart-ppo.yaml")
    assert mixed.task.source == "arith" and mixed.task.options["operand_mix"] == [29, 999]
    same = ("model", "rollout", "reward", "algo", "train", "eval", "checkpoint")
    assert {s: getattr(mixed, s) for s in same} == {s: getattr(ppo, s) for s in same}
