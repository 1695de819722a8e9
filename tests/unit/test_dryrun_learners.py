"""The dry run names the learner plugin and sharding its ledger assumes, and says when no installed learner
shards the way ``--zero-stage`` models it."""

from __future__ import annotations

from rlctl.ops.dryrun import learner_notes, role_memory, sharding_learners


def test_the_fsdp2_learner_is_the_installed_zero3_learner_and_torch_shards_nothing(plugins):
    assert "fsdp2" in sharding_learners(plugins, 3)
    assert sharding_learners(plugins, 0) == ["torch"]
    assert "torch" not in sharding_learners(plugins, 3)


def test_notes_name_the_learner_and_the_learners_that_do_what_zero_stage_models(tiny_config, plugins):
    roles = role_memory(tiny_config, plugins, gpu_plan=True)
    assert learner_notes(tiny_config, plugins, roles, 0) == ["learner: 'torch' (no sharding)"]
    notes = learner_notes(tiny_config, plugins, roles, 3)
    assert "which learner 'torch' does not do" in notes[1] and "train.learner: fsdp2" in notes[1]
    zero1 = learner_notes(tiny_config, plugins, roles, 1)[1]
    assert "ZeRO-1" in zero1 and "no installed learner plugin does" in zero1

    fsdp = tiny_config.model_copy(update={"train": tiny_config.train.model_copy(update={"learner": "fsdp2"})})
    fsdp_roles = role_memory(fsdp, plugins, gpu_plan=True)
    assert learner_notes(fsdp, plugins, fsdp_roles, 3) == ["learner: 'fsdp2' (ZeRO-3 / FSDP full shard)"]
