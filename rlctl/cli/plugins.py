"""``rlctl plugins``: what is installed and what each plugin registers."""

from __future__ import annotations

import typer

from rlctl.cli import _output
from rlctl.cli._options import JsonOpt

app = typer.Typer(help="Installed rlctl plugins.", invoke_without_command=True)


@app.callback()
def plugins(ctx: typer.Context, json_out: bool = JsonOpt) -> None:
    """List plugins: name, package, version, what each registers, and its hooks."""
    if ctx.invoked_subcommand is None:
        show(json_out)


@app.command("list")
def list_cmd(json_out: bool = JsonOpt) -> None:
    """List plugins (same as `rlctl plugins`)."""
    show(json_out)


def show(json_out: bool) -> None:
    from rlctl.hooks.manager import load_plugins

    infos = load_plugins().infos()
    if json_out:
        _output.print_json({"plugins": infos})
        return
    rows = [(p.name, p.distribution, p.version, "yes" if p.builtin else "no",
             "; ".join(f"{kind}: {', '.join(names)}" for kind, names in p.registers.items()),
             ", ".join(p.hooks)) for p in infos]
    _output.console.print(_output.table(None, ["plugin", "package", "version", "built-in", "registers", "hooks"], rows))
