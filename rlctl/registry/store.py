"""The run registry's read/write API: runs, metrics, events and evals.

What this is: ``Registry``, a small facade over the ORM tables that takes and
returns the contract dataclasses (RunRecord, MetricPoint, EventRecord,
EvalRecord, CheckpointRecord); ORM objects never leave this module. Each method is one short
transaction. SQLite lock contention is retried with backoff on top of
busy_timeout; a dropped PostgreSQL connection is retried once for idempotent
writes (run creation, run updates, metric upserts) and surfaces as
RegistryError otherwise.

Checkpoints: the checkpoints table is an index of committed checkpoint
directories. A row is added only after the directory's manifest is committed
and removed when retention deletes it; the directory is the truth, and a
resume reconciles the rows with it (rlctl.lifecycle.resume).

What this is not: the checkpoint store itself (rlctl.engine.checkpoint),
schema management (db.py, migrations/) or rendering.

Non-finite metrics: PostgreSQL stores NaN and +/-inf as-is. SQLite stores
+/-inf but turns NaN into NULL, so on SQLite a NaN metric is not written (an
existing row for that step and name is removed) and a ``metric_nonfinite``
event records it instead. JSON payloads (config, event data, eval details)
are stored with non-finite floats replaced by the strings "nan"/"inf"/"-inf".
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import secrets
import time
from typing import Any, Callable, Iterable, Mapping, TypeVar

from sqlalchemy import Engine, delete, exc, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session, sessionmaker

from rlctl.contracts.errors import RegistryError
from rlctl.contracts.types import EvalRecord, EventRecord, MetricPoint, RunRecord
from rlctl.contracts.checkpoints import CheckpointRecord
from rlctl.registry.db import IMMEDIATE, URL_HINT, default_url, display_url, migrate, open_engine
from rlctl.registry.tables import Checkpoint, Eval, Event, Metric, Run

T = TypeVar("T")
_EVAL_FIELDS = tuple(f.name for f in dataclasses.fields(EvalRecord))
RUNS_HINT = "run `rlctl runs list` to see run ids"
_LOCK_RETRIES = 6
_LOCK_BACKOFF_S = 0.05


class Registry:
    """Runs and their metrics, events and evals in a SQL database.

    Build with ``Registry.open(url)``, which migrates the schema first. Use as
    a context manager or call ``close()``.
    """

    def __init__(self, engine: Engine) -> None:
        self.url = display_url(engine.url)
        self._engine = engine
        self._dialect = engine.dialect.name
        self._read = sessionmaker(engine, expire_on_commit=False)
        self._write = sessionmaker(engine.execution_options(**{IMMEDIATE: True}), expire_on_commit=False)
        self._insert = postgresql.insert if self._dialect == "postgresql" else sqlite.insert

    @classmethod
    def open(cls, url: str | None = None) -> "Registry":
        """Open (and migrate) the registry at ``url``; None means ``default_url()``."""
        engine = open_engine(url or default_url())
        try:
            migrate(engine)
        except BaseException:
            engine.dispose()
            raise
        return cls(engine)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- runs -------------------------------------------------------------

    def create_run(
        self,
        *,
        name: str,
        config: Mapping[str, Any],
        config_hash: str,
        code_version: str,
        dataset_version: str | None,
        tokenizer_hash: str | None,
        seed: int,
        run_dir: str,
        status: str = "running",
    ) -> RunRecord:
        """Insert a new run with id ``YYYYmmdd-HHMMSS-xxxxxx`` (UTC time plus 6 random hex chars)."""
        if not name:
            raise ValueError("create_run: name must be a non-empty string")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"create_run: seed must be an int, got {seed!r}")
        now = time.time()
        values = dict(
            name=name, status=status, config=_json_safe(dict(config), "config"), config_hash=config_hash,
            code_version=code_version, dataset_version=dataset_version, tokenizer_hash=tokenizer_hash,
            seed=seed, run_dir=str(run_dir), error=None, created_at=now, updated_at=now,
        )
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))

        def insert(s: Session) -> RunRecord:
            # ON CONFLICT DO NOTHING makes a retry after a dropped connection
            # idempotent: if our first attempt committed, we find our own row.
            for _ in range(8):
                run_id = f"{stamp}-{secrets.token_hex(3)}"
                stmt = self._insert(Run).values(id=run_id, **values).on_conflict_do_nothing(index_elements=["id"])
                s.execute(stmt)
                row = s.get(Run, run_id)
                assert row is not None
                if (row.created_at, row.run_dir, row.config_hash) == (now, values["run_dir"], config_hash):
                    return _run_record(row)
            raise RegistryError(f"could not allocate a unique run id for {name!r}", hint="try again")

        return self._tx("create run", insert, write=True, idempotent=True)

    def update_run(
        self,
        run_id: str,
        *,
        status: str | None = None,
        dataset_version: str | None = None,
        tokenizer_hash: str | None = None,
        error: str | None = None,
        run_dir: str | None = None,
        clear_error: bool = False,
    ) -> RunRecord:
        """Set the given fields (None leaves a field as it is) and bump ``updated_at``.

        ``clear_error`` sets ``error`` back to NULL (a resumed run is no longer failed).
        """
        changes: dict[str, Any] = {
            k: v
            for k, v in dict(
                status=status, dataset_version=dataset_version, tokenizer_hash=tokenizer_hash, error=error,
                run_dir=run_dir,
            ).items()
            if v is not None
        }
        if clear_error:
            changes["error"] = None
        changes["updated_at"] = time.time()

        def write(s: Session) -> RunRecord:
            if s.execute(update(Run).where(Run.id == run_id).values(**changes)).rowcount == 0:
                raise _no_run(run_id)
            row = s.get(Run, run_id, populate_existing=True)
            assert row is not None
            return _run_record(row)

        return self._tx(f"update run {run_id}", write, write=True, idempotent=True)

    def get_run(self, run_id: str) -> RunRecord:
        """The run with id ``run_id`` or the only run whose id starts with it."""

        def read(s: Session) -> RunRecord:
            if not run_id:
                raise _no_run(run_id)
            row = s.get(Run, run_id)
            if row is not None:
                return _run_record(row)
            query = select(Run).where(Run.id.startswith(run_id, autoescape=True)).order_by(Run.id).limit(6)
            matches = s.scalars(query).all()
            if len(matches) == 1:
                return _run_record(matches[0])
            if not matches:
                raise _no_run(run_id)
            shown = ", ".join(m.id for m in matches[:5]) + (", ..." if len(matches) > 5 else "")
            raise RegistryError(f"run id prefix {run_id!r} is ambiguous: it matches {shown}", hint=RUNS_HINT)

        return self._tx(f"read run {run_id}", read)

    def list_runs(self, limit: int = 50, status: str | None = None) -> list[RunRecord]:
        """Up to ``limit`` runs, newest first, optionally only those with ``status``."""
        query = select(Run).order_by(Run.created_at.desc(), Run.id.desc()).limit(limit)
        if status is not None:
            query = query.where(Run.status == status)
        return self._tx("list runs", lambda s: [_run_record(r) for r in s.scalars(query)])

    def runs_in_group(self, group: str) -> list[str]:
        """Ids of the runs that joined seed group ``group`` (a ``seed_group`` event), in the order they joined.

        ``group`` may be a unique prefix of the group id.
        """
        query = (select(Event.run_id, Event.message).where(Event.kind == "seed_group")
                 .where(Event.message.startswith(group, autoescape=True)).order_by(Event.id))

        def read(s: Session) -> list[str]:
            rows = s.execute(query).all()
            groups = sorted({m for _, m in rows})
            if len(groups) > 1:
                raise RegistryError(f"group prefix {group!r} is ambiguous: it matches {', '.join(groups[:5])}",
                                    hint="pass more of the group id")
            return list(dict.fromkeys(r for r, _ in rows))

        return self._tx(f"read group {group}", read)

    # -- metrics ----------------------------------------------------------

    def log_metrics(self, run_id: str, step: int, metrics: Mapping[str, float]) -> None:
        """Upsert every ``name -> value`` at ``step`` in one transaction (a rewritten step overwrites)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"log_metrics: step must be an int >= 0, got {step!r}")
        rows, nans = [], []
        for name, value in metrics.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"log_metrics: metric names must be non-empty strings, got {name!r}")
            value = float(value)
            if math.isnan(value) and self._dialect == "sqlite":
                nans.append(name)
            else:
                rows.append(dict(run_id=run_id, step=step, name=name, value=value))
        if not rows and not nans:
            return

        def write(s: Session) -> None:
            if rows:
                stmt = self._insert(Metric).values(rows)
                stmt = stmt.on_conflict_do_update(
                    index_elements=["run_id", "step", "name"], set_={"value": stmt.excluded.value}
                )
                s.execute(stmt)
            if nans:
                s.execute(delete(Metric).where(Metric.run_id == run_id, Metric.step == step, Metric.name.in_(nans)))
                for name in nans:
                    s.add(Event(
                        run_id=run_id, kind="metric_nonfinite", created_at=time.time(),
                        message=f"metric {name} at step {step} is NaN; SQLite cannot store NaN, so it is not in metrics",
                        data={"step": step, "name": name, "value": "nan"},
                    ))

        self._tx(f"log metrics for run {run_id}", write, write=True, idempotent=True, run_id=run_id)

    def metrics(self, run_id: str, names: Iterable[str] | None = None) -> list[MetricPoint]:
        """The run's metric points ordered by (step, name), optionally only ``names``."""
        query = select(Metric).where(Metric.run_id == run_id).order_by(Metric.step, Metric.name)
        if names is not None:
            query = query.where(Metric.name.in_(list(names)))

        def read(s: Session) -> list[MetricPoint]:
            points = [MetricPoint(run_id=m.run_id, step=m.step, name=m.name, value=m.value) for m in s.scalars(query)]
            return points or self._check_run(s, run_id, [])

        return self._tx(f"read metrics of run {run_id}", read)

    def last_metrics(self, run_id: str) -> dict[str, tuple[int, float]]:
        """For each metric name, ``(step, value)`` at the newest step that has it."""
        newest = (
            select(Metric.name, func.max(Metric.step).label("step"))
            .where(Metric.run_id == run_id)
            .group_by(Metric.name)
            .subquery()
        )
        query = select(Metric.name, Metric.step, Metric.value).join(
            newest, (Metric.name == newest.c.name) & (Metric.step == newest.c.step)
        ).where(Metric.run_id == run_id)

        def read(s: Session) -> dict[str, tuple[int, float]]:
            last = {name: (step, value) for name, step, value in s.execute(query)}
            return last or self._check_run(s, run_id, {})

        return self._tx(f"read metrics of run {run_id}", read)

    def delete_metrics_from(self, run_id: str, step: int) -> int:
        """Remove the run's metrics at ``step`` and later (a resume re-runs them); return the row count."""

        def write(s: Session) -> int:
            self._check_run(s, run_id, None)
            return s.execute(delete(Metric).where(Metric.run_id == run_id, Metric.step >= step)).rowcount

        return self._tx(f"delete metrics of run {run_id}", write, write=True)

    # -- checkpoints ------------------------------------------------------

    def add_checkpoint(self, run_id: str, step: int, path: str, manifest_sha256: str,
                       metrics: Mapping[str, float] | None = None) -> None:
        """Index a committed checkpoint (upsert on run and step, so a retry or a reconcile is harmless)."""
        values = dict(run_id=run_id, step=step, path=str(path), manifest_sha256=manifest_sha256,
                      created_at=time.time(), metrics=_json_safe(dict(metrics or {}), "checkpoint metrics"))

        def write(s: Session) -> None:
            stmt = self._insert(Checkpoint).values(**values)
            s.execute(stmt.on_conflict_do_update(
                index_elements=["run_id", "step"],
                set_={k: stmt.excluded[k] for k in ("path", "manifest_sha256", "created_at", "metrics")},
            ))

        self._tx(f"add checkpoint to run {run_id}", write, write=True, idempotent=True, run_id=run_id)

    def checkpoints(self, run_id: str) -> list[CheckpointRecord]:
        """The run's indexed checkpoints, oldest step first."""
        query = select(Checkpoint).where(Checkpoint.run_id == run_id).order_by(Checkpoint.step)

        def read(s: Session) -> list[CheckpointRecord]:
            found = [CheckpointRecord(run_id=c.run_id, step=c.step, path=c.path, manifest_sha256=c.manifest_sha256,
                                      created_at=c.created_at, metrics=c.metrics or {}) for c in s.scalars(query)]
            return found or self._check_run(s, run_id, [])

        return self._tx(f"read checkpoints of run {run_id}", read)

    def delete_checkpoint(self, run_id: str, step: int) -> None:
        """Remove the index row of the run's checkpoint at ``step`` (no error if there is none)."""
        self._tx(f"delete checkpoint of run {run_id}",
                 lambda s: s.execute(delete(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step)),
                 write=True)

    # -- events and evals -------------------------------------------------

    def add_event(self, run_id: str, kind: str, message: str, data: Mapping[str, Any] | None = None) -> None:
        """Append an event to the run's log."""
        row = dict(run_id=run_id, kind=kind, message=message, data=_json_safe(dict(data or {}), "event data"))
        self._tx(
            f"add event to run {run_id}",
            lambda s: s.add(Event(created_at=time.time(), **row)),
            write=True, run_id=run_id,
        )

    def events(self, run_id: str) -> list[EventRecord]:
        """The run's events, oldest first."""
        query = select(Event).where(Event.run_id == run_id).order_by(Event.id)

        def read(s: Session) -> list[EventRecord]:
            found = [
                EventRecord(run_id=e.run_id, kind=e.kind, message=e.message, created_at=e.created_at, data=e.data)
                for e in s.scalars(query)
            ]
            return found or self._check_run(s, run_id, [])

        return self._tx(f"read events of run {run_id}", read)

    def add_eval(self, record: EvalRecord) -> None:
        """Store one evaluation result."""
        values = {f: getattr(record, f) for f in _EVAL_FIELDS if f != "details"}
        values["details"] = _json_safe(dict(record.details), "eval details")
        self._tx(f"add eval to run {record.run_id}", lambda s: s.add(Eval(**values)), write=True,
                 run_id=record.run_id)

    def evals(self, run_id: str) -> list[EvalRecord]:
        """The run's evaluations, oldest first."""
        query = select(Eval).where(Eval.run_id == run_id).order_by(Eval.id)

        def read(s: Session) -> list[EvalRecord]:
            found = [
                EvalRecord(**{f: getattr(e, f) for f in _EVAL_FIELDS}) for e in s.scalars(query)
            ]
            return found or self._check_run(s, run_id, [])

        return self._tx(f"read evals of run {run_id}", read)

    # -- plumbing ---------------------------------------------------------

    def _check_run(self, s: Session, run_id: str, empty: T) -> T:
        """``empty`` if the run exists, else RegistryError (used when a query found nothing)."""
        if s.get(Run, run_id) is None:
            raise _no_run(run_id)
        return empty

    def _tx(
        self,
        what: str,
        fn: Callable[[Session], T],
        *,
        write: bool = False,
        idempotent: bool = True,
        run_id: str | None = None,
    ) -> T:
        """Run ``fn`` in one transaction; retry lock contention and (if idempotent) one dropped connection."""
        factory = self._write if write else self._read
        attempt, reconnected = 0, False
        while True:
            try:
                with factory() as session, session.begin():
                    return fn(session)
            except exc.IntegrityError as err:
                if run_id is not None and not self._run_exists(run_id):
                    raise _no_run(run_id) from err
                raise RegistryError(f"cannot {what}: {err.orig}", hint="this is likely a bug in the caller") from err
            except exc.DBAPIError as err:
                if _is_locked(err) and attempt < _LOCK_RETRIES:
                    time.sleep(_LOCK_BACKOFF_S * 2**attempt * (1 + random.random()))
                    attempt += 1
                    continue
                if err.connection_invalidated and idempotent and not reconnected:
                    reconnected = True
                    continue
                if _is_locked(err):
                    raise RegistryError(
                        f"cannot {what}: the registry {self.url} stayed locked by another writer",
                        hint="retry; if it persists, look for a stuck rlctl process holding the database",
                    ) from err
                raise RegistryError(f"cannot {what} in registry {self.url}: {err.orig}", hint=URL_HINT) from err

    def _run_exists(self, run_id: str) -> bool:
        with self._read() as s:
            return s.get(Run, run_id) is not None


def _is_locked(err: exc.DBAPIError) -> bool:
    return isinstance(err, exc.OperationalError) and "locked" in str(err.orig).lower()


def _no_run(run_id: str) -> RegistryError:
    return RegistryError(f"no run with id {run_id!r} in the registry", hint=RUNS_HINT)


def _run_record(row: Run) -> RunRecord:
    return RunRecord(
        id=row.id, name=row.name, status=row.status, config=row.config, config_hash=row.config_hash,
        code_version=row.code_version, dataset_version=row.dataset_version, tokenizer_hash=row.tokenizer_hash,
        seed=row.seed, run_dir=row.run_dir, created_at=row.created_at, updated_at=row.updated_at, error=row.error,
    )


def _json_safe(value: dict[str, Any], what: str) -> dict[str, Any]:
    """``value`` with non-finite floats as strings and tuples as lists, so every backend accepts it."""
    safe = _finite(value)
    try:
        json.dumps(safe, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what} must be JSON-serializable (str, int, float, bool, None, list, dict): {err}") from err
    return safe


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
