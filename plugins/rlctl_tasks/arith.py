"""The embedded default task: synthetic integer arithmetic, deterministic from a seed.

What this is: a TaskSource that draws unique expressions such as ``57+38-12=``
with integer answers and splits them into train / dev / hidden. The hidden
split is disjoint from train and dev by construction (one pool of unique
expressions is partitioned). The dataset version is a hash of every prompt,
answer and split plus the options that produced them. With
``tool_demo_fraction`` a share of the train demonstrations call a calculator in
the ``tools`` environment's syntax (``<calc>37*48</calc><out>1776</out>1776``):
the warm start of configs/quickstart-tools.yaml.

What this is not: a general math dataset. Real data comes through the
``jsonl`` source.
"""

from __future__ import annotations

import hashlib
import json
import random

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlctl import PromptRecord, Split, TaskData


class ArithOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    num_terms: int = Field(2, ge=2, le=4, description="Operands per expression.")
    max_operand: int = Field(99, ge=1, description="Operands are drawn from 0..max_operand.")
    ops: str = Field("+-", min_length=1, description="Operators to draw from; any of '+-*'.")
    num_train: int = Field(4000, ge=1)
    num_dev: int = Field(300, ge=1)
    num_hidden: int = Field(500, ge=1)
    operand_mix: list[int] | None = Field(
        None, min_length=2,
        description="Mixed difficulty: the problems are split evenly between these operand bounds (each a "
        "max_operand, e.g. [19, 99, 999]; a small bound that runs out of problems gives all it has), so some "
        "prompts are near-certain and others near-hopeless; max_operand is then unused. Unset = one bound, "
        "max_operand.",
    )
    seed: int = Field(1234, description="Seed of the dataset itself (not of the run).")
    teacher_sign_error: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Probability that a train demonstration (the SFT target) of a negative answer comes from "
        "a sloppy teacher that drops the minus sign. Models systematic errors in real SFT data; the "
        "verifier's reference answers are always exact. 0 = clean demonstrations.",
    )
    tool_demo_fraction: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Share of train rows (exactly this fraction, seeded) whose demonstration calls a calculator "
        "in the `tools` environment's syntax, `<TAG>37*48</TAG><out>1776</out>1776`, instead of answering "
        "directly (`1776`); the warm start trains only on the policy's part of it (not `<out>...</out>`). "
        "0 = no tool demonstrations.",
    )
    tool_tag: str = Field(
        "calc", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="The tool name the demonstrations call: the key of the calculator in "
        "rollout.environment.options.tools.",
    )

    @model_validator(mode="after")
    def _check(self) -> "ArithOptions":
        bad = set(self.ops) - set("+-*")
        if bad:
            raise ValueError(f"task.options.ops may only contain '+', '-', '*' (got {''.join(sorted(bad))!r})")
        need = self.num_train + self.num_dev + self.num_hidden
        if self.operand_mix is not None:
            if len(set(self.operand_mix)) != len(self.operand_mix) or min(self.operand_mix) < 1:
                raise ValueError(f"task.options.operand_mix must be distinct bounds >= 1 (got {self.operand_mix})")
            space = self.space_at(max(self.operand_mix))
            if need > space:
                raise ValueError(
                    f"arith can make {space} unique problems with operands up to {max(self.operand_mix)} but "
                    f"{need} were asked for; raise the largest bound of task.options.operand_mix or lower the "
                    "split sizes"
                )
            return self
        space = self.space
        if need > space:
            raise ValueError(
                f"arith can make {space} unique problems with these options but {need} were asked for; "
                "raise task.options.max_operand or lower the split sizes"
            )
        return self

    @property
    def space(self) -> int:
        """Number of distinct expressions these options can write."""
        return self.space_at(self.max_operand)

    def space_at(self, bound: int) -> int:
        """Number of distinct expressions with operands 0..bound."""
        return (bound + 1) ** self.num_terms * len(set(self.ops)) ** (self.num_terms - 1)


def _shares(opts: ArithOptions, need: int) -> list[int]:
    """Rows per bound of ``operand_mix``, smallest first: even shares, except that a bound whose problems run out
    gives all it has and the rest is split evenly over the larger bounds."""
    bounds = sorted(opts.operand_mix)
    shares: list[int] = []
    for i, bound in enumerate(bounds):
        left, parts = need - sum(shares), len(bounds) - i
        even = left // parts if parts > 1 else left
        shares.append(min(even, opts.space_at(bound) - sum(shares)) if parts > 1 else left)
    return shares


class ArithTask:
    """TaskSource for the synthetic arithmetic task."""

    def __init__(self, options: ArithOptions | None = None, seed: int = 0) -> None:
        self.options = options or ArithOptions()

    def load(self) -> TaskData:
        opts = self.options
        rng = random.Random(opts.seed)
        need = opts.num_train + opts.num_dev + opts.num_hidden
        if opts.operand_mix is None:
            exprs = _enumerate(rng, opts, need) if need > opts.space // 4 else _draw_unique(rng, opts, need)
        else:
            exprs = _mixed(rng, opts, need)
        pool = [(expr, str(_evaluate(expr))) for expr in exprs]
        cut1, cut2 = opts.num_hidden, opts.num_hidden + opts.num_dev
        splits = {Split.HIDDEN: pool[:cut1], Split.DEV: pool[cut1:cut2], Split.TRAIN: pool[cut2:]}
        teacher = random.Random(f"{opts.seed}/teacher")
        num_tool = round(opts.tool_demo_fraction * opts.num_train)
        tool_rows = set(random.Random(f"{opts.seed}/tool").sample(range(opts.num_train), num_tool))
        records = {
            split: tuple(
                PromptRecord(id=f"arith-{split.value}-{i}", text=f"{expr}=", answer=ans, split=split,
                             demonstration=_demonstration(opts, expr, ans, teacher, i in tool_rows)
                             if split is Split.TRAIN else None)
                for i, (expr, ans) in enumerate(rows)
            )
            for split, rows in splits.items()
        }
        options = opts.model_dump()
        if opts.operand_mix is None:
            del options["operand_mix"]  # unset: the same version as before the option existed
        if opts.tool_demo_fraction == 0:
            del options["tool_demo_fraction"], options["tool_tag"]  # likewise
        version = dataset_version("arith", options, records)
        return TaskData(
            name="arith", version=version,
            train=records[Split.TRAIN], dev=records[Split.DEV], hidden=records[Split.HIDDEN],
        )


def _mixed(rng: random.Random, opts: ArithOptions, need: int) -> list[str]:
    """``need`` distinct expressions, an even share per bound of ``operand_mix``, shuffled together."""
    seen: set[str] = set()
    out: list[str] = []
    for bound, share in zip(sorted(opts.operand_mix), _shares(opts, need)):
        level = opts.model_copy(update={"max_operand": bound, "operand_mix": None})
        if share + len(seen) > level.space // 4:
            fresh = [e for e in _enumerate(rng, level, level.space) if e not in seen]
        else:
            fresh = _draw_unique(rng, level, share, seen)
        fresh = fresh[:share]
        seen.update(fresh)
        out.extend(fresh)
    rng.shuffle(out)
    return out


def _draw_unique(rng: random.Random, opts: ArithOptions, need: int, taken: set[str] | None = None) -> list[str]:
    """``need`` distinct expressions by rejection sampling (the space is at least 4x larger), none in ``taken``."""
    seen: set[str] = set(taken or ())
    out: list[str] = []
    while len(out) < need:
        expr = _draw(rng, opts)
        if expr not in seen:
            seen.add(expr)
            out.append(expr)
    return out


def _enumerate(rng: random.Random, opts: ArithOptions, need: int) -> list[str]:
    """``need`` distinct expressions from a shuffled list of the whole space (dense requests, up to all of it)."""
    operands = [str(v) for v in range(opts.max_operand + 1)]
    ops = sorted(set(opts.ops))
    exprs = list(operands)
    for _ in range(opts.num_terms - 1):
        exprs = [e + op + b for e in exprs for op in ops for b in operands]
    rng.shuffle(exprs)
    return exprs[:need]


def _draw(rng: random.Random, opts: ArithOptions) -> str:
    parts = [str(rng.randint(0, opts.max_operand))]
    for _ in range(opts.num_terms - 1):
        parts.append(rng.choice(opts.ops))
        parts.append(str(rng.randint(0, opts.max_operand)))
    return "".join(parts)


def _demonstration(opts: ArithOptions, expr: str, answer: str, teacher: random.Random, tool: bool) -> str | None:
    """A train row's SFT target: None (the answer itself) unless the teacher is sloppy or the row calls the tool.

    A tool row is written the way an episode of the ``tools`` environment reads:
    the policy's call ``<TAG>EXPR</TAG>``, the environment's ``<out>RESULT</out>``,
    then the policy's final answer (the warm start masks the environment's part).
    """
    final = _weak_teacher(answer, teacher, opts.teacher_sign_error) if opts.teacher_sign_error > 0 else answer
    if tool:
        return f"<{opts.tool_tag}>{expr}</{opts.tool_tag}><out>{answer}</out>{final}"
    return final if opts.teacher_sign_error > 0 else None


def _weak_teacher(answer: str, rng: random.Random, error: float) -> str:
    """The answer a sloppy teacher writes: it drops the minus sign with probability ``error``.

    The mistake is systematic (one decision, the sign of a negative result), so a
    policy can learn it from the demonstrations and a verifier reward can unlearn it.
    """
    if answer.startswith("-") and rng.random() < error:
        return answer[1:]
    return answer


def _evaluate(expr: str) -> int:
    """Integer value of an expression over + - * with usual precedence (no eval)."""
    terms: list[int] = []
    sign, num, product = 1, "", None
    tokens = []
    for ch in expr:
        if ch.isdigit():
            num += ch
        else:
            tokens.extend([int(num), ch])
            num = ""
    tokens.append(int(num))
    product = tokens[0]
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= value
        else:
            terms.append(sign * product)
            sign, product = (1 if op == "+" else -1), value
    terms.append(sign * product)
    return sum(terms)


def dataset_version(name: str, options: dict, records: dict[Split, tuple[PromptRecord, ...]]) -> str:
    """Content hash of a task: every record of every split plus the source's options."""
    h = hashlib.sha256()
    h.update(json.dumps({"name": name, "options": options}, sort_keys=True).encode())
    for split in (Split.TRAIN, Split.DEV, Split.HIDDEN):
        for rec in records[split]:
            h.update(f"{split.value}\x1f{rec.id}\x1f{rec.text}\x1f{rec.answer}\x1f{rec.demonstration}\x1e".encode())
    return h.hexdigest()[:16]
