"""Built-in rewards (plugins/rlctl_rewards): extraction, equivalence, format, length, mix."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl import RewardResult, SamplingConfig, TerminalReason, Trajectory
from rlctl.contracts.errors import ConfigError
from rlctl.contracts.roles import RewardFunction
from rlctl.hooks.manager import load_plugins
from rlctl_rewards import symbolic
from rlctl_rewards.format import FormatOptions, FormatReward
from rlctl_rewards.length import LengthOptions, LengthPenalty
from rlctl_rewards.math import MathOptions, MathReward, equivalent, extract_answer, parse_number
from rlctl.engine.reward_mix import MixedReward


def traj(text: str, *, n_tokens: int = 1, max_tokens: int = 16,
         reason: TerminalReason = TerminalReason.EOS) -> Trajectory:
    return Trajectory.create(
        id="p1/0", prompt_id="p1", group_index=0, dataset_version="d", policy_version=0,
        tokenizer_hash="t", prompt_tokens=(1, 2), response_tokens=tuple(range(n_tokens)),
        response_text=text, action_mask=(1,) * n_tokens, behavior_logprobs=(-0.5,) * n_tokens,
        sampling_config=SamplingConfig(max_tokens=max_tokens), terminal_reason=reason,
        rollout_started_at=0.0,
    )


# -- extraction ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{\frac{1}{2}} done", r"\frac{1}{2}"),
        (r"first \boxed{3} then \boxed{x^{2}+{1}}", "x^{2}+{1}"),
        (r"truncated \boxed{12", "12"),  # unbalanced box: falls through to the last number
        ("work...\n#### 72\nextra", "72"),
        ("The answer is 12.", "12"),
        ("so the answer is 3.5. Done", "3.5"),
        ("Answer: x^2-1", "x^2-1"),
        ("The answer is 12 apples", "12"),
        ("47", "47"),
        ("5 + 7 = 12, then 12 - 3 = 9", "9"),
        ("it is -7", "-7"),
        ("5-3", "3"),  # binary minus, not a negative number
        ("half is 3/4", "3/4"),
        ("it costs 1,234,567 dollars", "1,234,567"),
        ("pi is about 3.14", "3.14"),
        ("I do not know", None),
        ("", None),
    ],
)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


def test_parse_number() -> None:
    assert parse_number("1,234") == 1234
    assert parse_number("-3/4") == parse_number("-0.75")
    assert parse_number("+5.") == 5
    assert parse_number("1/0") is None
    assert parse_number("x") is None
    assert parse_number("1e999999999") is None  # no exponent notation: no huge integers


# -- equivalence --------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("47", "47.0"), ("1/2", "0.5"), ("$1,234$", "1234"), ("+3", "3."), (r"\frac{1}{2}", "0.5"),
        ("2*x+1", "1+2*x"), ("x**2-1", "(x-1)*(x+1)"), ("2x + 1", "1 + 2x"), ("sqrt(4)", "2"),
        ("X^2", "x**2"),
    ],
)
def test_equivalent_pairs(a: str, b: str) -> None:
    assert equivalent(a, b)[0]


@pytest.mark.parametrize(
    ("a", "b"),
    [("47", "48"), ("0.5", "1/3"), ("x+1", "x+2"), ("x**2", "2x"), ("x", "y"), ("12 apples", "12")],
)
def test_not_equivalent_pairs(a: str, b: str) -> None:
    assert not equivalent(a, b)[0]


def test_exact_mode_skips_sympy() -> None:
    assert equivalent("47", "47.0", symbolic_check=False) == (True, "numeric")
    assert equivalent("2*x+1", "1+2*x", symbolic_check=False) == (False, "exact")


def test_malicious_input_is_never_executed(tmp_path, capsys) -> None:
    marker = tmp_path / "pwned"
    attack = f"__import__('os').system('touch {marker}')"
    assert equivalent(attack, "0") == (False, "not eligible for sympy")
    with pytest.raises(ValueError):
        symbolic.safe_parse(attack)
    # Whitelisted names never reach Python builtins: print/open/input are plain sympy functions.
    for text in ("print(1)", "open(1)", "input(x)", "eval(x)"):
        assert not symbolic.sympy_equal(text, "x")[0]
    assert capsys.readouterr().out == ""
    assert not marker.exists()
    for text in ("x.real", "(1).imag", "x[0]", "x=1", "a,b"):
        assert not symbolic.eligible(text)


def test_very_long_input_is_not_equivalent() -> None:
    long_sum = "+".join(["x"] * 150)
    assert not equivalent(long_sum, "150x")[0]  # over the length guard, never parsed
    assert not equivalent("1" * 10_000, "2")[0]


def test_symbolic_timeout_is_flagged_not_zero() -> None:
    reward = MathReward(MathOptions(timeout_s=0.5))
    result = reward.score(traj(r"\boxed{9^9^9^9}"), "x")
    assert result.error_code == "timeout"
    assert "exceeded" in result.log
    # the helper process was replaced: the next check works
    assert reward.score(traj(r"\boxed{2x+2}"), "2(x+1)").total == 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=-10**12, max_value=10**12))
def test_math_integers_property(a: int) -> None:
    reward = MathReward()
    assert reward.score(traj(str(a)), str(a)).total == 1.0
    assert reward.score(traj(str(a)), str(a + 1)).total == 0.0
    assert extract_answer(f"so we get {a}") == str(a)


def test_math_reward_result() -> None:
    reward = MathReward()
    assert isinstance(reward, RewardFunction)
    assert reward.version.startswith("math@1.0+sympy")
    assert MathReward(MathOptions(mode="exact")).version == "math@1.0+exact"
    result = reward.score(traj("so 5 + 7 = 12"), "12")
    assert (result.total, dict(result.components), result.error_code) == (1.0, {"math": 1.0}, None)
    assert reward.score(traj("no idea"), "12").components == {"math": 0.0}
    assert reward.score(traj("I got 72"), "Natalia sold 48+24 = 72 clips.\n#### 72").total == 1.0


# -- format and length --------------------------------------------------------


def test_format_reward() -> None:
    reward = FormatReward()
    assert reward.score(traj(" 47 "), "").total == 1.0
    assert reward.score(traj("-3.5"), "").total == 1.0
    assert reward.score(traj("47", reason=TerminalReason.LENGTH), "").total == 0.0
    assert reward.score(traj("47", reason=TerminalReason.STOP), "").total == 1.0
    assert reward.score(traj("the answer is 47"), "").total == 0.0
    lax = FormatReward(FormatOptions(require_eos=False))
    assert lax.score(traj("47", reason=TerminalReason.LENGTH), "").components == {"format": 1.0}
    custom = FormatReward(FormatOptions(pattern=r"\\boxed\{.+\}"))
    assert custom.score(traj(r"so \boxed{3}"), "").total == 1.0


def test_format_bad_regex_fails_at_validation() -> None:
    with pytest.raises(ValueError, match="not a valid Python regular expression"):
        FormatOptions(pattern="(unclosed")


@pytest.mark.parametrize(
    ("n_tokens", "expected"),
    [(5, 0.0), (10, 0.0), (13, -0.125), (16, -0.25), (22, -0.5), (40, -0.5)],
)
def test_length_penalty(n_tokens: int, expected: float) -> None:
    reward = LengthPenalty(LengthOptions(target_tokens=10, max_penalty=0.5))
    result = reward.score(traj("x", n_tokens=n_tokens, max_tokens=22), "")
    assert result.total == pytest.approx(expected)
    assert result.components == {"length": result.total}


def test_length_target_above_max_tokens() -> None:
    reward = LengthPenalty(LengthOptions(target_tokens=100))
    assert reward.score(traj("x", n_tokens=16, max_tokens=16), "").total == 0.0


# -- mix ----------------------------------------------------------------------


@dataclass
class Fixed:
    value: float
    name: str = "fixed"
    version: str = "fixed@1"
    error_code: str | None = None

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        return RewardResult(total=self.value, components={self.name: self.value},
                            grader_version=self.version, error_code=self.error_code)


class Raising:
    name = "boom"
    version = "boom@1"

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        raise KeyError("missing field")


def test_mix_total_components_and_version() -> None:
    mix = MixedReward([
        ("math", 0.7, MathReward()),
        ("format", 0.2, FormatReward()),
        ("length", 0.1, LengthPenalty(LengthOptions(target_tokens=2))),
    ])
    assert isinstance(mix, RewardFunction)
    result = mix.score(traj("47", n_tokens=9, max_tokens=16), "47")
    assert result.ok
    assert dict(result.components) == {"math": 1.0, "format": 1.0, "length": pytest.approx(-0.5)}
    assert result.total == pytest.approx(0.7 + 0.2 - 0.05)
    assert result.grader_version == mix.version == (
        f"math:{MathReward().version}x0.7+format:format@1.0x0.2+length:length@1.0x0.1"
    )
    assert result.latency_s >= 0.0


def test_mix_component_error_is_flagged() -> None:
    result = MixedReward([("a", 1.0, Fixed(1.0)), ("b", 1.0, Fixed(0.0, error_code="timeout"))]).score(traj("1"), "1")
    assert result.error_code == "timeout" and result.total == 0.0
    assert dict(result.components) == {"a": 1.0}


def test_mix_component_raising_is_grader_error() -> None:
    result = MixedReward([("a", 1.0, Fixed(1.0)), ("b", 0.5, Raising())]).score(traj("1"), "1")
    assert result.error_code == "grader_error:b"
    assert not result.ok and result.total == 0.0
    assert "KeyError" in result.log and "missing field" in result.log


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_mix_non_finite_component_is_invalid(bad: float) -> None:
    result = MixedReward([("a", 1.0, Fixed(bad))]).score(traj("1"), "1")
    assert result.error_code == "invalid_reward" and result.total == 0.0


def test_mix_rejects_bad_components() -> None:
    with pytest.raises(ValueError, match="at least one"):
        MixedReward([])
    with pytest.raises(ValueError, match="unique"):
        MixedReward([("a", 1.0, Fixed(1.0)), ("a", 1.0, Fixed(1.0))])
    with pytest.raises(ValueError, match="finite"):
        MixedReward([("a", math.nan, Fixed(1.0))])


# -- plugin -------------------------------------------------------------------


def test_plugin_registers_rewards() -> None:
    plugins = load_plugins()
    assert {"math", "format", "length"} <= set(plugins.names("reward_function"))
    fn = plugins.build("reward_function", "math", {}, where="reward.components.0.options")
    assert isinstance(fn, MathReward) and fn.options.mode == "symbolic"
    exact = plugins.build("reward_function", "math", {"mode": "exact"}, where="reward.components.0.options")
    assert exact.version == "math@1.0+exact"
    with pytest.raises(ConfigError, match="pattern"):
        plugins.build("reward_function", "format", {"pattern": "("}, where="reward.components.1.options")
    with pytest.raises(ConfigError, match="target_tokens"):
        plugins.build("reward_function", "length", {}, where="reward.components.2.options")
    length = plugins.build("reward_function", "length", {"target_tokens": 8}, where="reward.components.2.options")
    assert length.score(traj("x", n_tokens=8), "").total == 0.0
