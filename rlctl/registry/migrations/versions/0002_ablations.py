"""Ablations: a matrix of config cells x seeds and the run of each (cell, seed).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Shipped: never edit this file; add a new revision instead.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: Union[str, Sequence[str], None] = "0001"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Create ablations and ablation_runs."""
    op.create_table(
        "ablations",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("spec_hash", sa.String(128), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_ablations"),
    )
    op.create_index("ix_ablations_spec_hash", "ablations", ["spec_hash"])
    op.create_table(
        "ablation_runs",
        sa.Column("ablation_id", sa.String(64), nullable=False),
        sa.Column("cell", sa.String(255), nullable=False),
        sa.Column("seed", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("run_id", sa.String(64), nullable=True),
        sa.Column("status", sa.String(32), nullable=False),
        sa.Column("wall_s", sa.Double(), nullable=True),
        sa.Column("updated_at", sa.Double(), nullable=False),
        sa.ForeignKeyConstraint(["ablation_id"], ["ablations.id"], name="fk_ablation_runs_ablation_id_ablations",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"], name="fk_ablation_runs_run_id_runs", ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("ablation_id", "cell", "seed", name="pk_ablation_runs"),
    )


def downgrade() -> None:
    """Drop both tables."""
    op.drop_table("ablation_runs")
    op.drop_index("ix_ablations_spec_hash", table_name="ablations")
    op.drop_table("ablations")
