"""Alembic environment for the run registry.

What this is: the online migration entry point. db.migrate() opens the
connection (and takes the migration lock) and hands it over in
``config.attributes["connection"]``; this file only configures the context.

What this is not: a command-line setup. There is no alembic.ini, no URL here
and no offline (SQL script) mode.
"""

from alembic import context

from rlctl.registry.tables import Base

connection = context.config.attributes.get("connection")
if connection is None or context.is_offline_mode():
    raise RuntimeError("registry migrations run only through rlctl.registry.db.migrate()")

context.configure(
    connection=connection,
    target_metadata=Base.metadata,
    render_as_batch=connection.dialect.name == "sqlite",
)
with context.begin_transaction():
    context.run_migrations()
