"""Config loading (rlctl.config.load / models): error messages, overrides, validation, hashing."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict, Field

from rlctl.config.load import apply_override, config_hash, config_json, load_config, validate, validate_options
from rlctl.config.models import RunConfig
from rlctl.contracts.errors import ConfigError


def config_error(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """The message of the ConfigError that loading raises."""
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.message


def write(tmp_path: Path, text: str | bytes, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# -- defaults and happy paths ---------------------------------------------------


def test_defaults_validate_without_a_file() -> None:
    config = load_config(None)
    assert isinstance(config, RunConfig)
    assert config.algo.group_size >= 2
    assert config.task.source == "arith"
    assert [c.name for c in config.reward.components] == ["math", "format"]


def test_file_then_overrides_in_order(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  name: base\n  seed: 3\nalgo:\n  group_size: 4\n  prompts_per_step: 2\n")
    config = load_config(path, ["run.seed=7", "algo.group_size=6", "algo.group_size=2"])
    assert config.run.name == "base"
    assert config.run.seed == 7
    assert config.algo.group_size == 2  # the last override wins
    assert config.algo.prompts_per_step == 2


def test_empty_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "")) == load_config(None)


def test_override_values_are_parsed_as_yaml() -> None:
    config = load_config(None, [
        "rollout.truncation_penalty=null", "train.metric_sinks=[jsonl, other]", "run.name=",
        "rollout.temperature=0.5", "model.warm_start.enabled=false",
        "reward.components=[{name: math, weight: 0.7}, {name: format, weight: 0.3, options: {require_eos: true}}]",
    ])
    assert config.rollout.truncation_penalty is None
    assert config.train.metric_sinks == ["jsonl", "other"]
    assert config.run.name == ""
    assert config.rollout.temperature == 0.5
    assert config.model.warm_start.enabled is False
    assert [(c.name, c.weight) for c in config.reward.components] == [("math", 0.7), ("format", 0.3)]
    assert config.reward.components[1].options == {"require_eos": True}


def test_plugin_options_blocks_are_not_checked_here() -> None:
    # ``options:`` belongs to the plugin; the plugin manager validates it when the name is resolved.
    assert load_config(None, ["task.options.anything=1"]).task.options == {"anything": 1}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(min_value=-(2**62), max_value=2**62), name=st.from_regex(r"[a-z][a-z0-9_-]{0,15}", fullmatch=True))
def test_scalar_overrides_round_trip(seed: int, name: str) -> None:
    assume(yaml.safe_load(name) == name)  # 'null', 'true', 'off' ... are YAML scalars, not strings
    config = load_config(None, [f"run.seed={seed}", f"run.name={name}"])
    assert config.run.seed == seed
    assert config.run.name == name


def test_apply_override_creates_sections_in_place() -> None:
    raw: dict = {"algo": {"group_size": 4}}
    apply_override(raw, "algo.kl.coef=0.1")
    apply_override(raw, "run.name=x=y")  # only the first '=' splits
    assert raw == {"algo": {"group_size": 4, "kl": {"coef": 0.1}}, "run": {"name": "x=y"}}


# -- unknown keys: full dotted path and the closest valid key ---------------------------


@pytest.mark.parametrize(
    ("override", "bad", "suggestion"),
    [
        ("algo.grup_size=4", "algo.grup_size", "algo.group_size"),
        ("algo.kl.estmator=k3", "algo.kl.estmator", "algo.kl.estimator"),
        ("modle.path=x", "modle", "model"),
        ("model.warm_start.step=3", "model.warm_start.step", "model.warm_start.steps"),
        ("reward.components=[{name: math, wieght: 1}]", "reward.components.0.wieght", "reward.components.0.weight"),
        ("reward.components=[{name: math}, {name: format, optoins: {}}]",
         "reward.components.1.optoins", "reward.components.1.options"),
    ],
)
def test_unknown_key_names_path_and_closest_key(override: str, bad: str, suggestion: str) -> None:
    message = config_error(overrides=[override])
    assert f"unknown config key {bad}" in message
    assert f"did you mean {suggestion}" in message


def test_unknown_key_without_a_close_match_has_no_suggestion() -> None:
    message = config_error(overrides=["algo.zzzzzzzz=1"])
    assert "algo.zzzzzzzz" in message
    assert "did you mean" not in message


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "algo:\n  grup_size: 3\n")
    message = config_error(path)
    assert str(path) in message
    assert "algo.grup_size" in message and "did you mean algo.group_size" in message


# -- wrong values ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "path", "shown"),
    [
        ("algo.group_size=abc", "algo.group_size", "'abc'"),
        ("rollout.temperature=-1", "rollout.temperature", "-1"),
        ("rollout.top_p=1.5", "rollout.top_p", "1.5"),
        ("algo.prompts_per_step=0", "algo.prompts_per_step", "0"),
        ("train.metric_sinks=jsonl", "train.metric_sinks", "'jsonl'"),
        ("algo.kl.estimator=k9", "algo.kl.estimator", "'k9'"),
        ("eval.split=train", "eval.split", "'train'"),
        ("algo=3", "algo", "3"),
    ],
)
def test_wrong_value_names_path_and_value(override: str, path: str, shown: str) -> None:
    message = config_error(overrides=[override])
    assert f"{path}:" in message
    assert f"(got {shown})" in message


@pytest.mark.parametrize(
    ("override", "path"),
    [("algo.group_size=[1]", "algo.group_size"), ("run.name={a: 1}", "run.name"), ("reward.components=[]", "reward.components")],
)
def test_wrong_value_that_is_a_list_or_mapping_still_names_its_path(override: str, path: str) -> None:
    assert path in config_error(overrides=[override])


def test_missing_required_key_names_its_path() -> None:
    message = config_error(overrides=["reward.components=[{weight: 1}]"])
    assert "required key reward.components.0.name is missing" in message


# -- cross-field rules: the message says how to fix it -----------------------------


@pytest.mark.parametrize("size", [0, -3])
def test_group_size_below_one_is_a_config_error(size: int) -> None:
    message = config_error(overrides=[f"algo.group_size={size}"])
    assert "algo.group_size" in message and "greater than or equal to 1" in message


def test_group_size_below_two_for_a_group_baseline_says_how_to_fix() -> None:
    from rlctl.placement.build import build_estimator
    from rlctl.hooks.manager import load_plugins

    with pytest.raises(ConfigError) as info:  # the estimator knows it needs a group (ppo would accept 1)
        build_estimator(load_config(None, ["algo.group_size=1"]), load_plugins())
    message = f"{info.value.message} {info.value.hint}"
    assert "algo.group_size" in message and ">= 2" in message and "got 1" in message
    assert "set algo.group_size=" in message


def test_num_mini_batches_must_divide_the_batch() -> None:
    message = config_error(overrides=["algo.group_size=4", "algo.prompts_per_step=4", "algo.num_mini_batches=3"])
    assert "algo.num_mini_batches=3" in message
    assert "16" in message  # the batch it fails to divide
    assert "divisor" in message
    ok = load_config(None, ["algo.group_size=4", "algo.prompts_per_step=4", "algo.num_mini_batches=8"])
    assert ok.algo.num_mini_batches == 8


def test_reward_component_listed_twice() -> None:
    message = config_error(overrides=["reward.components=[{name: math}, {name: math}]"])
    assert "math" in message and "twice" in message


def test_model_shape_rule() -> None:
    message = config_error(overrides=["model.hidden_size=30", "model.num_heads=4"])
    assert "model.hidden_size" in message and "30/4" in message


# -- files ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line", "column"),
    [
        ("algo:\n  group_size: 4\n bad: [\n", 3, 2),
        ("a: b: c\n", 1, 5),
        ("algo:\n\tgroup_size: 4\n", 2, 1),
    ],
)
def test_malformed_yaml_names_file_line_and_column(tmp_path: Path, text: str, line: int, column: int) -> None:
    path = write(tmp_path, text)
    message = config_error(path)
    assert "malformed YAML" in message
    assert str(path) in message
    assert f"line {line}, column {column}" in message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_top_level_must_be_a_mapping(tmp_path: Path, text: str) -> None:
    message = config_error(write(tmp_path, text))
    assert "mapping at top level" in message


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.yaml")
    assert "not found" in info.value.message and "nope.yaml" in info.value.message
    assert info.value.hint  # says what to pass instead


def test_directory_is_not_a_config_file(tmp_path: Path) -> None:
    assert "not found" in config_error(tmp_path)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = write(tmp_path, b"run:\n  name: \xff\xfe\n")
    message = config_error(path)
    assert str(path) in message and "UTF-8" in message


# -- malformed overrides ------------------------------------------------------------


@pytest.mark.parametrize("item", ["algo.group_size", "=3", "a..b=3", ".a=1", "a.=1", ""])
def test_override_not_of_the_form_key_equals_value(item: str) -> None:
    message = config_error(overrides=[item])
    assert "key.path=value" in message


def test_override_into_a_scalar() -> None:
    message = config_error(overrides=["run.seed=3", "run.seed.x=1"])
    assert "run.seed is a value, not a section" in message


def test_override_into_a_scalar_from_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "algo:\n  group_size: 4\n")
    message = config_error(path, ["algo.group_size.inner=1"])
    assert "algo.group_size is a value, not a section" in message


def test_override_with_invalid_yaml_value() -> None:
    assert "not valid YAML" in config_error(overrides=["run.name=: :"])


def test_apply_override_leaves_raw_untouched_on_error() -> None:
    raw: dict = {"run": {"seed": 1}}
    with pytest.raises(ConfigError):
        apply_override(raw, "run.seed.x=2")
    assert raw == {"run": {"seed": 1}}


# -- validate -----------------------------------------------------------------------


def test_validate_names_the_source() -> None:
    with pytest.raises(ConfigError) as info:
        validate({"algo": {"grup_size": 2}}, source="sweep.yaml")
    assert info.value.message.startswith("sweep.yaml:")


def test_every_config_error_has_a_hint() -> None:
    for overrides in (["algo.grup_size=4"], ["algo.group_size=0"], ["algo.group_size=abc"], ["nokey"]):
        with pytest.raises(ConfigError) as info:
            load_config(None, overrides)
        assert info.value.hint


# -- hashing ------------------------------------------------------------------------


def test_config_hash_is_stable_across_key_order(tmp_path: Path) -> None:
    a = write(tmp_path, "run:\n  seed: 5\n  name: x\nalgo:\n  group_size: 4\n  prompts_per_step: 2\n", "a.yaml")
    b = write(tmp_path, "algo:\n  prompts_per_step: 2\n  group_size: 4\nrun:\n  name: x\n  seed: 5\n", "b.yaml")
    ha, hb = config_hash(load_config(a)), config_hash(load_config(b))
    assert ha == hb
    assert len(ha) == 16 and int(ha, 16) >= 0


def test_config_hash_same_whether_value_comes_from_file_or_override(tmp_path: Path) -> None:
    path = write(tmp_path, "run:\n  seed: 9\n")
    assert config_hash(load_config(path)) == config_hash(load_config(None, ["run.seed=9"]))


def test_config_hash_counts_defaults_explicitly() -> None:
    default_seed = RunConfig().run.seed
    assert config_hash(load_config(None)) == config_hash(load_config(None, [f"run.seed={default_seed}"]))


@pytest.mark.parametrize(
    "override", ["run.seed=1", "algo.group_size=4", "rollout.temperature=0.7", "reward.components=[{name: math}]",
                 "task.options.num_train=10", "rollout.truncation_penalty=null"],
)
def test_config_hash_changes_when_a_value_changes(override: str) -> None:
    assert config_hash(load_config(None, [override])) != config_hash(load_config(None))


def test_config_json_is_sorted_and_compact() -> None:
    text = config_json(load_config(None))
    assert ": " not in text and ", " not in text
    assert text.index('"algo"') < text.index('"eval"') < text.index('"model"') < text.index('"run"')


# -- plugin options -----------------------------------------------------------------


class _Opts(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_batch: int = Field(8, ge=1)
    mode: str = "fast"


def test_validate_options_without_a_model_refuses_options() -> None:
    with pytest.raises(ConfigError) as info:
        validate_options(None, {"x": 1}, "rollout.options")
    assert "rollout.options takes no options" in info.value.message
    assert "x" in info.value.message


def test_validate_options_without_a_model_and_without_options() -> None:
    assert validate_options(None, {}, "rollout.options") is None


def test_validate_options_returns_the_model() -> None:
    opts = validate_options(_Opts, {"max_batch": 4}, "rollout.options")
    assert opts == _Opts(max_batch=4, mode="fast")


def test_validate_options_unknown_key_is_prefixed_with_where() -> None:
    with pytest.raises(ConfigError) as info:
        validate_options(_Opts, {"max_btch": 4}, "rollout.options")
    message = info.value.message
    assert "rollout.options.max_btch" in message
    assert "did you mean rollout.options.max_batch" in message


def test_validate_options_bad_value_is_prefixed_with_where() -> None:
    with pytest.raises(ConfigError) as info:
        validate_options(_Opts, {"max_batch": 0}, "reward.components.1.options")
    assert "reward.components.1.options.max_batch" in info.value.message
    assert "(got 0)" in info.value.message
