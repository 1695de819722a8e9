"""The "math" reward: extract the final answer from a response and compare it to the reference.

What this is: answer extraction (``extract_answer``), normalisation
(``normalize_answer``), number parsing (``parse_number``), the equivalence
ladder (``equivalent``: normalised string, then exact rational value, then
sympy) and the RewardFunction ``MathReward`` scoring 1.0 or 0.0.

What this is not: a sandbox for code or a judge of reasoning. Sympy runs only on
short whitelisted strings, in a helper process with a deadline
(rlctl_rewards.symbolic); a check past the deadline is reported as
``error_code="timeout"``, never as a zero.
"""

from __future__ import annotations

import re
import time
from fractions import Fraction
from importlib import metadata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlctl import RewardResult, Trajectory
from rlctl_rewards import symbolic

VERSION = "1.0"
MAX_CHARS = symbolic.MAX_CHARS

_NUM = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
# A minus sign counts only when it is not the binary minus of "5-3".
_NUMBER_TOKEN = re.compile(rf"(?:(?<![0-9A-Za-z)\]}}])-)?{_NUM}(?:/\d+(?:\.\d+)?)?")
_LEADING_NUMBER = re.compile(rf"(-?{_NUM}(?:/\d+)?)\b(?!\s*[-+*/^(]|\.\d)")
_ANSWER_IS = re.compile(r"answer\s*(?:is\b|:)\s*:?", re.IGNORECASE)
_SENTENCE_END = re.compile(r"\.(?:\s|$)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")


def extract_answer(text: str) -> str | None:
    """The final answer in a response, or None when there is none.

    Order: the last ``\\boxed{...}`` (balanced braces), the text after the last
    "####", the text after the last "answer is" / "Answer:", the last number.
    """
    boxed = _last_boxed(text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    if "####" in text:
        found = _first_line(text.rsplit("####", 1)[1])
        if found:
            return found
    markers = list(_ANSWER_IS.finditer(text))
    if markers:
        marker = markers[-1]
        segment = _first_line(text[marker.end():])
        segment = _SENTENCE_END.split(segment, 1)[0].strip().strip("$").strip()
        if segment:
            lead = _LEADING_NUMBER.match(segment)
            return lead.group(1) if lead else segment
    numbers = _NUMBER_TOKEN.findall(text)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[begin:i]
            depth -= 1
    return None  # unbalanced (truncated response): fall through to the next rule


def _first_line(text: str) -> str:
    return text.strip().split("\n", 1)[0].strip()


_LATEX = (
    (re.compile(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}"), r"\1/\2"),
    (re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}"), r"(\1)/(\2)"),
    (re.compile(r"\\sqrt\{([^{}]*)\}"), r"sqrt(\1)"),
    (re.compile(r"\^\{([^{}]*)\}"), r"^(\1)"),
    (re.compile(r"\\(?:cdot|times)"), "*"),
    (re.compile(r"\\(?:left|right|!|,|;)"), ""),
    (re.compile(r"\\pi\b"), "pi"),
)


def normalize_answer(text: str) -> str:
    """Strip, drop "$", a trailing ".", a leading "+" and thousands commas; light LaTeX to plain."""
    out = text.strip().replace("$", "")
    if "\\" in out or "^{" in out:  # every LaTeX rule needs one of these: plain answers skip 7 regex passes
        for pattern, repl in _LATEX:
            out = pattern.sub(repl, out)
    out = _THOUSANDS.sub("", out)
    out = " ".join(out.split()).rstrip(".").strip()
    while out.startswith("+"):  # all of them, so normalising twice changes nothing
        out = out[1:].strip()
    return out


def parse_number(text: str) -> Fraction | None:
    """The exact value of an int, decimal or fraction "a/b" (after normalisation), else None."""
    return _parse_normalized(normalize_answer(text))


def _parse_normalized(text: str) -> Fraction | None:
    if len(text) > MAX_CHARS:
        return None
    parts = text.split("/")
    if len(parts) > 2 or not all(_DECIMAL.fullmatch(p.strip()) for p in parts):
        return None
    value = Fraction(parts[0].strip())
    if len(parts) == 2:
        denominator = Fraction(parts[1].strip())
        if denominator == 0:
            return None
        value /= denominator
    return value


def equivalent(pred: str, ref: str, *, symbolic_check: bool = True, timeout_s: float = 2.0) -> tuple[bool, str]:
    """Whether two answers are the same; returns (equal, how). Raises SymbolicTimeout."""
    a, b = normalize_answer(pred), normalize_answer(ref)
    if a == b:
        return True, "exact"
    x, y = _parse_normalized(a), _parse_normalized(b)  # normalising is idempotent: not twice
    if x is not None and y is not None:
        return x == y, "numeric"
    if not symbolic_check:
        return False, "exact"
    a, b = a.lower(), b.lower()
    if not (symbolic.eligible(a) and symbolic.eligible(b)):
        return False, "not eligible for sympy"
    return symbolic.equal_bounded(a, b, timeout_s)


def reference_answer(reference: str) -> str:
    """The answer inside a reference: a full solution ("... #### 72", \\boxed) is extracted."""
    if "####" in reference or "\\boxed{" in reference:
        return extract_answer(reference) or reference.strip()
    return reference.strip()


class MathOptions(BaseModel):
    """Options of the "math" reward."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["exact", "symbolic"] = Field(
        "symbolic",
        description='"exact": normalised string or equal numeric value; "symbolic": also sympy simplify(a-b)==0',
    )
    timeout_s: float = Field(
        2.0, gt=0, le=60, description="deadline of one sympy check; past it the sample gets error_code 'timeout'"
    )


class MathReward:
    """1.0 when the extracted answer is equivalent to the reference, else 0.0.

    >>> MathReward().version.startswith("math@1.0+sympy")
    True
    """

    name = "math"

    def __init__(self, options: MathOptions | None = None) -> None:
        self.options = options or MathOptions()
        if self.options.mode == "symbolic":
            self.version = f"math@{VERSION}+sympy{metadata.version('sympy')}"
        else:
            self.version = f"math@{VERSION}+exact"

    def score(self, trajectory: Trajectory, reference: str) -> RewardResult:
        started = time.perf_counter()
        ref = reference_answer(reference)
        pred = extract_answer(trajectory.response_text)
        if pred is None:
            equal, how = False, "no answer found"
        else:
            try:
                equal, how = equivalent(
                    pred, ref, symbolic_check=self.options.mode == "symbolic", timeout_s=self.options.timeout_s
                )
            except symbolic.SymbolicTimeout as err:
                return RewardResult(total=0.0, components={}, grader_version=self.version, error_code="timeout",
                                    latency_s=time.perf_counter() - started, log=str(err))
        value = 1.0 if equal else 0.0
        log = f"pred={(pred or '')[:60]!r} ref={ref[:60]!r} {how}"
        return RewardResult(total=value, components={"math": value}, grader_version=self.version,
                            latency_s=time.perf_counter() - started, log=log)
