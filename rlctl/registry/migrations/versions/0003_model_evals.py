"""Model evals: pass@k of a model directory (checkpoint or exported HF model) evaluated without a run.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-03

Shipped: never edit this file; add a new revision instead.
"""

from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: Union[str, Sequence[str], None] = "0002"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    """Create model_evals."""
    op.create_table(
        "model_evals",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("model_hash", sa.String(128), nullable=False),
        sa.Column("model_dir", sa.Text(), nullable=False),
        sa.Column("split", sa.String(32), nullable=False),
        sa.Column("num_prompts", sa.Integer(), nullable=False),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Double(), nullable=False),
        sa.Column("results", sa.JSON(), nullable=False),
        sa.Column("details", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Double(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_evals"),
    )
    op.create_index("ix_model_evals_model_hash", "model_evals", ["model_hash"])


def downgrade() -> None:
    """Drop model_evals."""
    op.drop_index("ix_model_evals_model_hash", table_name="model_evals")
    op.drop_table("model_evals")
