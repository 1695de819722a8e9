"""Registry schema revisions, oldest first by ``down_revision`` chain (loaded by Alembic, not imported)."""
