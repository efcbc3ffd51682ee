"""audit hmac: each audit entry's HMAC under a key the store does not hold, and that key's id

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03 00:00:00.000000

Entries written before this revision keep null columns: they were never keyed, and
``runhealth audit verify`` with a key names the first of them.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.add_column(sa.Column("key_id", sa.String(length=16), nullable=True))
        batch_op.add_column(sa.Column("mac", sa.String(length=64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("audit_log", schema=None) as batch_op:
        batch_op.drop_column("mac")
        batch_op.drop_column("key_id")
