"""An append-only JSON-lines file with one line per step that a re-run step replaces.

What this is: ``StepLines``, what the JSONL metric sink (metrics.jsonl) and the
run's sample log (samples.jsonl) write through: each ``write(step, body)``
appends ``body`` (a JSON object holding ``"step"``) as one line and flushes it,
so a crash loses at most the line being written; when a resumed run (or a NaN
rollback inside one process) writes step s again, the lines for steps >= s
left by the earlier attempt are cut off first, so the file never holds a step
twice; a torn last line from a crash is always cut. ``complete_lines`` reads
such a file while it may be written (or after a crash): only lines that end
in a newline.

What this is not: what the lines mean (the writers').
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

_TORN = 2**62  # sorts after every real step, so the next write cuts a torn line


class StepLines:
    """A JSON-lines file of one line per step, appended and flushed line by line; a re-run step replaces its line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._earlier = _line_offsets(self.path)  # [(byte offset, step)] of lines already there
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, step: int, body: Mapping[str, Any]) -> None:
        """Append ``body`` (with ``"step": step``) as one line, after cutting any line of a step >= ``step``."""
        cut = next((offset for offset, seen in self._earlier if seen >= step), None)
        if cut is not None:  # a re-run step (resume, or a rollback inside this process)
            self._fh.truncate(cut)
            self._fh.seek(cut)
            self._earlier = [(offset, seen) for offset, seen in self._earlier if offset < cut]
        offset = self._fh.tell()
        self._fh.write(json.dumps({**body, "step": step}, sort_keys=True) + "\n")
        self._fh.flush()
        self._earlier.append((offset, step))

    def close(self) -> None:
        self._fh.close()


def _line_offsets(path: Path) -> list[tuple[int, int]]:
    if not path.is_file():
        return []
    out, offset = [], 0
    with path.open("rb") as fh:
        for raw in fh:
            try:
                out.append((offset, int(json.loads(raw)["step"])))
            except (ValueError, KeyError, TypeError):  # a torn last line from a crash: always cut
                out.append((offset, _TORN))
                break
            offset += len(raw)
    return out


def complete_lines(path: str | Path) -> list[dict[str, Any]]:
    """The JSON objects of ``path``'s newline-terminated lines (none if it does not exist). A last line without
    its newline is being written now, or was torn by a crash, and is left out."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
