"""The "digit_credit" reward: partial credit per correct leading character of the answer.

What this is: the final answer is extracted and normalised as by the "math"
reward; an answer equivalent to the reference scores 1.0. Otherwise the score is
m / (L + 1), with L the length of the normalised reference and m the number of
leading characters (sign and digits) the answer shares with it. The "+ 1" is the
end of the answer: for "123", "123" earns 4/4, "1234" 3/4, "12" and "129" 2/4,
"23" 0; "-5" for "5" earns 0. Only an exact answer reaches 1.0, so the correctness grader of ``rlctl eval`` (``total >= 1``) is unchanged.

Why: the 0/1 "math" reward at the end of a 2-4 token answer is mostly noise to a
critic of the prefix (docs/algorithms.md, PPO section); credit that accrues digit
by digit makes the value of a prefix depend on the digits already written.

What this is not: a numeric closeness score ("119" for "120" earns 2/4, "120"
for "1200" 3/5) or a grader for anything but short numeric answers.
"""

from __future__ import annotations

import time

from rlctl import RewardResult, Trajectory
from rlctl_rewards.math import equivalent, extract_answer, normalize_answer, reference_answer

VERSION = "1.0"


def leading_credit(pred: str, ref: str) -> float:
    """m / (len(ref) + 1): leading characters of ``pred`` equal to ``ref``'s, the answer's end counted as one more.

    >>> [leading_credit(p, "123") for p in ("123", "12", "1234", "129", "23", "")]
    [1.0, 0.5, 0.75, 0.5, 0.0, 0.0]
    """
    matched = 0
    for a, b in zip(pred, ref):
        if a != b:
            break
        matched += 1
    return (matched + (pred == ref)) / (len(ref) + 1)


class DigitCreditReward:
    """1.0 for an answer equivalent to the reference, else the share of its leading characters that are right."""

    name = "digit_credit"
    version = f"digit_credit@{VERSION}"

    def __init__(self, options: None = None) -> None:  # no options (the plugin manager passes options=None)
        pass

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        ref = normalize_answer(reference_answer(reference))
        found = extract_answer(trajectory.response_text)
        pred = normalize_answer(found) if found is not None else ""
        equal = bool(pred) and equivalent(pred, ref, symbolic_check=False)[0]
        value = 1.0 if equal else leading_credit(pred, ref)
        log = f"pred={pred[:60]!r} ref={ref[:60]!r} credit={value:.3f}"
        return RewardResult(total=value, components={"digit_credit": value}, grader_version=self.version,
                            latency_s=time.perf_counter() - started, log=log)
