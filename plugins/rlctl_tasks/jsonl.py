"""A task from your own JSONL files: one ``{"prompt": ..., "answer": ...}`` per line.

What this is: a TaskSource for user data with three files (train, dev, hidden).
Every row is checked at startup; a bad row is an error naming the file and
line (never a crash mid-run). Duplicate prompts across train and hidden are
refused, so hidden stays a true held-out set.

What this is not: a prompt-template engine; ``prompt`` is used verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from rlctl import DataError, PromptRecord, Split, TaskData
from rlctl_tasks.arith import dataset_version


class JsonlOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    train: str = Field(description="Path of the train JSONL file.")
    dev: str = Field(description="Path of the dev JSONL file.")
    hidden: str = Field(description="Path of the hidden-test JSONL file.")
    prompt_key: str = Field("prompt", description="Field holding the prompt text.")
    answer_key: str = Field("answer", description="Field holding the reference answer.")
    max_prompt_chars: int = Field(4096, ge=1, description="Longer prompts are an error.")


class JsonlTask:
    def __init__(self, options: JsonlOptions, seed: int = 0) -> None:
        self.options = options

    def load(self) -> TaskData:
        opts = self.options
        records = {split: self._read(Path(getattr(opts, split.value)), split) for split in Split}
        seen = {r.text for r in records[Split.TRAIN]} | {r.text for r in records[Split.DEV]}
        leaked = [r for r in records[Split.HIDDEN] if r.text in seen]
        if leaked:
            raise DataError(
                f"{len(leaked)} hidden prompt(s) also appear in train or dev (first: {leaked[0].text[:60]!r})",
                "remove them from one split: the hidden split must be held out",
            )
        version = dataset_version("jsonl", opts.model_dump(), records)
        return TaskData(name="jsonl", version=version, train=records[Split.TRAIN],
                        dev=records[Split.DEV], hidden=records[Split.HIDDEN])

    def _read(self, path: Path, split: Split) -> tuple[PromptRecord, ...]:
        opts = self.options
        if not path.is_file():
            raise DataError(f"task file for split {split.value} not found: {path}", f"set task.options.{split.value}")
        rows = []
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                where = f"{path}:{lineno}"
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError:
                    raise DataError(f"{where}: not valid UTF-8", "re-encode the file as UTF-8") from None
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise DataError(f"{where}: not valid JSON ({err.msg})", "one JSON object per line") from None
                if not isinstance(row, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}", "one JSON object per line")
                prompt, answer = row.get(opts.prompt_key), row.get(opts.answer_key)
                if not isinstance(prompt, str) or not prompt.strip():
                    raise DataError(f"{where}: row has no non-empty {opts.prompt_key!r}", "add the prompt or drop the row")
                if answer is None or (isinstance(answer, str) and not answer.strip()):
                    raise DataError(f"{where}: row has no {opts.answer_key!r}", "add the reference answer or drop the row")
                if len(prompt) > opts.max_prompt_chars:
                    raise DataError(f"{where}: prompt is {len(prompt)} chars, over max_prompt_chars={opts.max_prompt_chars}",
                                    "shorten it or raise task.options.max_prompt_chars")
                rows.append(PromptRecord(id=f"{split.value}-{lineno}", text=prompt, answer=str(answer), split=split))
        if not rows:
            raise DataError(f"{path} has no rows", f"the {split.value} split needs at least one prompt")
        return tuple(rows)
