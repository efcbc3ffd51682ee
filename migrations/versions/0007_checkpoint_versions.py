"""checkpoints identified by content: (run, path, step, manifest digest), the writing node, and
the files' sizes and times each validation saw

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01 23:45:00.000000

A path saved again with other content becomes a new row (its newer version), so the unique key
(run, path) widens to (run, path, step, manifest digest). Rows stored before have their digest
computed here from their manifest, by the rule of ``policies.checkpoints.manifest_digest`` at
this revision (written out: a migration is a snapshot, not a caller of today's code), so a
re-sent old record is still a duplicate of its row.

Downgrade keeps only the newest version at each path (the older key allows one); the older
versions are deleted.
"""

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from alembic import op

# revision identifiers, used by Alembic.
revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CHECKPOINTS = sa.table(
    "checkpoint_events",
    sa.column("id", sa.Integer),
    sa.column("run_id", sa.Integer),
    sa.column("path", sa.String),
    sa.column("time", sa.Double),
    sa.column("manifest", sa.JSON),
    sa.column("manifest_digest", sa.String),
)


def manifest_digest(manifest: Mapping[str, Any] | None) -> str:
    if not manifest:
        return ""
    files = sorted(
        (str(entry.get("path")), entry.get("size"), entry.get("sha256"))
        for entry in manifest.get("files") or ()
    )
    canonical = {"step": manifest.get("step"), "consumed": manifest.get("consumed"), "files": files}
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(encoded.encode()).hexdigest()


def upgrade() -> None:
    with op.batch_alter_table("checkpoint_events", schema=None) as batch_op:
        batch_op.add_column(sa.Column("node", sa.String(length=200), nullable=True))
        batch_op.add_column(
            sa.Column("manifest_digest", sa.String(length=64), nullable=False, server_default="")
        )
    connection = op.get_bind()
    for row in connection.execute(sa.select(CHECKPOINTS.c.id, CHECKPOINTS.c.manifest)).all():
        digest = manifest_digest(row.manifest)
        if digest:
            connection.execute(
                CHECKPOINTS.update().where(CHECKPOINTS.c.id == row.id).values(manifest_digest=digest)
            )
    with op.batch_alter_table("checkpoint_events", schema=None) as batch_op:
        batch_op.alter_column("manifest_digest", server_default=None)
        batch_op.drop_constraint(op.f("uq_checkpoint_events_run_id_path"), type_="unique")
        batch_op.create_unique_constraint(
            op.f("uq_checkpoint_events_run_id_path_step_manifest_digest"),
            ["run_id", "path", "step", "manifest_digest"],
        )
    with op.batch_alter_table("checkpoint_validations", schema=None) as batch_op:
        batch_op.add_column(sa.Column("files_seen", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoint_validations", schema=None) as batch_op:
        batch_op.drop_column("files_seen")
    connection = op.get_bind()
    rows = connection.execute(
        sa.select(CHECKPOINTS.c.id, CHECKPOINTS.c.run_id, CHECKPOINTS.c.path, CHECKPOINTS.c.time)
    ).all()
    newest: dict[tuple[int, str], tuple[float, int]] = {}
    for row in rows:
        key = (row.run_id, row.path)
        newest[key] = max(newest.get(key, (row.time, row.id)), (row.time, row.id))
    older = [row.id for row in rows if newest[(row.run_id, row.path)][1] != row.id]
    if older:
        connection.execute(CHECKPOINTS.delete().where(CHECKPOINTS.c.id.in_(older)))
    with op.batch_alter_table("checkpoint_events", schema=None) as batch_op:
        batch_op.drop_constraint(
            op.f("uq_checkpoint_events_run_id_path_step_manifest_digest"), type_="unique"
        )
        batch_op.create_unique_constraint(op.f("uq_checkpoint_events_run_id_path"), ["run_id", "path"])
        batch_op.drop_column("manifest_digest")
        batch_op.drop_column("node")
