"""ORM tables of the run registry (SQLAlchemy 2 typed declarative).

What this is: the current shape of the schema, used by store.py for queries
and by Alembic to check that the migrations produce exactly this.

What this is not: the schema's history. The database is created and changed
only by migrations/versions/*; a change here needs a new migration, and a
shipped migration is never edited. ORM objects never leave the registry
package: store.py converts them to the contract dataclasses.

Timestamps are float seconds since the epoch (double precision). Paths and
hashes are stored, never tensors or blobs.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, BigInteger, Double, ForeignKey, Index, Integer, MetaData, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

RUN_ID = String(64)
RUN_FK = dict(ondelete="CASCADE")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {float: Double(), dict[str, Any]: JSON()}


class Run(Base):
    """One training run and the provenance that makes it reproducible."""

    __tablename__ = "runs"

    id: Mapped[str] = mapped_column(RUN_ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    status: Mapped[str] = mapped_column(String(32), index=True)
    config: Mapped[dict[str, Any]]
    config_hash: Mapped[str] = mapped_column(String(128))
    code_version: Mapped[str] = mapped_column(String(255))
    dataset_version: Mapped[str | None] = mapped_column(String(128))
    tokenizer_hash: Mapped[str | None] = mapped_column(String(128))
    seed: Mapped[int] = mapped_column(BigInteger)
    run_dir: Mapped[str] = mapped_column(Text)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[float] = mapped_column(index=True)
    updated_at: Mapped[float]


class Metric(Base):
    """One scalar at one step. (run_id, step, name) is the key: rewriting a step overwrites."""

    __tablename__ = "metrics"

    run_id: Mapped[str] = mapped_column(RUN_ID, ForeignKey("runs.id", **RUN_FK), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    value: Mapped[float]


class Event(Base):
    """Something that happened to a run (status change, warning, skipped metric)."""

    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(RUN_ID, ForeignKey("runs.id", **RUN_FK))
    kind: Mapped[str] = mapped_column(String(64))
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict[str, Any]]
    created_at: Mapped[float]


class Checkpoint(Base):
    """A committed checkpoint: where it lives and the hash of its manifest (reserved)."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(RUN_ID, ForeignKey("runs.id", **RUN_FK))
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    manifest_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float]
    metrics: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class Eval(Base):
    """One candidate-vs-baseline pass@1 comparison on one split."""

    __tablename__ = "evals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(RUN_ID, ForeignKey("runs.id", **RUN_FK), index=True)
    split: Mapped[str] = mapped_column(String(32))
    num_prompts: Mapped[int] = mapped_column(Integer)
    baseline_name: Mapped[str] = mapped_column(String(255))
    candidate_name: Mapped[str] = mapped_column(String(255))
    baseline_pass_at_1: Mapped[float]
    candidate_pass_at_1: Mapped[float]
    diff: Mapped[float]
    ci_low: Mapped[float]
    ci_high: Mapped[float]
    details: Mapped[dict[str, Any]]
    created_at: Mapped[float]


class ModelEval(Base):
    """pass@k of a model directory evaluated without a run, keyed by its weights' hash."""

    __tablename__ = "model_evals"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    model_hash: Mapped[str] = mapped_column(String(128), index=True)
    model_dir: Mapped[str] = mapped_column(Text)
    split: Mapped[str] = mapped_column(String(32))
    num_prompts: Mapped[int] = mapped_column(Integer)
    num_samples: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float]
    results: Mapped[dict[str, Any]]
    details: Mapped[dict[str, Any]]
    created_at: Mapped[float]


class Ablation(Base):
    """One ablation: a matrix of config cells x seeds compared at an equal generated-token budget.

    ``spec_hash`` identifies the request (base config, axes, seeds, budget):
    running the same request again continues this ablation.
    """

    __tablename__ = "ablations"

    id: Mapped[str] = mapped_column(RUN_ID, primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    spec_hash: Mapped[str] = mapped_column(String(128), index=True)
    spec: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[float]
    updated_at: Mapped[float]


class AblationRun(Base):
    """One (cell, seed) of an ablation and the run that computed it."""

    __tablename__ = "ablation_runs"

    ablation_id: Mapped[str] = mapped_column(RUN_ID, ForeignKey("ablations.id", ondelete="CASCADE"),
                                             primary_key=True)
    cell: Mapped[str] = mapped_column(String(255), primary_key=True)
    seed: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    run_id: Mapped[str | None] = mapped_column(RUN_ID, ForeignKey("runs.id", ondelete="SET NULL"))
    status: Mapped[str] = mapped_column(String(32))
    wall_s: Mapped[float | None]
    updated_at: Mapped[float]
