"""A task from Parquet files (one per split), e.g. GSM8K as published on the Hub.

What this is: a TaskSource reading Parquet with pyarrow (the ``data`` extra),
with the same column mapping, chat rendering and answer extraction as the
JSONL source (rlctl_tasks.rows). A bad row is an error naming the file and
row number (1-based, in file order).

What this is not: a streaming reader; a split is read whole at startup.
"""

from __future__ import annotations

from pathlib import Path

from rlctl import DataError, PromptRecord, Split, TaskData
from rlctl_tasks.rows import RowOptions, RowReader


class ParquetOptions(RowOptions):
    pass


class ParquetTask:
    def __init__(self, options: ParquetOptions, seed: int = 0) -> None:
        self.options = options

    def load(self) -> TaskData:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError("task source 'parquet' needs pyarrow, which is not installed",
                            "pip install 'rlctl[data]'") from None
        reader = RowReader("parquet", self.options)
        return reader.task({split: self._read(pq, Path(getattr(self.options, split.value)), split, reader)
                            for split in Split})

    def _read(self, pq, path: Path, split: Split, reader: RowReader) -> tuple[PromptRecord, ...]:
        import pyarrow as pa

        if not path.is_file():
            raise DataError(f"task file for split {split.value} not found: {path}", f"set task.options.{split.value}")
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as err:
            raise DataError(f"{path}: not a readable Parquet file ({err})", "write the split with pyarrow/pandas "
                            "to_parquet") from None
        return reader.table(str(path), table.column_names, lambda columns: table.select(columns).to_pylist(), split)
