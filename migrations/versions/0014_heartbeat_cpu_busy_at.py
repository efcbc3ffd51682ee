"""heartbeat cpu_busy_at: when a compiling rank's processes last used CPU

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-07 23:00:00.000000

A rank's heartbeat says, while it compiles, when its process and its live descendants last used
CPU at a compiler's rate (``collectors/cpu_use.py``); the hang rule names a compilation idle for
``HangConfig.compile_idle_s`` (``policies/hangs.py``). Heartbeats from older hooks leave it null.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0014"
down_revision: str | Sequence[str] | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.add_column(sa.Column("cpu_busy_at", sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("heartbeats") as batch:
        batch.drop_column("cpu_busy_at")
