"""Render the table of rlctl.kit's names for docs/plugins.md, from the kit itself, so the page stays true.

What this is: ``table()`` builds one Markdown table per group of
``rlctl.kit``'s names (name, the module that defines it, the first paragraph
of its docstring); ``python scripts/kit_table.py --write`` puts it between the
``kit-table`` markers of docs/plugins.md, and without ``--write`` it prints it.
tests/unit/test_kit.py fails when the page and the kit disagree.

What this is not: API reference. The docstrings at each name's definition are that.

Usage: OMP_NUM_THREADS=1 python scripts/kit_table.py [--write]
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

PAGE = Path(__file__).resolve().parents[1] / "docs" / "plugins.md"
START, END = "<!-- kit-table:start (scripts/kit_table.py --write) -->", "<!-- kit-table:end -->"


def summary(obj: object) -> str:
    """The first paragraph of ``obj``'s own docstring on one line, safe inside a Markdown table cell."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    first = inspect.cleandoc(doc or "").split("\n\n")[0]
    return re.sub(r"\s+", " ", first).replace("``", "`").replace("|", "\\|")


def table() -> str:
    """One Markdown table per kit group (name, defining module, summary), in the kit's order."""
    import rlctl.kit as kit

    out = []
    for group, homes in kit._GROUPS.items():  # the kit's own grouping (private, read here on purpose)
        out += [f"**{group}**", "", "| name | defined in | what it is |", "|---|---|---|"]
        for home, names in homes.items():
            for name in names:
                obj = getattr(kit, name)
                where = obj.__name__ if inspect.ismodule(obj) else home
                out.append(f"| `{name}` | `{where}` | {summary(obj)} |")
        out.append("")
    return "\n".join(out)


def replaced(page: str, body: str) -> str:
    """``page`` with the text between the markers replaced by ``body``."""
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{body}{END}{tail}"


def current(page: str) -> str:
    """The table as it stands between the markers of ``page``."""
    return page.split(START, 1)[1].split(END, 1)[0].lstrip("\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the table in {PAGE.name}")
    args = parser.parse_args(argv)
    body = table()
    if not args.write:
        sys.stdout.write(body)
        return 0
    PAGE.write_text(replaced(PAGE.read_text(), body))
    print(f"wrote {sum(line.startswith('| `') for line in body.splitlines())} names into {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
