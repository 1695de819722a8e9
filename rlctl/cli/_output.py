"""Rendering helpers shared by commands: JSON for machines, rich tables for people."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
from typing import Any, Iterable, Iterator, Sequence

from rich.console import Console
from rich.table import Table
from rich.text import Text

console = Console(width=160) if not sys.stdout.isatty() else Console()
err_console = Console(stderr=True)


def to_jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if hasattr(obj, "value") and obj.__class__.__module__.startswith("rlctl"):
        return obj.value
    return obj


_json_out: Any = None  # the real stdout while json_only_stdout() is active


@contextlib.contextmanager
def json_only_stdout() -> Iterator[None]:
    """For ``--json``: stdout carries the JSON document and nothing else. Whatever else writes to stdout meanwhile
    goes to stderr (e.g. deepspeed's logger, which transformers imports when saving a model and which logs its
    accelerator warning to stdout)."""
    global _json_out
    saved, _json_out = sys.stdout, sys.stdout
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout, _json_out = saved, None


def print_json(obj: Any) -> None:
    out = _json_out or sys.stdout
    out.write(json.dumps(to_jsonable(obj), indent=2, sort_keys=True, default=str) + "\n")
    out.flush()


def table(title: str | None, columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    t = Table(title=title, title_justify="left")
    for col in columns:
        t.add_column(col)
    for row in rows:
        t.add_row(*[Text(fmt(v)) for v in row])  # cells are data, never markup: "[offloaded]" must print as is
    return t


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
