"""A task from your own JSONL files: one ``{"prompt": ..., "answer": ...}`` per line.

What this is: a TaskSource for user data with three files (train, dev, hidden).
Every row is checked at startup; a bad row is an error naming the file and
line (never a crash mid-run). Duplicate prompts across train and hidden are
refused, so hidden stays a true held-out set. Rows may instead carry chat
``messages`` rendered with the tokenizer's chat template, and the answer may
be extracted with a regex (see rlctl_tasks.rows).

What this is not: a prompt-template engine; ``prompt`` is used verbatim.
"""

from __future__ import annotations

import json
from pathlib import Path

from rlctl import DataError, PromptRecord, Split, TaskData
from rlctl_tasks.rows import RowOptions, RowReader


class JsonlOptions(RowOptions):
    pass


class JsonlTask:
    def __init__(self, options: JsonlOptions, seed: int = 0) -> None:
        self.options = options

    def load(self) -> TaskData:
        reader = RowReader("jsonl", self.options)
        return reader.task({split: self._read(Path(getattr(self.options, split.value)), split, reader)
                            for split in Split})

    def _read(self, path: Path, split: Split, reader: RowReader) -> tuple[PromptRecord, ...]:
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
                rows.append(reader.record(row, where, split, f"{split.value}-{lineno}"))
        if not rows:
            raise DataError(f"{path} has no rows", f"the {split.value} split needs at least one prompt")
        return tuple(rows)
