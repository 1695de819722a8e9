"""``rlctl registry upgrade|where``: the registry database itself."""

from __future__ import annotations

from typing import Optional

import typer

from rlctl.cli import _output
from rlctl.cli._options import RegistryOpt

app = typer.Typer(help="The run registry database.", no_args_is_help=True)


@app.command("upgrade")
def upgrade(registry: Optional[str] = RegistryOpt) -> None:
    """Apply schema migrations (they also run automatically whenever the registry opens)."""
    from rlctl.registry.db import default_url, display_url
    from rlctl.registry.db import upgrade as run_upgrade

    url = registry or default_url()
    run_upgrade(url)
    _output.console.print(f"registry at {display_url(url)} is at the newest schema")


@app.command("where")
def where(registry: Optional[str] = RegistryOpt) -> None:
    """Print the registry URL in use (password hidden)."""
    from rlctl.registry.db import default_url, display_url

    _output.console.print(display_url(registry or default_url()))
