"""Options shared by several commands, and the helpers that resolve them."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON instead of tables.")
RegistryOpt = typer.Option(None, "--registry", help="SQLAlchemy URL of the registry (default: RLCTL_REGISTRY_URL or "
                           "sqlite under RLCTL_HOME).")


def rlctl_home() -> Path:
    """RLCTL_HOME (default ~/.rlctl): the registry, caches and run directories live here."""
    return Path(os.environ.get("RLCTL_HOME", "~/.rlctl")).expanduser()


def open_registry(url: Optional[str]):
    from rlctl.registry.store import Registry

    return Registry.open(url)
