"""Initial registry schema: runs, metrics, events, checkpoints, evals.

Revision ID: 0001
Revises:
Create Date: 2025-01-01

Shipped: never edit this file; add a new revision instead.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0001"
down_revision: Union[str, Sequence[str], None] = None
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Create every table."""
    op.create_table(
        "runs",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("config_hash", sa.String(128), nullable=False),
        sa.Column("code_version", sa.String(255), nullable=False),
        sa.Column("dataset_version", sa.String(128), nullable=True),
        sa.Column("tokenizer_hash", sa.String(128), nullable=True),
        sa.Column("seed", sa.BigInteger(), nullable=False),
        sa.Column("run_dir", sa.Text(), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_runs"),
    )
    op.create_index("ix_runs_status", "runs", ["status"])
    op.create_index("ix_runs_created_at", "runs", ["created_at"])

    op.create_table(
        "metrics",
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("run_id", "step", "name", name="pk_metrics"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_metrics_run_id_runs"),
    )

    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("kind", sa.String(64), nullable=False),
        sa.Column("message", sa.Text(), nullable=False),
        sa.Column("data", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_events"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_events_run_id_runs"),
    )
    op.create_index("ix_events_run_id_id", "events", ["run_id", "id"])

    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("manifest_sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("metrics", sa.JSON(none_as_null=True), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_checkpoints"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_checkpoints_run_id_runs"),
        sa.UniqueConstraint("run_id", "step", name="uq_checkpoints_run_id_step"),
    )

    op.create_table(
        "evals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False),
        sa.Column("split", sa.String(32), nullable=False),
        sa.Column("num_prompts", sa.Integer(), nullable=False),
        sa.Column("baseline_name", sa.String(255), nullable=False),
        sa.Column("candidate_name", sa.String(255), nullable=False),
        sa.Column("baseline_pass_at_1", sa.Double(), nullable=False),
        sa.Column("candidate_pass_at_1", sa.Double(), nullable=False),
        sa.Column("diff", sa.Double(), nullable=False),
        sa.Column("ci_low", sa.Double(), nullable=False),
        sa.Column("ci_high", sa.Double(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_evals"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], ondelete="CASCADE", name="fk_evals_run_id_runs"),
    )
    op.create_index("ix_evals_run_id", "evals", ["run_id"])


def downgrade() -> None:
    """Drop every table (loses all registry data)."""
    for index, table in [("ix_evals_run_id", "evals"), ("ix_events_run_id_id", "events")]:
        op.drop_index(index, table_name=table)
    for table in ["evals", "checkpoints", "events", "metrics"]:
        op.drop_table(table)
    op.drop_index("ix_runs_created_at", table_name="runs")
    op.drop_index("ix_runs_status", table_name="runs")
    op.drop_table("runs")
