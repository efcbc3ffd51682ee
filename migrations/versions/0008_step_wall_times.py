"""step wall times: a CPU rank's forward, backward and optimizer wall seconds beside their CPU time

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 00:30:00.000000

On the CPU a rank's phases are its thread's CPU time, blind to a rank that waits (sleeps,
blocks on I/O, is preempted); the straggler rule judges their wall times too
(``policies.stragglers.OWN_WALL``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("forward_wall_s", "backward_wall_s", "optimizer_wall_s")


def upgrade() -> None:
    with op.batch_alter_table("step_records", schema=None) as batch_op:
        for name in COLUMNS:
            batch_op.add_column(sa.Column(name, sa.Double(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("step_records", schema=None) as batch_op:
        for name in reversed(COLUMNS):
            batch_op.drop_column(name)
