"""``rlctl reward check GOLDEN.jsonl``: replay golden (prompt, response, expected reward) rows through the graders."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt

app = typer.Typer(no_args_is_help=True, help="Grader regression checks.")


@app.command("check")
def check(golden: Path = typer.Argument(..., help="Golden JSONL file: a header with each grader's version and "
                                        "options, then one row per (prompt, response, answer, expected)."),
          components: Optional[str] = typer.Option(None, "--components", help="Only these graders, e.g. "
                                                   "math,format (default: every grader the file has rows for)."),
          config: Optional[Path] = typer.Option(None, "--config", help="Build the graders this config names with "
                                                "its options (default: the options stored in the file)."),
          update: bool = typer.Option(False, "--update", help="Rewrite the file's expected values and grader "
                                      "versions from the graders as they are now (review the diff)."),
          json_out: bool = JsonOpt) -> None:
    """Fail (exit 1) on any row whose reward differs, naming the row, and name graders whose version changed."""
    from rlctl.config.load import load_config
    from rlctl.contracts.errors import DataError
    from rlctl.hooks.manager import load_plugins
    from rlctl.lifecycle.reward_check import check_golden, update_golden

    cfg = load_config(config) if config is not None else None
    if update:
        count = update_golden(golden, load_plugins(), cfg)
        _output.console.print(f"rewrote {count} rows of {golden}")
        return
    names = [c.strip() for c in components.split(",") if c.strip()] if components else None
    result = check_golden(golden, load_plugins(), cfg, names)
    if json_out:
        _output.print_json({"rows": result.rows, "mismatches": [m.__dict__ for m in result.mismatches],
                            "versions": result.versions, "changed_versions": result.changed})
    else:
        rows = [(n, old, now, "changed" if old != now else "same") for n, (old, now) in sorted(result.versions.items())]
        _output.console.print(_output.table(f"graders of {golden}", ["grader", "golden version", "version now", ""],
                                            rows))
    changed = "; ".join(f"grader {n} changed version since the golden file was made: {old} -> {now}"
                        for n, (old, now) in sorted(result.changed.items()))
    if result.mismatches:
        listed = "; ".join(m.describe() for m in result.mismatches[:10])
        more = f" (and {len(result.mismatches) - 10} more)" if len(result.mismatches) > 10 else ""
        raise DataError(f"{len(result.mismatches)} of {result.rows} golden rows of {golden} differ: {listed}{more}"
                        + (f". {changed}" if changed else ""),
                        "fix the grader, or if the change is intended, regenerate with "
                        f"`rlctl reward check {golden} --update` and review the diff")
    if not json_out:
        _output.console.print(f"{result.rows} rows match" + (f"; note: {changed}" if changed else ""))
