"""status checks: proposals, directives and acknowledgements hold only their lifecycle's statuses

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01 21:20:00.000000

The allowed values are written out here, not imported: a migration is a snapshot of the
schema at its revision, and a later change to a lifecycle needs a migration of its own
(``tests/test_store_status_checks.py`` fails until the store and the enums agree again).
"""

from collections.abc import Sequence

from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

STATUSES = {
    "proposals": (
        "pending",
        "escalated",
        "approved",
        "rejected",
        "superseded",
        "executing",
        "done",
        "failed",
    ),
    "directives": ("pending", "done", "failed", "superseded"),
    "directive_acks": ("done", "missed", "failed"),
}


def upgrade() -> None:
    # Batch mode: SQLite cannot add a constraint to a table in place, so the table is copied.
    for table, statuses in STATUSES.items():
        allowed = ", ".join(f"'{status}'" for status in statuses)
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.create_check_constraint(op.f(f"ck_{table}_status"), f"status IN ({allowed})")


def downgrade() -> None:
    for table in reversed(STATUSES):
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_constraint(op.f(f"ck_{table}_status"), type_="check")
