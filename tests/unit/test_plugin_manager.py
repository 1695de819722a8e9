"""Plugin discovery and the component registry (rlctl.hooks.manager), plus the hookspec contract.

Every test builds its own ``Plugins`` with ``load_plugins``: in-process test plugins live
only in that instance, so nothing stays registered after the test.
"""

from __future__ import annotations

import inspect
import types
import typing
from importlib import metadata
from pathlib import Path

import pluggy
import pytest
from pydantic import BaseModel, ConfigDict, Field

import rlctl
from rlctl import RewardResult, Trajectory
from rlctl.contracts.errors import ConfigError, PluginError
from rlctl.contracts.roles import MetricSink, RewardFunction, TaskSource
from rlctl.hooks import hookspecs, manager
from rlctl.hooks.manager import KINDS, Plugins, load_plugins

BUILTINS = {
    "task_source": ["arith", "hf_disk", "humaneval", "jsonl", "parquet"],
    "rollout_backend": ["local", "sglang", "vllm"],
    "learner_backend": ["deepspeed", "fsdp2", "torch"],
    "critic_backend": ["torch"],
    "reward_function": ["code", "digit_credit", "format", "length", "math", "reward_model"],
    "metric_sink": ["jsonl", "mlflow", "tensorboard", "wandb"],
    "advantage_estimator": ["dapo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "rloo"],
    "fault": ["bad-checkpoint", "learner-crash", "nan", "network-partition", "oom", "slow-learner", "slow-rollout",
              "verifier-error", "verifier-timeout", "weight-sync-failure", "worker-crash"],
    "environment": ["tools"],
    "tool": ["calculator", "python"],
}
BUILTIN_PLUGINS = {
    "tasks": {"task source": ("arith", "hf_disk", "humaneval", "jsonl", "parquet")},
    "rewards": {"reward function": ("code", "digit_credit", "format", "length", "math", "reward_model"),
                "tool": ("python",)},
    "envs": {"environment": ("tools",), "tool": ("calculator",)},
    "local_engine": {"rollout backend": ("local",)},
    "sglang": {"rollout backend": ("sglang",)},
    "vllm": {"rollout backend": ("vllm",)},
    "torch_learner": {"learner backend": ("torch",), "critic backend": ("torch",)},
    "fsdp_learner": {"learner backend": ("fsdp2",)},
    "deepspeed_learner": {"learner backend": ("deepspeed",)},
    "sinks": {"metric sink": ("jsonl", "mlflow", "tensorboard", "wandb")},
    "algos": {"advantage estimator": ("dapo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_pp", "rloo")},
    "faults": {"fault": ("bad-checkpoint", "learner-crash", "nan", "network-partition", "oom", "slow-learner",
                         "slow-rollout", "verifier-error", "verifier-timeout", "weight-sync-failure",
                         "worker-crash")},
}


class GoodReward:
    name = "good"
    version = "good@1"

    def __init__(self, options=None) -> None:
        self.options = options

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        return RewardResult(total=1.0, components={"good": 1.0}, grader_version=self.version)


class NotAReward:
    """Has a name but no ``version`` and no ``score``."""

    name = "broken"


class GoodOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    scale: float = Field(1.0, gt=0)


def reward_plugin(**components) -> types.ModuleType:
    """An in-process plugin module registering ``name=(factory, options_model)`` reward functions."""
    module = types.ModuleType("fake_rlctl_plugin")

    @rlctl.hookimpl
    def register_reward_functions(register) -> None:
        for name, (factory, options) in components.items():
            register(name, factory, options=options)

    module.register_reward_functions = register_reward_functions
    return module


# -- discovery of the built-ins -----------------------------------------------------------------


def test_builtins_are_discovered_through_entry_points() -> None:
    eps = {ep.name: ep.value for ep in metadata.entry_points(group=manager.ENTRY_POINT_GROUP)}
    assert {name: f"rlctl_{name}.plugin" for name in BUILTIN_PLUGINS}.items() <= eps.items()
    plugins = load_plugins()
    for kind, names in BUILTINS.items():
        assert plugins.names(kind) == names


def test_kinds_cover_every_component_hook() -> None:
    component_hooks = {name for name in dir(hookspecs) if name.startswith("register_") and name != "register_commands"}
    assert {hook for hook, _, _ in KINDS.values()} == component_hooks


def test_infos_list_each_builtin_with_version_and_registrations() -> None:
    infos = {info.name: info for info in load_plugins().infos()}
    assert set(BUILTIN_PLUGINS) <= set(infos)
    for name, registers in BUILTIN_PLUGINS.items():
        info = infos[name]
        assert info.builtin is True
        assert info.distribution == "rlctl"
        assert info.version == metadata.version("rlctl") == rlctl.__version__
        assert dict(info.registers) == registers
        hooks = tuple(sorted(h for h, _, label in KINDS.values() if label in registers))
        assert info.hooks == hooks


def test_infos_list_builtins_first() -> None:
    infos = load_plugins(extra={"aaa_first_by_name": reward_plugin(good=(GoodReward, None))}).infos()
    flags = [info.builtin for info in infos]
    assert flags == sorted(flags, reverse=True)
    extra = infos[-1]
    assert (extra.name, extra.builtin, extra.distribution) == ("aaa_first_by_name", False, "<in-process>")
    assert dict(extra.registers) == {"reward function": ("good",)}


def test_builtins_build(tmp_path: Path) -> None:
    plugins = load_plugins()
    assert isinstance(plugins.build("task_source", "arith", {}, "task.options"), TaskSource)
    assert isinstance(plugins.build("reward_function", "math", {"mode": "exact"}, "reward.components.0.options"),
                      RewardFunction)
    sink = plugins.build("metric_sink", "jsonl", {}, "train.metric_sinks", run_dir=tmp_path, run_id="r1")
    try:
        assert isinstance(sink, MetricSink)
    finally:
        sink.close()


# -- unknown names ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "typo", "suggestion", "installed"),
    [
        ("rollout_backend", "loacl", "local", "local, sglang, vllm"),
        ("reward_function", "maht", "math", "code, digit_credit, format, length, math, reward_model"),
        ("task_source", "jsnol", "jsonl", "arith, hf_disk, humaneval, jsonl, parquet"),
        ("learner_backend", "torhc", "torch", "deepspeed, fsdp2, torch"),
    ],
)
def test_unknown_name_lists_installed_and_suggests_closest(kind: str, typo: str, suggestion: str,
                                                           installed: str) -> None:
    with pytest.raises(PluginError) as info:
        load_plugins().get(kind, typo)
    message = info.value.message
    assert repr(typo) in message
    assert f"did you mean {suggestion!r}" in message
    assert f"(installed: {installed})" in message
    assert "rlctl plugins" in info.value.hint


def test_unknown_name_without_a_close_match() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins().build("rollout_backend", "vllm-remote", {}, "rollout.options")
    assert "did you mean" not in info.value.message
    assert "installed: local" in info.value.message


# -- registration errors -------------------------------------------------------------------------


def test_registering_a_name_twice_names_both_plugins() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(extra={"dup": reward_plugin(math=(GoodReward, None))})
    message = info.value.message
    assert "'math'" in message and "registered twice" in message
    assert "'rewards'" in message and "'dup'" in message


def test_two_extra_plugins_registering_the_same_name() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(extra={"one": reward_plugin(same=(GoodReward, None)), "two": reward_plugin(same=(GoodReward, None))})
    assert "'one'" in info.value.message and "'two'" in info.value.message


def test_non_callable_factory_is_refused() -> None:
    with pytest.raises(PluginError) as info:
        load_plugins(extra={"bad": reward_plugin(odd=("not a factory", None))})
    assert "'bad'" in info.value.message and "'odd'" in info.value.message and "non-callable" in info.value.message


def test_plugin_with_a_misspelled_hook_is_a_plugin_error() -> None:
    module = types.ModuleType("typo_plugin")

    @rlctl.hookimpl
    def register_reward_function(register) -> None:  # missing the final "s"
        """Never called."""

    module.register_reward_function = register_reward_function
    with pytest.raises(PluginError, match="typo"):
        load_plugins(extra={"typo": module})


# -- build: protocol check and options ---------------------------------------------------------------


def test_factory_result_not_satisfying_the_protocol_fails_at_build() -> None:
    plugins = load_plugins(extra={"shaky": reward_plugin(broken=(lambda options: NotAReward(), None))})
    assert "broken" in plugins.names("reward_function")  # registering is fine; building checks the shape
    with pytest.raises(PluginError) as info:
        plugins.build("reward_function", "broken", {}, "reward.components.0.options")
    message = info.value.message
    assert "'broken'" in message and "'shaky'" in message and "RewardFunction" in message


def test_factory_receives_validated_options_and_context() -> None:
    seen = {}

    def factory(options, **kwargs):
        seen.update(options=options, kwargs=kwargs)
        return GoodReward(options)

    plugins = load_plugins(extra={"opts": reward_plugin(good=(factory, GoodOptions))})
    built = plugins.build("reward_function", "good", {"scale": 2}, "reward.components.0.options", extra_arg=7)
    assert isinstance(built, GoodReward)
    assert seen == {"options": GoodOptions(scale=2.0), "kwargs": {"extra_arg": 7}}
    component = plugins.get("reward_function", "good")
    assert (component.kind, component.name, component.plugin, component.options) == (
        "reward_function", "good", "opts", GoodOptions)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"scael": 2}, "unknown config key reward.components.1.options.scael; did you mean reward.components.1.options.scale"),
        ({"scale": -1}, "reward.components.1.options.scale"),
    ],
)
def test_bad_option_is_a_config_error_naming_the_path(options: dict, expected: str) -> None:
    plugins = load_plugins(extra={"opts": reward_plugin(good=(GoodReward, GoodOptions))})
    with pytest.raises(ConfigError) as info:
        plugins.build("reward_function", "good", options, "reward.components.1.options")
    assert expected in info.value.message


def test_bad_option_of_a_builtin_names_the_path() -> None:
    with pytest.raises(ConfigError) as info:
        load_plugins().build("reward_function", "math", {"mode": "fuzzy"}, "reward.components.0.options")
    assert "reward.components.0.options.mode" in info.value.message and "'fuzzy'" in info.value.message


def test_component_without_options_model_refuses_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_plugins().build("metric_sink", "jsonl", {"flush": True}, "train.sink_options",
                             run_dir=tmp_path, run_id="r")
    assert "train.sink_options takes no options" in info.value.message


def test_factory_is_not_called_when_options_are_bad() -> None:
    calls = []
    plugins = load_plugins(extra={"opts": reward_plugin(good=(lambda options: calls.append(1), GoodOptions))})
    with pytest.raises(ConfigError):
        plugins.build("reward_function", "good", {"scale": 0}, "x.options")
    assert calls == []


# -- entry points, pinning ------------------------------------------------------------------------------


class FakeEntryPoint:
    """Stands in for an installed third-party package's ``rlctl`` entry point."""

    def __init__(self, name: str, plugin: object, dist: str = "rlctl-thirdparty", version: str = "2.3.4") -> None:
        self.name = name
        self.dist = types.SimpleNamespace(name=dist, version=version)
        self._plugin = plugin

    def load(self) -> object:
        if isinstance(self._plugin, Exception):
            raise self._plugin
        return self._plugin


@pytest.fixture
def third_party(monkeypatch: pytest.MonkeyPatch):
    """Adds fake third-party entry points next to the real ones; monkeypatch removes them."""
    real = manager._entry_points

    def install(*eps: FakeEntryPoint) -> None:
        monkeypatch.setattr(manager, "_entry_points", lambda: real() + list(eps))

    return install


def test_third_party_entry_point_is_loaded_with_its_distribution(third_party, monkeypatch) -> None:
    monkeypatch.delenv("RLCTL_LOAD_PLUGINS", raising=False)
    third_party(FakeEntryPoint("extra_rewards", reward_plugin(good=(GoodReward, None))))
    plugins = load_plugins()
    assert "good" in plugins.names("reward_function")
    info = next(i for i in plugins.infos() if i.name == "extra_rewards")
    assert (info.distribution, info.version, info.builtin) == ("rlctl-thirdparty", "2.3.4", False)
    assert dict(info.registers) == {"reward function": ("good",)}


@pytest.mark.parametrize("pinned", ["", "something_else", " other , more "])
def test_pinning_skips_unlisted_third_party_but_keeps_builtins(third_party, monkeypatch, pinned: str) -> None:
    third_party(FakeEntryPoint("extra_rewards", reward_plugin(good=(GoodReward, None))))
    monkeypatch.setenv("RLCTL_LOAD_PLUGINS", pinned)
    plugins = load_plugins()
    for kind, names in BUILTINS.items():
        assert plugins.names(kind) == names
    assert "extra_rewards" not in {i.name for i in plugins.infos()}


def test_pinning_loads_the_listed_third_party(third_party, monkeypatch) -> None:
    third_party(FakeEntryPoint("extra_rewards", reward_plugin(good=(GoodReward, None))),
                FakeEntryPoint("unwanted", reward_plugin(other=(GoodReward, None))))
    monkeypatch.setenv("RLCTL_LOAD_PLUGINS", "tasks, extra_rewards")
    plugins = load_plugins()
    assert plugins.names("reward_function") == ["code", "digit_credit", "format", "good", "length", "math", "reward_model"]
    assert plugins.names("task_source") == ["arith", "hf_disk", "humaneval", "jsonl", "parquet"]


def test_third_party_import_failure_names_the_plugin(third_party, monkeypatch) -> None:
    monkeypatch.delenv("RLCTL_LOAD_PLUGINS", raising=False)
    third_party(FakeEntryPoint("flaky", ImportError("No module named 'flaky_dep'")))
    with pytest.raises(PluginError) as info:
        load_plugins()
    message = info.value.message
    assert "'flaky'" in message and "rlctl-thirdparty" in message and "flaky_dep" in message


def test_pinning_avoids_importing_a_broken_third_party(third_party, monkeypatch) -> None:
    third_party(FakeEntryPoint("flaky", ImportError("boom")))
    monkeypatch.setenv("RLCTL_LOAD_PLUGINS", "")
    assert load_plugins().names("rollout_backend") == ["local", "sglang", "vllm"]


def test_two_packages_with_the_same_plugin_name(third_party, monkeypatch) -> None:
    monkeypatch.delenv("RLCTL_LOAD_PLUGINS", raising=False)
    third_party(FakeEntryPoint("rewards", reward_plugin(good=(GoodReward, None)), dist="rlctl-fork"))
    with pytest.raises(PluginError) as info:
        load_plugins()
    assert "'rewards'" in info.value.message and "two installed packages" in info.value.message


def test_plugins_do_not_leak_between_instances() -> None:
    with_extra = load_plugins(extra={"tmp": reward_plugin(good=(GoodReward, None))})
    assert "good" in with_extra.names("reward_function")
    assert "good" not in load_plugins().names("reward_function")
    assert isinstance(with_extra, Plugins)


# -- the hookspec contract ----------------------------------------------------------------------------


def _hookspecs() -> list[tuple[str, typing.Callable]]:
    marker = f"{hookspecs.hookspec.project_name}_spec"
    return [(name, fn) for name, fn in inspect.getmembers(hookspecs, inspect.isfunction) if hasattr(fn, marker)]


def test_hookspecs_are_found() -> None:
    names = {name for name, _ in _hookspecs()}
    assert {hook for hook, _, _ in KINDS.values()} <= names
    assert {"register_commands", "on_run_start", "on_step_end", "on_run_end"} <= names


@pytest.mark.parametrize(("name", "fn"), _hookspecs(), ids=[name for name, _ in _hookspecs()])
def test_every_hookspec_has_a_docstring_and_type_annotations(name: str, fn: typing.Callable) -> None:
    assert inspect.getdoc(fn), f"hookspec {name} has no docstring"
    signature = inspect.signature(fn)
    for param in signature.parameters.values():
        assert param.annotation is not inspect.Parameter.empty, f"{name}({param.name}) is not annotated"
    assert signature.return_annotation is not inspect.Signature.empty, f"{name} has no return annotation"
    hints = typing.get_type_hints(fn)  # every annotation resolves
    assert set(hints) == set(signature.parameters) | {"return"}


def test_hookspec_module_is_accepted_by_pluggy() -> None:
    pm = pluggy.PluginManager("rlctl")
    pm.add_hookspecs(hookspecs)
    assert {name for name, _ in _hookspecs()} <= {name for name in dir(pm.hook) if not name.startswith("_")}


def test_hook_register_weight_transports(plugins, tmp_path):
    """Weight transports are components like any backend: registered by a plugin, built by name with their
    options validated, and checked against the WeightTransport Protocol; a rollout backend gets one through
    rlctl.kit.weight_transport."""
    from rlctl.contracts.errors import ConfigError, PluginError
    from rlctl.contracts.roles import WeightTransport
    from rlctl.kit import weight_transport

    assert {"disk", "inprocess"} <= set(plugins.names("weight_transport"))
    disk = weight_transport("disk", {"keep_versions": 3}, tmp_path / "pub", [])
    assert isinstance(disk, WeightTransport) and disk.keep_versions == 3 and disk.location == ""
    assert isinstance(weight_transport("inprocess", {}, tmp_path), WeightTransport)
    with pytest.raises(ConfigError, match="keep_version"):
        weight_transport("disk", {"keep_version": 3}, tmp_path / "pub")
    with pytest.raises(PluginError, match="object-store"):
        weight_transport("object-store", {}, tmp_path)
