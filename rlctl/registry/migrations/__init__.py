"""Alembic migrations of the run registry, shipped inside the package.

What this is: env.py, the revision template and versions/; db.migrate() runs
them programmatically, so users need no alembic.ini.

What this is not: importable code. Alembic loads these files by path. A
shipped revision is never edited; schema changes add a new revision.
"""
