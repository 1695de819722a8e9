"""The dry run names the learner plugin and sharding its ledger assumes, and says when no installed learner
shards the way ``--zero-stage`` models it."""

from __future__ import annotations

from rlctl.planning.dryrun import learner_notes, learner_unavailable, role_memory, sharding_learners


def test_the_fsdp2_learner_is_the_installed_zero3_learner_and_torch_shards_nothing(plugins):
    assert "fsdp2" in sharding_learners(plugins, 3)
    assert sharding_learners(plugins, 0) == ["torch"]
    assert "torch" not in sharding_learners(plugins, 3)


def test_notes_name_the_learner_and_the_learners_that_do_what_zero_stage_models(tiny_config, plugins):
    roles = role_memory(tiny_config, plugins, gpu_plan=True)
    assert learner_notes(tiny_config, plugins, roles, 0) == ["learner: 'torch' (no sharding)"]
    notes = learner_notes(tiny_config, plugins, roles, 3)
    assert "which learner 'torch' does not do" in notes[1] and "fsdp2" in notes[1] and "set train.learner: " in notes[1]
    zero1 = learner_notes(tiny_config, plugins, roles, 1)[1]
    assert "ZeRO-1" in zero1 and "deepspeed" in zero1 and "fsdp2" not in zero1

    fsdp = tiny_config.model_copy(update={"train": tiny_config.train.model_copy(update={"learner": "fsdp2"})})
    fsdp_roles = role_memory(fsdp, plugins, gpu_plan=True)
    assert learner_notes(fsdp, plugins, fsdp_roles, 3) == ["learner: 'fsdp2' (ZeRO-3 / FSDP full shard)"]


def _with_learner(config, name, **options):
    return config.model_copy(update={"train": config.train.model_copy(update={"learner": name,
                                                                              "learner_options": options})})


def test_the_deepspeed_learner_is_named_with_its_zero_stage(tiny_config, plugins):
    assert {"deepspeed", "fsdp2"} <= set(sharding_learners(plugins, 3))
    ds = _with_learner(tiny_config, "deepspeed", zero_stage=2)
    roles = role_memory(ds, plugins, gpu_plan=True)
    assert roles.learner.zero_stage == 2
    notes = learner_notes(ds, plugins, roles, 2)
    assert notes[0] == "learner: 'deepspeed' (ZeRO-2)"
    if not learner_unavailable(plugins, "deepspeed"):
        assert len(notes) == 1


def test_the_dry_run_and_the_factory_say_plainly_when_deepspeed_is_not_installed(tiny_config, plugins, monkeypatch):
    """Simulated absence (this environment may have deepspeed): the plan still names the learner, then says it
    cannot run here and how to install it; building it is one ConfigError, not an ImportError."""
    import pytest

    from rlctl import ConfigError
    from rlctl_deepspeed_learner import options as ds_options

    monkeypatch.setattr(ds_options, "deepspeed_missing", lambda: "deepspeed is not installed")
    ds = _with_learner(tiny_config, "deepspeed")
    notes = learner_notes(ds, plugins, role_memory(ds, plugins, gpu_plan=True), 3)
    assert notes[0] == "learner: 'deepspeed' (ZeRO-3 / FSDP full shard)"
    assert "cannot run in this environment: deepspeed is not installed" in notes[1]
    assert "pip install 'rlctl[deepspeed]'" in notes[1] and "DS_BUILD_OPS=0" in notes[1]
    zero2 = learner_notes(tiny_config, plugins, role_memory(tiny_config, plugins, gpu_plan=True), 2)[1]
    assert "deepspeed (not runnable here: deepspeed is not installed" in zero2
    with pytest.raises(ConfigError, match="deepspeed is not installed"):
        plugins.get("learner_backend", "deepspeed").factory(options=ds_options.DeepSpeedLearnerOptions(), ctx=None)
