"""The run registry: every run's provenance, metrics, events and evals in SQL.

What this is: ``Registry`` (store.py), opened on SQLite by default
(``$RLCTL_HOME/registry.db``) or PostgreSQL (``$RLCTL_REGISTRY_URL``), with
the schema migrated by Alembic on open; ``default_url`` and ``upgrade`` for
the CLI.

What this is not: checkpoint storage or anything the training loop imports;
the engine talks to the registry only through the driver and CLI.
"""

from rlctl.registry.db import default_url, upgrade
from rlctl.registry.store import Registry

__all__ = ["Registry", "default_url", "upgrade"]
