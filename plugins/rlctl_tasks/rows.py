"""Turning user rows (JSONL lines, Parquet rows, Hugging Face datasets rows) into checked prompt records.

What this is: the row rules every file-backed task source shares. Columns
are mapped by name (``prompt_key`` / ``answer_key`` / ``messages_key``); a
chat row (a list of ``{"role", "content"}`` messages) is rendered to prompt
text with the tokenizer's chat template (or ``chat_template``); an
``answer_pattern`` regex pulls the reference answer out of a worked solution
(GSM8K's ``... #### 42``). Every bad row is a DataError naming the file and
row. The dataset version hashes the records plus the options, and for chat
rows the template and tokenizer that rendered them, so a changed template
or tokenizer is a changed dataset.

What this is not: a tokenizer. Token counts are the rollout's business.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlctl import DataError, PromptRecord, Split, TaskData
from rlctl_tasks.arith import dataset_version


class RowOptions(BaseModel):
    """Options shared by the file-backed sources (one file per split)."""

    model_config = ConfigDict(extra="forbid")

    train: str = Field(description="Path of the train file.")
    dev: str = Field(description="Path of the dev file.")
    hidden: str = Field(description="Path of the hidden-test file.")
    prompt_key: str = Field("prompt", description="Field/column holding the prompt text.")
    answer_key: str = Field("answer", description="Field/column holding the reference answer.")
    messages_key: str | None = Field(
        None, description="Field/column holding chat messages (a list of {role, content}); when set, the prompt "
        "is these messages rendered with the tokenizer's chat template, and prompt_key is not read.")
    chat_template: str | None = Field(
        None, description="Jinja chat template used instead of the tokenizer's own (needed for the built-in "
        "character tokenizer, which has none).")
    tokenizer: str | None = Field(
        None, description="Directory of the HF tokenizer whose chat template renders messages; defaults to "
        "model.path (the built-in model's character tokenizer when unset).")
    answer_pattern: str | None = Field(
        None, description="Regex applied to the answer field; its first group (or the whole match) becomes "
        "the reference answer, e.g. '####\\s*(-?[\\d,.]+)' for GSM8K. A row it does not match is an error.")
    max_prompt_chars: int = Field(4096, ge=1, description="Longer prompts are an error.")

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"answer_pattern is not a valid regex ({err})") from None
        return value


class ChatRenderer:
    """Renders chat messages with one tokenizer's template; knows the hashes that version the result."""

    def __init__(self, options: RowOptions) -> None:
        from rlctl.kit import build_char_tokenizer, tokenizer_hash

        if options.tokenizer is None:
            self.tokenizer = build_char_tokenizer()
            self.where = "the built-in character tokenizer"
            self.tokenizer_hash = "builtin-" + hashlib.sha256(
                self.tokenizer.backend_tokenizer.to_str().encode()).hexdigest()[:16]
        else:
            from transformers import AutoTokenizer

            path = Path(options.tokenizer)
            if not path.is_dir():
                raise DataError(f"tokenizer directory not found: {path}", "set task.options.tokenizer or model.path "
                                "to a directory holding tokenizer files")
            try:
                self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            except (OSError, ValueError) as err:
                raise DataError(f"cannot load the tokenizer in {path}: {err}",
                                "point task.options.tokenizer at an HF tokenizer directory") from None
            self.where = f"the tokenizer in {path}"
            self.tokenizer_hash = tokenizer_hash(path)
        self.template = options.chat_template or getattr(self.tokenizer, "chat_template", None)
        if not self.template:
            raise DataError(f"{self.where} has no chat template, so chat rows (task.options.messages_key="
                            f"{options.messages_key!r}) cannot be rendered",
                            "set task.options.chat_template to a Jinja template, or use a tokenizer that has one")
        self.template_hash = hashlib.sha256(self.template.encode()).hexdigest()[:16]

    def render(self, messages: Any, where: str) -> str:
        if (not isinstance(messages, list) or not messages
                or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                           for m in messages)):
            raise DataError(f"{where}: chat messages must be a non-empty list of {{'role': str, 'content': str}}",
                            "fix the row's messages or drop the row")
        try:
            text = self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                      chat_template=self.template, tokenize=False,
                                                      add_generation_prompt=True)
        except Exception as err:  # a Jinja error in a user template, or a template that rejects the roles
            raise DataError(f"{where}: the chat template failed on this row ({type(err).__name__}: {err})",
                            "fix the messages or task.options.chat_template") from None
        return text


class RowReader:
    """Checks rows of one source and turns them into records; ``version`` hashes the lot."""

    def __init__(self, name: str, options: RowOptions) -> None:
        self.name, self.options = name, options
        self.chat = ChatRenderer(options) if options.messages_key else None
        self.pattern = re.compile(options.answer_pattern) if options.answer_pattern else None
        self.prompt_column = options.messages_key or options.prompt_key

    @property
    def columns(self) -> list[str]:
        """The columns a row must have."""
        return [self.prompt_column, self.options.answer_key]

    def table(self, source: str, column_names: Sequence[str], read: Callable[[list[str]], Iterable[Any]],
              split: Split) -> tuple[PromptRecord, ...]:
        """Records of one split stored as a table: its columns are checked, then ``read(columns)`` gives its rows
        (dicts of those columns). ``source`` names the table in errors; rows are numbered from 1."""
        missing = [c for c in self.columns if c not in column_names]
        if missing:
            raise DataError(f"{source}: no column(s) {', '.join(map(repr, missing))} (it has {list(column_names)})",
                            "map the columns with task.options.prompt_key / answer_key / messages_key")
        records = tuple(self.record(row, f"{source} row {i}", split, f"{split.value}-{i}")
                        for i, row in enumerate(read(self.columns), start=1))
        if not records:
            raise DataError(f"{source} has no rows", f"the {split.value} split needs at least one prompt")
        return records

    def record(self, row: Any, where: str, split: Split, rid: str) -> PromptRecord:
        opts = self.options
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object/record, got {type(row).__name__}", "one record per row")
        key = self.prompt_column
        value = row.get(key)
        if key not in row or (self.chat is None and (not isinstance(value, str) or not value.strip())):
            what = "the chat messages" if self.chat is not None else "the prompt"
            raise DataError(f"{where}: row has no non-empty {key!r}", f"add {what} or drop the row")
        prompt = self.chat.render(value, where) if self.chat is not None else value
        answer = row.get(opts.answer_key)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise DataError(f"{where}: row has no {opts.answer_key!r}", "add the reference answer or drop the row")
        answer = str(answer)
        if self.pattern is not None:
            match = self.pattern.search(answer)
            if match is None:
                raise DataError(f"{where}: answer_pattern {opts.answer_pattern!r} does not match {answer[-60:]!r}",
                                "fix the row or task.options.answer_pattern")
            answer = (match.group(1) if match.groups() else match.group(0)).strip()
            if not answer:
                raise DataError(f"{where}: answer_pattern extracted an empty answer", "fix the row or the pattern")
        if len(prompt) > opts.max_prompt_chars:
            raise DataError(f"{where}: prompt is {len(prompt)} chars, over max_prompt_chars={opts.max_prompt_chars}",
                            "shorten it or raise task.options.max_prompt_chars")
        return PromptRecord(id=rid, text=prompt, answer=answer, split=split)

    def task(self, records: dict[Split, tuple[PromptRecord, ...]]) -> TaskData:
        """Refuse hidden prompts leaked into train/dev; name the content with its version."""
        seen = {r.text for r in records[Split.TRAIN]} | {r.text for r in records[Split.DEV]}
        leaked = [r for r in records[Split.HIDDEN] if r.text in seen]
        if leaked:
            raise DataError(
                f"{len(leaked)} hidden prompt(s) also appear in train or dev (first: {leaked[0].text[:60]!r})",
                "remove them from one split: the hidden split must be held out",
            )
        # The tokenizer's path is not content (the same files elsewhere are the same data); its hash is.
        # Unset options are left out so adding an option does not re-version existing datasets.
        versioned = self.options.model_dump(exclude={"tokenizer"}, exclude_none=True)
        if self.chat is not None:
            versioned["chat"] = {"template": self.chat.template_hash, "tokenizer": self.chat.tokenizer_hash}
        version = dataset_version(self.name, versioned, records)
        return TaskData(name=self.name, version=version, train=records[Split.TRAIN],
                        dev=records[Split.DEV], hidden=records[Split.HIDDEN])
