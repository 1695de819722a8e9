"""Table cells are data: square brackets in them (ledger formulas, run names, messages) print literally."""

from __future__ import annotations

from rich.console import Console

from rlctl.cli import _output


def test_table_cells_are_not_rich_markup():
    console = Console(width=200, record=True, color_system=None)
    console.print(_output.table("t", ["term", "formula"], [("optimizer", "P x 8B / 1 [offloaded]"), ("x", "[bold]y[/]")]))
    text = console.export_text()
    assert "P x 8B / 1 [offloaded]" in text and "[bold]y[/]" in text
