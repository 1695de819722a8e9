"""The code stays readable in pieces: every module of rlctl/ under 500 lines, every function under 60.

Generated Alembic migrations are excepted (they are data, written once). A
limit that is hit is a prompt to split by concern, not to squeeze lines.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 60
EXCEPT = ("rlctl/registry/migrations/versions/",)


def _modules() -> list[Path]:
    return [p for p in sorted((REPO / "rlctl").rglob("*.py"))
            if not any(str(p.relative_to(REPO)).startswith(e) for e in EXCEPT)]


def test_every_module_is_at_most_500_lines() -> None:
    long = [f"{p.relative_to(REPO)}: {n} lines" for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, "split these by concern:\n" + "\n".join(long)


def test_every_function_is_at_most_60_lines() -> None:
    long = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {n} lines")
    assert not long, "split these:\n" + "\n".join(long)
