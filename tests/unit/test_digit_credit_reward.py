"""The "digit_credit" reward (plugins/rlctl_rewards/digit_credit.py): credit per correct leading character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rlctl.contracts.errors import ConfigError
from rlctl.contracts.roles import RewardFunction
from rlctl.hooks.manager import load_plugins
from rlctl_rewards.digit_credit import DigitCreditReward, leading_credit
from rlctl_rewards.math import MathOptions, MathReward
from tests.unit.test_rewards import traj

integers = st.integers(min_value=-10**6, max_value=10**6)


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("198", "198", 1.0),
        ("199", "198", 2 / 4),
        ("1980", "198", 3 / 4),  # every digit right, then one too many: the end of the answer is missed
        ("19", "198", 2 / 4),
        ("98", "198", 0.0),
        ("7", "-7", 0.0),  # the sign is the first character
        ("-8", "-7", 1 / 3),
        ("so it is 42", "42", 1.0),  # extracted as by the math reward
        ("no idea", "42", 0.0),
    ],
)
def test_digit_credit_examples(response: str, answer: str, expected: float) -> None:
    result = DigitCreditReward().score(traj(response), answer)
    assert result.total == pytest.approx(expected)
    assert dict(result.components) == {"digit_credit": result.total}
    assert result.grader_version == "digit_credit@1.0" and result.error_code is None


@settings(max_examples=80, deadline=None)
@given(integers, integers)
def test_only_an_exact_answer_earns_full_credit(pred: int, ref: int) -> None:
    """Full credit is the math reward's verdict (rlctl eval's pass@1 is unchanged), and credit is a whole number of
    (L + 1)ths in [0, 1]."""
    total = DigitCreditReward().score(traj(str(pred)), str(ref)).total
    exact = MathReward(MathOptions(mode="exact")).score(traj(str(pred)), str(ref)).total
    assert (total == 1.0) == (exact == 1.0)
    steps = total * (len(str(ref)) + 1)
    assert 0.0 <= total <= 1.0 and steps == pytest.approx(round(steps))


@settings(max_examples=80, deadline=None)
@given(integers, st.data())
def test_credit_grows_with_each_right_leading_character(ref: int, data) -> None:
    """The partial answer ref[:k] earns k / (L + 1), and any wrong next character stops the count there: what a
    critic can learn, a prefix's credit set by the digits already written."""
    text = str(ref)
    n = len(text) + 1
    for k in range(len(text)):
        assert leading_credit(text[:k], text) == pytest.approx(k / n)
        wrong = data.draw(st.sampled_from([c for c in "-0123456789" if c != text[k]]))
        tail = data.draw(st.text(alphabet="0123456789", max_size=3))
        assert leading_credit(text[:k] + wrong + tail, text) == pytest.approx(k / n)


def test_registered_without_options() -> None:
    plugins = load_plugins()
    reward = plugins.build("reward_function", "digit_credit", {}, "reward.components.0.options")
    assert isinstance(reward, RewardFunction)
    with pytest.raises(ConfigError, match="takes no options"):
        plugins.build("reward_function", "digit_credit", {"mode": "exact"}, "reward.components.0.options")
