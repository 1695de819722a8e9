"""Engine construction and schema migration for the run registry.

What this is: the one place that turns a registry URL into a SQLAlchemy engine
(SQLite pragmas, PostgreSQL driver choice), the one function that reads the
environment (``default_url``), and the Alembic upgrade that runs on open.
Concurrent first opens are serialised: an fcntl lock file next to a SQLite
database, ``pg_advisory_xact_lock`` on PostgreSQL.

What this is not: queries (store.py) or table definitions (tables.py). Only
SQLite and PostgreSQL (through psycopg 3) are supported backends.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import time
from pathlib import Path
from typing import Any, Iterator

from sqlalchemy import Engine, create_engine, event, exc, func, select
from sqlalchemy.engine import URL, make_url

from rlctl.contracts.errors import RegistryError

MIGRATIONS_DIR = Path(__file__).with_name("migrations")
URL_HINT = "check RLCTL_REGISTRY_URL (sqlite:///PATH or postgresql+psycopg://USER@HOST/DB)"
# Sessions bound with this execution option start SQLite transactions with
# BEGIN IMMEDIATE, so a writer takes the write lock up front and waits on
# busy_timeout instead of failing later on a lock upgrade.
IMMEDIATE = "rlctl_sqlite_immediate"
_PG_MIGRATION_LOCK = 0x726C6374  # "rlct": advisory lock key for migrations


def default_url() -> str:
    """The registry URL: ``$RLCTL_REGISTRY_URL``, else ``$RLCTL_HOME/registry.db``.

    ``RLCTL_HOME`` defaults to ``~/.rlctl``. This is the only function in the
    registry that reads the environment.
    """
    url = os.environ.get("RLCTL_REGISTRY_URL", "").strip()
    if url:
        return url
    home = Path(os.environ.get("RLCTL_HOME") or "~/.rlctl").expanduser().resolve()
    return f"sqlite:///{home / 'registry.db'}"


def display_url(url: str | URL) -> str:
    """``url`` with any password masked, for messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except exc.ArgumentError:
        return "<unparseable URL>"


def open_engine(url: str, *, busy_timeout_s: float = 30.0) -> Engine:
    """Create an engine for ``url`` without connecting or migrating.

    SQLite connections get ``foreign_keys=ON``, WAL journaling and a busy
    timeout of ``busy_timeout_s``; the database's parent directory is created.
    ``postgresql://`` and ``postgres://`` URLs use the psycopg 3 driver.
    """
    try:
        parsed = make_url(url)
    except exc.ArgumentError as err:
        raise RegistryError(f"registry URL {url!r} is not a database URL: {err}", hint=URL_HINT) from err
    backend = parsed.get_backend_name()
    if backend == "postgres" or parsed.drivername == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
        backend = "postgresql"
    if backend not in ("sqlite", "postgresql"):
        raise RegistryError(
            f"registry URL {display_url(parsed)} uses backend {backend!r}; only SQLite and PostgreSQL are supported",
            hint=URL_HINT,
        )
    serializer = functools.partial(json.dumps, allow_nan=False)
    try:
        if backend == "postgresql":
            return create_engine(parsed, pool_pre_ping=True, json_serializer=serializer)
        if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
            Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, json_serializer=serializer)
    except (ImportError, exc.ArgumentError, OSError) as err:
        raise RegistryError(f"cannot open registry at {display_url(parsed)}: {err}", hint=URL_HINT) from err
    _install_sqlite_hooks(engine, busy_timeout_ms=int(busy_timeout_s * 1000))
    return engine


def _install_sqlite_hooks(engine: Engine, *, busy_timeout_ms: int) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn: Any, _record: Any) -> None:
        # Let SQLAlchemy's "begin" hook below emit BEGIN instead of pysqlite.
        dbapi_conn.isolation_level = None
        cursor = dbapi_conn.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_timeout_ms}")
            cursor.execute("PRAGMA foreign_keys = ON")
            _use_wal(cursor, deadline=time.monotonic() + busy_timeout_ms / 1000)
            cursor.execute("PRAGMA synchronous = NORMAL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        immediate = conn.get_execution_options().get(IMMEDIATE, False)
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _use_wal(cursor: Any, *, deadline: float) -> None:
    """Switch to WAL (persistent in the file). Retried: SQLite reports a lock here without waiting."""
    import sqlite3

    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0].lower() not in ("wal", "memory"):
                cursor.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as err:
            if "locked" not in str(err).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.01 + 0.04 * random.random())


def upgrade(url: str) -> None:
    """Bring the registry schema at ``url`` to the newest revision (``rlctl registry upgrade``)."""
    engine = open_engine(url)
    try:
        migrate(engine)
    finally:
        engine.dispose()


def migrate(engine: Engine) -> None:
    """Apply pending Alembic migrations to ``engine``; safe to call from many processes at once."""
    from alembic import command

    config = _alembic_config()
    where = display_url(engine.url)
    try:
        if _at_head(engine, config):
            return
        with _migration_lock(engine):
            with engine.execution_options(**{IMMEDIATE: True}).begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(select(func.pg_advisory_xact_lock(_PG_MIGRATION_LOCK)))
                config.attributes["connection"] = conn
                command.upgrade(config, "head")
    except exc.DBAPIError as err:
        raise RegistryError(f"cannot open registry at {where}: {err.orig}", hint=URL_HINT) from err
    except OSError as err:
        raise RegistryError(f"cannot lock registry at {where} for migration: {err}", hint=URL_HINT) from err


def _alembic_config() -> Any:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("path_separator", "os")
    return config


def _at_head(engine: Engine, config: Any) -> bool:
    """True when the schema is current; RegistryError when it is newer than this rlctl."""
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory
    from alembic.util import CommandError

    script = ScriptDirectory.from_config(config)
    with engine.connect() as conn:
        current = set(MigrationContext.configure(conn).get_current_heads())
    for revision in current:
        try:
            script.get_revision(revision)
        except CommandError as err:
            raise RegistryError(
                f"registry at {display_url(engine.url)} has schema revision {revision!r}, "
                "which this rlctl does not know: it was written by a newer rlctl",
                hint="upgrade rlctl, or point RLCTL_REGISTRY_URL at another registry",
            ) from err
    return current == set(script.get_heads())


@contextlib.contextmanager
def _migration_lock(engine: Engine) -> Iterator[None]:
    """An exclusive fcntl lock on ``<db>.lock`` for file SQLite; nothing otherwise."""
    database = engine.url.database
    if engine.dialect.name != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    import fcntl

    with open(f"{Path(database).expanduser()}.lock", "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
