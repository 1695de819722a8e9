"""A task from a local Hugging Face ``datasets`` directory (written by ``save_to_disk``), e.g. GSM8K.

What this is: a TaskSource reading with ``datasets.load_from_disk`` (the
``data`` extra), with the same column mapping, chat rendering and answer
extraction as the JSONL and Parquet sources (rlctl_tasks.rows). Either
``path`` is a ``DatasetDict`` directory and ``train`` / ``dev`` / ``hidden``
name its splits, or ``path`` is unset and each of them is the directory of
one saved ``Dataset``. A split name may carry a row slice, ``train[:-500]``
and ``train[-500:]``, so a dataset published with only train and test still
gets a dev split (the hidden split must not overlap the others: checked).
A bad row is an error naming the directory, split and row (1-based).

What this is not: a downloader. ``load_dataset("gsm8k", ...)`` and
``save_to_disk`` happen wherever a network is; this only reads the result.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator

from rlctl import DataError, PromptRecord, Split, TaskData
from rlctl_tasks.rows import RowOptions, RowReader

_SPLIT = re.compile(r"^(?P<name>[^\[\]]+?)(?:\[(?P<start>-?\d*):(?P<stop>-?\d*)\])?$")
_HINT_WRITE = "write it with datasets' Dataset.save_to_disk or DatasetDict.save_to_disk"


class HfDiskOptions(RowOptions):
    path: str | None = Field(
        None, description="Directory written by DatasetDict.save_to_disk; train/dev/hidden then name its splits. "
        "Unset: train/dev/hidden are directories written by Dataset.save_to_disk.")
    train: str = Field("train", description="Split of `path` (optionally sliced: 'train[:-500]'), or a Dataset "
                       "directory when path is unset.")
    dev: str = Field("validation", description="Split of `path` (e.g. 'train[-500:]' when the dataset has no "
                     "validation split), or a Dataset directory when path is unset.")
    hidden: str = Field("test", description="Split of `path`, or a Dataset directory when path is unset.")

    @field_validator("train", "dev", "hidden")
    @classmethod
    def _split_syntax(cls, value: str) -> str:
        if not value.strip() or ("[" in value and _SPLIT.match(value) is None):
            raise ValueError(f"{value!r} is not a split name or 'name[start:stop]' with integer bounds")
        return value


class HfDiskTask:
    def __init__(self, options: HfDiskOptions, seed: int = 0) -> None:
        self.options = options

    def load(self) -> TaskData:
        try:
            import datasets
        except ImportError:
            raise DataError("task source 'hf_disk' needs the datasets package, which is not installed",
                            "pip install 'rlctl[data]'") from None
        reader = RowReader("hf_disk", self.options)
        whole = self._open(datasets, Path(self.options.path), "task.options.path") if self.options.path else None
        return reader.task({split: self._read(datasets, whole, split, reader) for split in Split})

    def _open(self, datasets: Any, path: Path, option: str) -> Any:
        if not path.is_dir():
            raise DataError(f"datasets directory not found: {path}", f"set {option} to a directory written by "
                            "save_to_disk")
        try:
            return datasets.load_from_disk(str(path))
        except FileNotFoundError:
            raise DataError(f"{path} is not a directory written by save_to_disk (no dataset_dict.json or "
                            "state.json)", _HINT_WRITE) from None
        except Exception as err:  # noqa: BLE001 - a corrupt arrow file, a bad state.json: one clear line
            raise DataError(f"{path}: cannot load the saved dataset ({type(err).__name__}: {str(err)[:200]})",
                            _HINT_WRITE) from None

    def _read(self, datasets: Any, whole: Any, split: Split, reader: RowReader) -> tuple[PromptRecord, ...]:
        spec = getattr(self.options, split.value)
        match = _SPLIT.match(spec)
        name = match.group("name") if match else spec
        if whole is None:
            table = self._open(datasets, Path(name), f"task.options.{split.value}")
            if isinstance(table, datasets.DatasetDict):
                raise DataError(f"{name} holds a DatasetDict (splits {', '.join(table)}), not one Dataset",
                                f"set task.options.path={name} and name its splits in train/dev/hidden")
            source = name
        else:
            if not isinstance(whole, datasets.DatasetDict):
                raise DataError(f"{self.options.path} holds one Dataset, not a DatasetDict with splits",
                                "unset task.options.path and give each split's Dataset directory in train/dev/hidden")
            if name not in whole:
                raise DataError(f"{self.options.path} has no split {name!r} (it has: {', '.join(whole)})",
                                f"set task.options.{split.value} to one of them, or a slice such as 'train[-500:]'")
            table, source = whole[name], f"{self.options.path} split {name}"
        if match and match.group("start") is not None:
            start, stop = (int(v) if v not in ("", None) else None for v in (match.group("start"),
                                                                             match.group("stop")))
            rows = range(len(table))[slice(start, stop)]
            table = table.select(rows)
            source = f"{source}[{match.group('start')}:{match.group('stop')}]"
        return reader.table(source, table.column_names, lambda columns: table.select_columns(columns).to_list(),
                            split)
