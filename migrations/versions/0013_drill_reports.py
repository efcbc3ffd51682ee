"""drill reports: the restart drills' checks and verdicts

Revision ID: 0013
Revises: 0011
Create Date: 2026-12-03 17:20:00.000000

``runhealth drill`` records each drill it runs (``monitor/drills``); ``runhealth drills RUN``
lists them. The run is a name, not a key: a drill comes before the long run it rehearses.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0013"
down_revision: str | Sequence[str] | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "drill_reports",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("run", sa.String(length=200), nullable=False),
        sa.Column("drill", sa.String(length=32), nullable=False),
        sa.Column("verdict", sa.String(length=16), nullable=False),
        sa.Column("checks", sa.JSON(), nullable=False),
        sa.Column("command", sa.Text(), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("workdir", sa.Text(), nullable=False),
        sa.Column("started_at", sa.Double(), nullable=False),
        sa.Column("finished_at", sa.Double(), nullable=False),
        sa.Column("created_by", sa.String(length=200), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_drill_reports")),
    )
    op.create_index(op.f("ix_drill_reports_run"), "drill_reports", ["run"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_drill_reports_run"), table_name="drill_reports")
    op.drop_table("drill_reports")
